"""Ownership by UID: a job counts, adopts and deletes only what its controller owner reference
names. Driven through the pure `reconcile.plan` and the executor against an in-memory API."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from operator_helpers import at, job, names, phase, with_status
from test_operator_executor import FakeKube, run

from rlhf_api.loader import parse_job
from rlhf_api.status import CHILD_FAILURE
from rlhf_operator import children, ownership, reconcile
from rlhf_operator.executor import Executor
from rlhf_operator.status import get_condition

ALL = ["j-actor-0", "j-actor-1", "j-controller", "j-reference-0", "j-rollout-0", "j-rollout-1"]


def recreated(body: dict[str, Any], uid: str = "uid-2") -> dict[str, Any]:
    """The same manifest applied again after a delete: a new UID, no status."""
    out = copy.deepcopy(body)
    out["metadata"]["uid"] = uid
    out.pop("status", None)
    return out


@pytest.mark.parametrize(
    "refs,owned",
    [
        (
            [
                {
                    "apiVersion": "rlhf.dev/v1alpha1",
                    "kind": "RLTrainingJob",
                    "name": "j",
                    "uid": "u",
                    "controller": True,
                }
            ],
            True,
        ),
        (
            [
                {
                    "apiVersion": "rlhf.dev/v1alpha1",
                    "kind": "RLTrainingJob",
                    "name": "j",
                    "uid": "old",
                    "controller": True,
                }
            ],
            False,
        ),
        (
            [{"apiVersion": "rlhf.dev/v1alpha1", "kind": "RLTrainingJob", "name": "j", "uid": "u"}],
            False,
        ),  # not controller
        ([{"apiVersion": "batch/v1", "kind": "Job", "name": "j", "uid": "u", "controller": True}], False),
        (
            [
                {
                    "apiVersion": "other.io/v1",
                    "kind": "RLTrainingJob",
                    "name": "j",
                    "uid": "u",
                    "controller": True,
                }
            ],
            False,
        ),
        ([], False),
        (None, False),
    ],
)
def test_owned_only_through_a_controller_reference_with_the_jobs_uid(refs: Any, owned: bool) -> None:
    obj: dict[str, Any] = {"metadata": {"name": "x"}}
    if refs is not None:
        obj["metadata"]["ownerReferences"] = refs
    assert ownership.owned_by(obj, "u") is owned
    assert ownership.owned_by(obj, "") is False  # a job without a UID owns nothing


def test_recreated_job_does_not_inherit_its_predecessors_pods() -> None:
    old = job()
    built = children.build_pods(parse_job(old), 0)
    # The predecessor finished: its controller pod Succeeded, the rest still exist (GC pending).
    old_pods = [phase(p, "Succeeded") for p in built.values()]
    new = recreated(old)

    plan = reconcile.plan(new, old_pods, at(0))
    assert plan.status["phase"] == "Pending"  # not Succeeded from the old controller pod
    assert plan.events == []
    assert plan.create == []  # every name is still held by a pod of the old job
    assert plan.delete == []  # never delete what is not ours: the garbage collector does
    assert [b.name for b in plan.blocked] == ALL
    assert {b.reason for b in plan.blocked} == {"NotOwned"}
    assert "uid-1" in plan.blocked[0].describe() and "uid-2" in plan.blocked[0].describe()

    # The collector removes two of them: those two are created, the others still wait.
    left = [p for p in old_pods if p["metadata"]["name"] not in ("j-actor-0", "j-controller")]
    plan = reconcile.plan(with_status(new, plan.status), left, at(1))
    assert names(plan.create) == ["j-actor-0", "j-controller"]
    assert all(p["metadata"]["ownerReferences"][0]["uid"] == "uid-2" for p in plan.create)
    assert len(plan.blocked) == 4

    plan = reconcile.plan(with_status(new, plan.status), [], at(2))
    assert names(plan.create) == ALL and plan.blocked == []


def test_a_labelled_pod_without_our_owner_is_neither_counted_nor_deleted() -> None:
    body = job()
    pods = [phase(p, "Running") for p in children.build_pods(parse_job(body), 0).values()]
    for p in pods:
        p["metadata"]["ownerReferences"] = []  # a user's pods wearing the job's labels and names
    plan = reconcile.plan(body, pods, at(0))
    assert plan.status["phase"] == "Pending" and plan.delete == [] and plan.create == []
    assert len(plan.blocked) == len(ALL)
    assert "it has no controller owner" in plan.blocked[0].describe()


def foreign(kind: str, name: str, api_version: str = "v1", **extra: Any) -> dict[str, Any]:
    return {
        "apiVersion": api_version,
        "kind": kind,
        "metadata": {"name": name, "namespace": "ns", "uid": f"user-{kind}"},
        **extra,
    }


@pytest.mark.parametrize(
    "kind,name,extra",
    [
        # The job's identity is named from its UID (`children.identity_name`): held only by
        # someone who read the UID after the job was created.
        ("ServiceAccount", "j-uid-1", {}),
        ("Role", "j-uid-1", {"rules": []}),
        ("RoleBinding", "j-uid-1", {"subjects": []}),
        ("ConfigMap", "j-spec", {"data": {"job.yaml": "users: data"}}),
        ("Service", "j", {"spec": {"selector": {"app": "user"}}}),
    ],
)
@pytest.mark.parametrize("workers", [1, 4], ids=["one-by-one", "in-parallel"])
def test_a_same_named_child_the_job_does_not_own_is_refused_not_adopted(
    kind: str, name: str, extra: dict[str, Any], workers: int
) -> None:
    fake = FakeKube(job())
    api_version = "rbac.authorization.k8s.io/v1" if kind.startswith("Role") else "v1"
    theirs = foreign(kind, name, api_version, **extra)
    fake.objects[(kind, name)] = copy.deepcopy(theirs)
    ex = Executor(fake, create_workers=workers)  # type: ignore[arg-type]
    out = run(ex)

    assert fake.objects[(kind, name)] == theirs  # never overwritten
    assert not any(k == "Pod" for k, _ in fake.objects)  # no pod runs with its token/account
    assert fake.job is not None
    cond = get_condition(fake.job["status"], CHILD_FAILURE)
    assert cond is not None and cond["status"] == "True" and cond["reason"] == "NotOwned"
    assert cond["message"].startswith(f"{kind} {name}: already exists in namespace ns")
    assert "it has no controller owner" in cond["message"]
    warnings = [e for e in fake.events if e[1] == "NotOwned"]
    assert len(warnings) == 1 and warnings[0][0] == "Warning" and f"{kind} {name}" in warnings[0][2]
    assert out.requeue_after is not None and out.requeue_after >= 5

    run(ex, 10)  # still there: no second Event, still no pods
    assert len([e for e in fake.events if e[1] == "NotOwned"]) == 1
    assert not any(k == "Pod" for k, _ in fake.objects)

    del fake.objects[(kind, name)]  # the user removes it: the job's own is created, then its pods
    run(ex, 20)
    mine = fake.objects[(kind, name)]
    assert mine["metadata"]["ownerReferences"][0]["uid"] == "uid-1"
    assert sum(1 for k, _ in fake.objects if k == "Pod") == len(ALL)
    cond = get_condition(fake.job["status"], CHILD_FAILURE)
    assert cond is not None and cond["status"] == "False"


def test_the_ray_token_secret_is_named_after_the_jobs_uid_so_no_earlier_secret_is_used() -> None:
    fake = FakeKube(job())
    users = foreign("Secret", "j-ray-token", stringData={"token": "the-users-token"})
    fake.objects[("Secret", "j-ray-token")] = copy.deepcopy(users)
    run(Executor(fake))  # type: ignore[arg-type]
    assert fake.objects[("Secret", "j-ray-token")] == users
    mine = fake.objects[("Secret", "j-ray-token-uid-1")]
    assert mine["metadata"]["ownerReferences"][0]["uid"] == "uid-1"
    assert mine["stringData"]["token"] != "the-users-token"
    pods = [o for (k, _), o in fake.objects.items() if k == "Pod"]
    refs = {
        e["valueFrom"]["secretKeyRef"]["name"]
        for p in pods
        for c in p["spec"]["containers"]
        for e in c["env"]
        if "secretKeyRef" in e.get("valueFrom", {})
    }
    assert len(pods) == len(ALL) and refs == {"j-ray-token-uid-1"}


def test_recreated_job_gets_fresh_children_not_its_predecessors() -> None:
    fake = FakeKube(job())
    run(Executor(fake))  # type: ignore[arg-type]
    old_token = fake.objects[("Secret", "j-ray-token-uid-1")]["stringData"]["token"]
    # Deleted and recreated under the same name before the garbage collector ran.
    assert fake.job is not None
    fake.job = recreated(fake.job)
    ex = Executor(fake)  # type: ignore[arg-type]
    run(ex, 1)
    assert fake.job["status"]["phase"] == "Pending"
    cond = get_condition(fake.job["status"], CHILD_FAILURE)
    assert cond is not None and cond["reason"] == "NotOwned" and "uid uid-1" in cond["message"]
    # Only the children named from the new UID exist yet (its identity and token); no pod.
    new = {n for (_, n), o in fake.objects.items() if o["metadata"]["ownerReferences"][0]["uid"] == "uid-2"}
    assert new <= {"j-uid-2", "j-ray-token-uid-2"} and not any(
        k == "Pod" and n in new for k, n in fake.objects
    )

    fake.objects.clear()  # the garbage collector removes the predecessor's children
    run(ex, 30)
    assert fake.objects, "nothing was created"
    assert all(o["metadata"]["ownerReferences"][0]["uid"] == "uid-2" for o in fake.objects.values())
    assert ("Secret", "j-ray-token-uid-1") not in fake.objects
    assert fake.objects[("Secret", "j-ray-token-uid-2")]["stringData"]["token"] != old_token
    assert sum(1 for k, _ in fake.objects if k == "Pod") == len(ALL)
