"""The executor against an in-memory API (no cluster): write order, optimistic concurrency, and a
crash in the middle of creating a job's children."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
from operator_helpers import WORK_CLAIM, at, job, merge_patch

from rlhf_operator import crd, kube, kueue, parse_cache, reconcile
from rlhf_operator.cache import PodCache
from rlhf_operator.executor import Executor
from rlhf_operator.status import get_condition


class Crash(Exception):
    pass


class FakeKube:
    """Objects by (kind, name); pods get a uid; the job's resourceVersion moves on every write."""

    def __init__(self, body: dict[str, Any], crash_after_creates: int | None = None) -> None:
        self.job: dict[str, Any] | None = copy.deepcopy(body)
        self.objects: dict[tuple[str, str], dict[str, Any]] = {}
        self.log: list[str] = []
        self.crash_after = crash_after_creates
        self.creates = 0
        self.conflict_next_status = False
        #: Objects the API server refuses to create, by name: (HTTP status, server message).
        self.reject: dict[str, tuple[int, str]] = {}
        self.events: list[tuple[str, str, str]] = []
        #: Claims the namespace holds, by name (read, never created by the operator).
        self.claims: dict[str, dict[str, Any]] = {"work": copy.deepcopy(WORK_CLAIM)}

    def _bump(self) -> None:
        assert self.job is not None
        self.job["metadata"]["resourceVersion"] = str(int(self.job["metadata"]["resourceVersion"]) + 1)

    def get_job(self, namespace: str, name: str) -> dict[str, Any] | None:
        return copy.deepcopy(self.job)

    def list_pods(self, namespace: str, job: str) -> list[dict[str, Any]]:
        return [copy.deepcopy(o) for (k, _), o in sorted(self.objects.items()) if k == "Pod"]

    def get(self, obj: dict[str, Any]) -> dict[str, Any] | None:
        if obj["kind"] == "PersistentVolumeClaim":
            claim = self.claims.get(obj["metadata"]["name"])
            return copy.deepcopy(claim) if claim is not None else None
        stored = self.objects.get((obj["kind"], obj["metadata"]["name"]))
        return copy.deepcopy(stored) if stored is not None else None

    def create(self, obj: dict[str, Any]) -> bool:
        key = (obj["kind"], obj["metadata"]["name"])
        if key in self.objects:
            return False
        if self.crash_after is not None and self.creates >= self.crash_after:
            raise Crash("operator killed")
        role = obj.get("roleRef") or {}
        if obj["kind"] == "RoleBinding" and ("Role", role.get("name")) not in self.objects:
            # As the API server's RBAC escalation check: the roleRef must resolve.
            raise LookupError(
                f"POST rolebindings: roles.rbac.authorization.k8s.io {role.get('name')!r} not found"
            )
        if obj["metadata"]["name"] in self.reject:
            code, message = self.reject[obj["metadata"]["name"]]
            self.log.append(f"refused {obj['kind']} {obj['metadata']['name']}")
            raise kube.Rejected(f"POST: HTTP {code}: {message}", code, message)
        self.creates += 1
        stored = copy.deepcopy(obj)
        stored["metadata"]["uid"] = f"uid-{self.creates}"
        self.objects[key] = stored
        self.log.append(f"create {obj['kind']} {obj['metadata']['name']}")
        return True

    def merge_patch(self, obj: dict[str, Any], patch: dict[str, Any]) -> None:
        key = (obj["kind"], obj["metadata"]["name"])
        self.objects[key] = merge_patch(self.objects[key], patch)
        self.log.append(f"patch {obj['kind']} {obj['metadata']['name']}")

    def patch_metadata(self, obj: dict[str, Any], metadata: dict[str, Any]) -> None:
        key = (obj.get("kind", "Pod"), obj["metadata"]["name"])
        if key in self.objects and self.objects[key]["metadata"]["uid"] == obj["metadata"].get("uid"):
            self.objects[key] = merge_patch(self.objects[key], {"metadata": metadata})
            self.log.append(f"annotate {key[0]} {key[1]}")

    def delete(self, obj: dict[str, Any]) -> None:
        if obj["kind"] == "RLTrainingJob":
            self.job = None
            return
        key = (obj.get("kind", "Pod"), obj["metadata"]["name"])
        if key in self.objects and self.objects[key]["metadata"]["uid"] == obj["metadata"].get("uid"):
            del self.objects[key]
            self.log.append(f"delete {key[0]} {key[1]}")

    def patch_status(self, body: dict[str, Any], status: dict[str, Any]) -> dict[str, Any]:
        assert self.job is not None
        if (
            self.conflict_next_status
            or body["metadata"]["resourceVersion"] != self.job["metadata"]["resourceVersion"]
        ):
            self.conflict_next_status = False
            raise kube.Conflict("stale")
        self.job["status"] = merge_patch(self.job.get("status") or {}, status)
        self._bump()
        self.log.append(f"status {status.get('phase', '')}".rstrip())
        return copy.deepcopy(self.job)

    def patch_job_annotations(self, body: dict[str, Any], annotations: dict[str, str]) -> dict[str, Any]:
        assert self.job is not None
        if body["metadata"]["resourceVersion"] != self.job["metadata"]["resourceVersion"]:
            raise kube.Conflict("stale")
        self.job["metadata"] = merge_patch(self.job["metadata"], {"annotations": annotations})
        self._bump()
        self.log.append("record " + ",".join(f"{k}={v}" for k, v in sorted(annotations.items())))
        return copy.deepcopy(self.job)

    def event(self, body: dict[str, Any], type_: str, reason: str, message: str, now: str) -> None:
        self.log.append(f"event {reason}")
        self.events.append((type_, reason, message))

    def set_pods(self, phase: str) -> None:
        for (k, _), o in self.objects.items():
            if k == "Pod":
                o.setdefault("spec", {})["nodeName"] = "n"
                o["status"] = {"phase": phase}


def run(ex: Executor, t: float = 0) -> Any:
    return ex.reconcile("ns", "j", now=at(t))


def test_first_pass_writes_status_before_creating_children() -> None:
    fake = FakeKube(job())
    run(Executor(fake))  # type: ignore[arg-type]
    kinds = [entry for entry in fake.log]
    assert kinds[:7] == [
        "create ServiceAccount j-uid-1",
        "create Role j-uid-1",
        "create RoleBinding j-uid-1",
        "create Secret j-ray-token-uid-1",
        "create ConfigMap j-spec",
        "create Service j",
        "create NetworkPolicy j",
    ]
    assert kinds[7] == "status Pending"
    assert sum(1 for e in kinds if e.startswith("create Pod")) == 6


def test_a_claim_that_is_not_read_write_many_holds_the_gang_back_until_it_is() -> None:
    """The executor reads the claim the checkpoints lie on (`storage.shared_claims`) and hands its
    access modes to the plan: ReadWriteOnce for three writer pods creates no pod and names the
    claim; once the claim is ReadWriteMany, the next pass creates the gang (nothing else changed)."""
    fake = FakeKube(job())
    fake.claims["work"]["status"]["accessModes"] = ["ReadWriteOnce"]
    out = run(Executor(fake))  # type: ignore[arg-type]
    assert not any(e.startswith("create Pod") for e in fake.log)
    assert out.requeue_after == reconcile.CLAIM_RECHECK_SECONDS and out.invalid is None
    assert fake.job is not None
    got = get_condition(fake.job["status"], "StorageNotShared")
    assert got is not None and got["status"] == "True"
    assert "persistentVolumeClaim 'work' with access mode ReadWriteOnce" in got["message"]
    assert fake.job["status"]["phase"] == "Pending"
    fake.claims["work"]["status"]["accessModes"] = ["ReadWriteMany"]
    run(Executor(fake))  # type: ignore[arg-type]
    assert sum(1 for e in fake.log if e.startswith("create Pod")) == 6
    got = get_condition(fake.job["status"], "StorageNotShared")
    assert got is not None and got["status"] == "False"


class _ForbiddenApiClient:
    """The official ApiClient's two calls `kube.Kube` makes, answering every request as the API
    server does a GET the caller's RBAC does not allow: ApiException(status=403), Status body."""

    def __init__(self) -> None:
        self.urls: list[str] = []

    def param_serialize(self, method: str, resource_path: str, **_: Any) -> tuple[str, str]:
        return method, resource_path

    def call_api(self, method: str, url: str, **_: Any) -> Any:
        from kubernetes.client import ApiException

        self.urls.append(f"{method} {url}")
        name = url.rsplit("/", 1)[-1]
        message = (
            f'persistentvolumeclaims "{name}" is forbidden: User '
            '"system:serviceaccount:rlhf-system:rlhf-operator" cannot get resource '
            '"persistentvolumeclaims" in API group "" in the namespace "ns"'
        )
        raise ApiException(
            status=403,
            reason="Forbidden",
            body=json.dumps(
                {
                    "kind": "Status",
                    "status": "Failure",
                    "message": message,
                    "reason": "Forbidden",
                    "code": 403,
                }
            ),
        )


def test_a_claim_the_operator_may_not_read_holds_the_gang_back_with_a_condition_naming_the_verb() -> None:
    """An older chart's ClusterRole lacks `get` on persistentvolumeclaims: the claim's GET, through
    `kube.Kube` on an ApiClient that raises the client's ApiException(status=403), gives the job
    StorageNotShared (reason ClaimsForbidden) naming the verb, the resource and the namespace, one
    Warning Event, no pod and a recheck after CLAIM_RECHECK_SECONDS; no exception leaves the pass
    (before, the pass raised kube.Rejected every 5 s and the job said nothing). A second pass
    repeats no Event; once the read is allowed, the gang is created."""
    fake = FakeKube(job())
    denied = _ForbiddenApiClient()
    real = kube.Kube(api_client=denied)
    allowed = fake.get
    fake.get = lambda obj: real.get(obj) if obj["kind"] == "PersistentVolumeClaim" else allowed(obj)  # type: ignore[method-assign]
    out = run(Executor(fake))  # type: ignore[arg-type]
    assert denied.urls == ["GET /api/v1/namespaces/ns/persistentvolumeclaims/work"]
    assert not any(e.startswith("create Pod") for e in fake.log)
    assert out.requeue_after == reconcile.CLAIM_RECHECK_SECONDS and out.invalid is None
    assert fake.job is not None and fake.job["status"]["phase"] == "Pending"
    got = get_condition(fake.job["status"], "StorageNotShared")
    assert got is not None and got["status"] == "True" and got["reason"] == "ClaimsForbidden"
    assert "may not get the persistentVolumeClaim 'work' in namespace 'ns'" in got["message"]
    assert "lacks the verb get on persistentvolumeclaims" in got["message"]
    assert 'cannot get resource "persistentvolumeclaims"' in got["message"]  # the server's words
    assert [e[:2] for e in fake.events] == [("Warning", "ClaimsForbidden")]
    run(Executor(fake), t=20)  # type: ignore[arg-type]
    assert [e[:2] for e in fake.events] == [("Warning", "ClaimsForbidden")]  # said once
    assert not any(e.startswith("create Pod") for e in fake.log)
    fake.get = allowed  # type: ignore[method-assign]
    run(Executor(fake), t=40)  # type: ignore[arg-type]
    assert sum(1 for e in fake.log if e.startswith("create Pod")) == 6
    got = get_condition(fake.job["status"], "StorageNotShared")
    assert got is not None and got["status"] == "False"


def test_a_stale_status_write_does_nothing_else_and_asks_for_a_retry() -> None:
    fake = FakeKube(job())
    fake.conflict_next_status = True
    out = run(Executor(fake))  # type: ignore[arg-type]
    assert out.requeue_after == 0.0
    assert not any(e.startswith("create Pod") for e in fake.log)


@pytest.mark.parametrize("crash_after", [0, 3, 7, 9])
def test_crash_mid_creation_then_a_new_operator_converges_without_duplicates(crash_after: int) -> None:
    fake = FakeKube(job(), crash_after_creates=crash_after)
    with pytest.raises(Crash):
        run(Executor(fake))  # type: ignore[arg-type]
    fake.crash_after = None
    # A new Executor has an empty memory, like a new process.
    restarted = Executor(fake)  # type: ignore[arg-type]
    run(restarted, 1)
    run(restarted, 2)
    names = sorted(n for k, n in fake.objects if k == "Pod")
    assert names == ["j-actor-0", "j-actor-1", "j-controller", "j-reference-0", "j-rollout-0", "j-rollout-1"]
    assert len(fake.objects) == 13  # 7 static children + 6 pods, each once
    assert fake.job is not None and fake.job["status"]["phase"] == "Scheduling"
    assert fake.job["status"]["restarts"] == 0


def test_secret_is_never_overwritten_and_config_map_follows_the_spec() -> None:
    fake = FakeKube(job())
    ex = Executor(fake)  # type: ignore[arg-type]
    run(ex)
    token = fake.objects[("Secret", "j-ray-token-uid-1")]["stringData"]["token"]
    assert fake.job is not None
    fake.job["spec"]["roles"]["rollout"]["replicas"] = 3
    run(Executor(fake), 1)  # type: ignore[arg-type]
    assert fake.objects[("Secret", "j-ray-token-uid-1")]["stringData"]["token"] == token
    assert "replicas: 3" in fake.objects[("ConfigMap", "j-spec")]["data"]["job.yaml"]


def test_steady_state_pass_makes_no_write() -> None:
    fake = FakeKube(job())
    ex = Executor(fake)  # type: ignore[arg-type]
    run(ex)
    fake.set_pods("Running")
    run(ex, 1)
    run(ex, 2)
    assert fake.job is not None and fake.job["status"]["phase"] == "Running"
    before = list(fake.log)
    run(ex, 3)
    assert fake.log == before


def test_ttl_deletes_the_job() -> None:
    fake = FakeKube(job(ttlSecondsAfterFinished=10))
    ex = Executor(fake)  # type: ignore[arg-type]
    run(ex)
    fake.set_pods("Running")
    run(ex, 1)
    run(ex, 2)
    fake.objects[("Pod", "j-controller")]["status"] = {"phase": "Succeeded"}
    assert run(ex, 3).requeue_after == 10
    assert run(ex, 14).gone
    assert fake.job is None


def test_no_write_loop_when_a_reported_value_disappears() -> None:
    fake = FakeKube(job())
    ex = Executor(fake)  # type: ignore[arg-type]
    run(ex)
    fake.set_pods("Running")
    run(ex, 1)
    assert fake.job is not None
    fake.job["status"]["progress"] = {"step": 1, "reward": 0.5}
    run(ex, 2)
    assert fake.job["status"]["summary"]["reward"] == 0.5
    del fake.job["status"]["progress"]
    run(ex, 3)
    assert "reward" not in fake.job["status"]["summary"]
    before = list(fake.log)
    run(ex, 4)
    assert fake.log == before


class WatchedKube(FakeKube):
    """FakeKube whose pod writes reach a `PodCache` as the operator's pod watch would deliver
    them (after the pass), and that counts the LISTs."""

    def __init__(self, body: dict[str, Any]) -> None:
        super().__init__(body)
        self.lists = 0

    def list_pods_versioned(self, namespace: str, job: str) -> tuple[list[dict[str, Any]], str]:
        self.lists += 1
        return self.list_pods(namespace, job), "1"

    def deliver(self, cache: PodCache, seen: dict[str, Any]) -> None:
        """Watch events for every pod change since `seen` (name -> last delivered body)."""
        now = {o["metadata"]["name"]: o for (k, _), o in self.objects.items() if k == "Pod"}
        for name, body in now.items():
            if seen.get(name) != body:
                cache.observe(
                    "MODIFIED", {**copy.deepcopy(body), "metadata": {**body["metadata"], "namespace": "ns"}}
                )
        for name in set(seen) - set(now):
            cache.observe("DELETED", {"metadata": {**seen[name]["metadata"], "namespace": "ns"}})
        seen.clear()
        seen.update(copy.deepcopy(now))


def test_with_the_pod_cache_a_job_is_listed_once_and_reaches_running() -> None:
    fake = WatchedKube(job())
    pods = PodCache()
    ex = Executor(fake, pod_cache=pods)  # type: ignore[arg-type]
    seen: dict[str, Any] = {}
    run(ex)
    fake.deliver(pods, seen)
    fake.set_pods("Running")
    fake.deliver(pods, seen)
    run(ex, 1)
    run(ex, 2)
    assert fake.job is not None and fake.job["status"]["phase"] == "Running"
    assert fake.lists == 1  # the first pass seeded the cache; the watch kept it current
    before = list(fake.log)
    run(ex, 3)
    assert fake.log == before  # steady state: no write either
    ex.forget("ns", "j")
    run(ex, 4)
    assert fake.lists == 2


def test_a_pass_before_the_watch_showed_new_pods_creates_no_duplicate() -> None:
    fake = WatchedKube(job())
    ex = Executor(fake, pod_cache=PodCache())  # type: ignore[arg-type]
    run(ex)
    created = sum(1 for e in fake.log if e.startswith("create Pod"))
    run(ex, 1)  # the cache has not seen them: the creates answer AlreadyExists
    assert sum(1 for e in fake.log if e.startswith("create Pod")) == created


class SlowRoleKube(FakeKube):
    """Creating the Role waits until a RoleBinding is attempted (at most a second), so that a
    RoleBinding sent alongside its Role reaches the API before the Role exists, every time."""

    def __init__(self, body: dict[str, Any]) -> None:
        super().__init__(body)
        self.binding_attempted = threading.Event()

    def create(self, obj: dict[str, Any]) -> bool:
        if obj["kind"] == "RoleBinding":
            self.binding_attempted.set()
        elif obj["kind"] == "Role":
            self.binding_attempted.wait(timeout=1.0)
        return super().create(obj)


def test_parallel_creation_creates_every_child_and_pod_once() -> None:
    fake = SlowRoleKube(job())
    ex = Executor(fake, create_workers=4)  # type: ignore[arg-type]
    run(ex)  # a RoleBinding before its Role: LookupError, the pass fails
    static = [e for e in fake.log if e.startswith("create") and not e.startswith("create Pod")]
    assert sorted(static) == sorted(
        f"create {k}"
        for k in (
            "ServiceAccount j-uid-1",
            "Role j-uid-1",
            "RoleBinding j-uid-1",
            "Secret j-ray-token-uid-1",
            "ConfigMap j-spec",
            "Service j",
            "NetworkPolicy j",
        )
    )
    assert fake.log.index("status Pending") == len(static)  # every child before the status write
    assert sorted(e for e in fake.log if e.startswith("create Pod")) == [
        f"create Pod j-{n}"
        for n in ("actor-0", "actor-1", "controller", "reference-0", "rollout-0", "rollout-1")
    ]


def test_a_finished_kueue_job_releases_its_group_before_deleting_the_workers() -> None:
    fake = FakeKube(job(scheduling={"queueName": "team-a"}))
    ex = Executor(fake)  # type: ignore[arg-type]
    run(ex)
    fake.set_pods("Running")
    run(ex, 1)
    run(ex, 2)
    fake.objects[("Pod", "j-controller")]["status"] = {"phase": "Succeeded"}
    mark = len(fake.log)
    run(ex, 3)
    log = fake.log[mark:]
    annotated = [e for e in log if e.startswith("annotate")]
    assert annotated == [f"annotate Pod j-{n}" for n in ("actor-0", "actor-1", "controller", "reference-0")]
    assert max(log.index(e) for e in annotated) < min(i for i, e in enumerate(log) if e.startswith("delete"))
    assert (
        fake.objects[("Pod", "j-controller")]["metadata"]["annotations"][kueue.RETRIABLE_IN_GROUP] == "false"
    )
    mark = len(fake.log)
    run(ex, 4)
    assert not [e for e in fake.log[mark:] if e.startswith("annotate")]  # done once


QUOTA = 'pods "j-actor-0" is forbidden: exceeded quota: gpu, requested: requests.nvidia.com/gpu=8, used: 0, limited: 4'


def conditions(fake: FakeKube, type_: str) -> dict[str, Any]:
    assert fake.job is not None
    return next(c for c in fake.job["status"]["conditions"] if c["type"] == type_)


def test_quota_refused_pod_is_reported_once_retried_and_cleared_when_it_goes_through() -> None:
    fake = FakeKube(job())
    fake.reject["j-actor-0"] = (403, QUOTA)
    ex = Executor(fake)  # type: ignore[arg-type]
    out = run(ex)
    assert out.requeue_after == 5 and out.phase == "Pending"
    cond = conditions(fake, "ChildFailure")
    assert (cond["status"], cond["reason"]) == ("True", "QuotaExceeded") and QUOTA in cond["message"]
    warnings = [e for e in fake.events if e[1] == "QuotaExceeded"]
    assert len(warnings) == 1 and warnings[0][0] == "Warning" and "Pod j-actor-0" in warnings[0][2]
    assert "create Pod j-actor-1" not in fake.log  # the pass stops at the first refusal

    for t, delay in ((7, 7), (20, 20)):  # retried as long as it has been refused: no new Event or write
        writes = sum(1 for e in fake.log if e.startswith("status"))
        assert run(ex, t).requeue_after == delay
        assert sum(1 for e in fake.log if e.startswith("status")) == writes
    assert len([e for e in fake.events if e[1] == "QuotaExceeded"]) == 1

    del fake.reject["j-actor-0"]  # another job finished: the quota has room
    run(ex, 30)
    cond = conditions(fake, "ChildFailure")
    assert (cond["status"], cond["reason"]) == ("False", "ChildrenCreated")
    assert sum(1 for k, _ in fake.objects if k == "Pod") == 6


def test_invalid_pod_fails_the_job_and_the_next_pass_frees_the_rest() -> None:
    fake = FakeKube(job())
    invalid = (
        'Pod "j-rollout-0" is invalid: spec.affinity: Invalid value: "Among": not a valid selector operator'
    )
    fake.reject["j-rollout-0"] = (422, invalid)
    ex = Executor(fake)  # type: ignore[arg-type]
    out = run(ex)
    assert out.phase == "Failed" and out.requeue_after == 0
    failed = conditions(fake, "Failed")
    assert failed["reason"] == "ChildRejected" and invalid in failed["message"]
    assert [e[1] for e in fake.events if e[0] == "Warning"] == ["ChildRejected"]
    run(ex, 1)
    assert not any(k == "Pod" for k, _ in fake.objects)  # pods created before the refusal are deleted
    before = list(fake.log)
    run(ex, 2)
    assert fake.log == before  # finished: no more creates, no more reports


def test_refused_static_child_is_reported_and_no_pod_is_created() -> None:
    fake = FakeKube(job())
    fake.reject["j-uid-1"] = (
        403,
        'serviceaccounts "j-uid-1" is forbidden: exceeded quota: objects, limited: count/serviceaccounts=0',
    )
    out = run(Executor(fake))  # type: ignore[arg-type]
    assert out.requeue_after == 5
    assert not any(e.startswith("create Pod") for e in fake.log)
    cond = conditions(fake, "ChildFailure")
    assert cond["reason"] == "QuotaExceeded" and cond["message"].startswith("ServiceAccount j-uid-1: refused")


class RefusingApi:
    """An ApiClient whose every call gets the given HTTP status and Status body."""

    def __init__(self, status: int, message: str) -> None:
        self.status, self.message = status, message

    def param_serialize(self, **kwargs: Any) -> tuple[Any, ...]:
        return (kwargs["method"], kwargs["resource_path"])

    def call_api(self, *args: Any, **kwargs: Any) -> Any:
        from kubernetes.client.exceptions import ApiException

        err = ApiException(status=self.status, reason="refused")
        err.body = json.dumps({"kind": "Status", "status": "Failure", "message": self.message}).encode()
        raise err


@pytest.mark.parametrize("status", [400, 403, 422])
def test_kube_turns_refusals_into_rejected_with_the_servers_message(status: int) -> None:
    client = kube.Kube(RefusingApi(status, QUOTA))
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "j-actor-0", "namespace": "ns"}}
    with pytest.raises(kube.Rejected) as err:
        client.create(pod)
    assert err.value.code == status and err.value.server_message == QUOTA
    assert isinstance(err.value, kube.Retry)  # callers that do not report it still retry it


def test_kube_keeps_other_errors_transient() -> None:
    client = kube.Kube(RefusingApi(500, "etcdserver: request timed out"))
    with pytest.raises(kube.Retry) as err:
        client.create({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p", "namespace": "ns"}})
    assert not isinstance(err.value, kube.Rejected)


def test_static_children_are_built_only_when_the_job_changed(monkeypatch: pytest.MonkeyPatch) -> None:
    from rlhf_operator import children

    built: list[str] = []
    real = children.build_config_map

    def build_config_map(job: Any) -> dict[str, Any]:
        built.append(job.metadata_name)
        return real(job)

    monkeypatch.setattr(children, "build_config_map", build_config_map)
    fake = FakeKube(job())
    ex = Executor(fake)  # type: ignore[arg-type]
    run(ex)
    fake.set_pods("Running")
    run(ex, 1)
    first = len(built)
    run(ex, 2)  # status moved (resourceVersion too): the job did not
    run(ex, 3)
    assert len(built) == first
    assert fake.job is not None
    fake.job["spec"]["roles"]["rollout"]["replicas"] = 3
    run(ex, 4)
    assert len(built) > first
    assert "replicas: 3" in fake.objects[("ConfigMap", "j-spec")]["data"]["job.yaml"]


def test_a_pass_sees_the_pods_it_just_listed_whatever_the_relist_period() -> None:
    """`RLHF_OPERATOR_RELIST_SECONDS=0` (list on every pass): the pass must see the pods its own
    LIST returned. It used to read the cache again after seeding it, which says "list again" at
    once, and take that as no pods: a Running gang saw every pod missing and restarted."""
    fake = WatchedKube(job())
    pods = PodCache(relist_seconds=0)
    ex = Executor(fake, pod_cache=pods)  # type: ignore[arg-type]
    seen: dict[str, Any] = {}
    run(ex)
    fake.deliver(pods, seen)
    fake.set_pods("Running")
    fake.deliver(pods, seen)
    run(ex, 1)
    run(ex, 2)
    assert fake.job is not None and fake.job["status"]["phase"] == "Running"
    run(ex, 3)
    assert fake.job["status"]["phase"] == "Running"
    assert not fake.job["status"].get("restarts"), fake.job["status"]
    assert not [e for e in fake.log if e.startswith("delete")], fake.log


def _queued_pods_of_a_deleted_job() -> tuple[FakeKube, list[dict[str, Any]]]:
    """A queued job's pods, created by a pass, then the job deleted and its pods being deleted by
    the garbage collector (as `kubectl delete rltj` does)."""
    fake = FakeKube(job(scheduling={"queueName": "team-a"}))
    run(Executor(fake))  # type: ignore[arg-type]
    assert fake.job is not None
    uid = fake.job["metadata"]["uid"]
    for (kind, _), o in fake.objects.items():
        if kind == "Pod":
            o["metadata"]["ownerReferences"] = [{"kind": "RLTrainingJob", "name": "j", "uid": uid}]
            o["metadata"]["deletionTimestamp"] = "2025-01-01T12:00:00Z"
    fake.job = None
    return fake, [copy.deepcopy(o) for (k, _), o in sorted(fake.objects.items()) if k == "Pod"]


def test_the_pod_groups_of_a_deleted_job_are_released() -> None:
    """Kueue holds a group's quota and its pods (its finalizer) until the group ends; pods the
    garbage collector deletes never all succeed, so the operator releases them though the job is
    gone (seen on Kueue v0.17: the pods stayed Terminating and the quota held)."""
    fake, pods = _queued_pods_of_a_deleted_job()
    ex = Executor(fake)  # type: ignore[arg-type]
    for pod in pods:
        ex.release_orphan(pod)
    released = sorted(n for (k, n), o in fake.objects.items() if k == "Pod" and kueue.released(o))
    assert released == ["j-actor-0", "j-actor-1", "j-controller", "j-reference-0"]  # the gang, not rollout
    fake.log.clear()
    for pod in [o for (k, _), o in sorted(fake.objects.items()) if k == "Pod"]:
        ex.release_orphan(copy.deepcopy(pod))  # each once: nothing left to do
    assert fake.log == []


def test_pods_of_a_live_job_are_left_to_its_reconcile() -> None:
    fake, pods = _queued_pods_of_a_deleted_job()
    fake.job = job(scheduling={"queueName": "team-a"})  # the job still exists (same UID)
    ex = Executor(fake)  # type: ignore[arg-type]
    for pod in pods:
        ex.release_orphan(pod)
    assert not any(kueue.released(o) for (k, _), o in fake.objects.items() if k == "Pod")
    # A job recreated under the same name is another job: the old pods are orphans.
    fake.job["metadata"]["uid"] = "uid-recreated"
    for pod in pods:
        ex.release_orphan(pod)
    assert sum(kueue.released(o) for (k, _), o in fake.objects.items() if k == "Pod") == 4


@pytest.mark.parametrize("digest_matches", [True, False])
def test_the_crd_rules_are_left_to_the_api_server_only_when_it_runs_this_operators_crd(
    digest_matches: bool,
) -> None:
    """A job the CRD's CEL rules refuse (PPO without a critic) can only exist when the installed CRD
    lacks the rule: with this operator's CRD installed the operator trusts the server's admission
    and creates the job's pods; with another CRD (digest differs) it evaluates every rule itself
    and fails the job, as before."""
    parse_cache.clear()
    digest = crd.expected_schema_digest() if digest_matches else "sha256:" + "1" * 64
    rules = parse_cache.InstalledRules(lambda: {crd.SCHEMA_DIGEST_ANNOTATION: digest})
    fake = FakeKube(job(algorithm={"name": "ppo"}))
    ex = Executor(fake, installed_rules=rules)  # type: ignore[arg-type]
    out = run(ex)
    ex.forget("ns", "j")  # the operator's metrics are global: leave no job behind
    assert fake.job is not None
    if digest_matches:
        assert out.invalid is None
        assert any(e.startswith("create Pod") for e in fake.log)
    else:
        assert out.invalid and "critic" in out.invalid
        assert fake.job["status"]["phase"] == "Failed"
        assert not any(e.startswith("create Pod") for e in fake.log)


def test_an_operator_that_trusts_the_api_server_never_imports_the_cel_interpreter() -> None:
    """The CEL interpreter (cel-python and its parser, lark) is most of the operator's peak memory;
    with this operator's CRD installed, a whole pass must run without it."""
    code = """
import sys
sys.path.insert(0, sys.argv[1])
from operator_helpers import job
from test_operator_executor import FakeKube
from rlhf_operator import crd, parse_cache
from rlhf_operator.executor import Executor
rules = parse_cache.InstalledRules(lambda: {crd.SCHEMA_DIGEST_ANNOTATION: crd.expected_schema_digest()})
fake = FakeKube(job())
Executor(fake, installed_rules=rules).reconcile("ns", "j")
assert any(e.startswith("create Pod") for e in fake.log), fake.log
print(sorted(m for m in sys.modules if m.split(".")[0] in ("celpy", "lark")))
"""
    here = str(Path(__file__).parent)
    res = subprocess.run([sys.executable, "-c", code, here], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "[]"


def test_a_pass_right_after_a_status_write_has_nothing_to_do() -> None:
    """The operator does not wake a job's daemon for the watch event of the daemon's own status
    write (`Executor.own_write`). That is only sound if such a pass never has anything to do,
    unless the pass that wrote also created, deleted or patched pods (their watch events wake
    the daemon) or asked to run again at once. A job walked through creation, scheduling, a gang
    restart, suspend, resume and success, with a pass on the echo of every other write."""
    fake = FakeKube(job())
    ex = Executor(fake)  # type: ignore[arg-type]
    echoes = 0

    def step(t: float) -> None:
        nonlocal echoes
        assert fake.job is not None
        version, start = fake.job["metadata"]["resourceVersion"], len(fake.log)
        out = run(ex, t)
        touched_pods = any(
            e.split()[:2] in (["create", "Pod"], ["delete", "Pod"], ["annotate", "Pod"])
            for e in fake.log[start:]
        )
        if fake.job is None or fake.job["metadata"]["resourceVersion"] == version:
            return
        assert ex.own_write("ns", "j", fake.job["metadata"]["resourceVersion"])
        if touched_pods or out.requeue_after == 0:
            return
        before = list(fake.log)
        run(ex, t)  # the echo: the same job, the same pods, the same time
        assert fake.log == before, f"the echo of a write at t={t} made {fake.log[len(before) :]}"
        echoes += 1

    step(0)
    fake.set_pods("Pending")
    step(1)
    fake.set_pods("Running")
    step(2)
    fake.objects[("Pod", "j-actor-1")]["status"] = {"phase": "Failed", "reason": "Error"}
    step(3)  # gang restart: pods deleted, backoff
    for t in (4, 20, 40):
        step(t)
    fake.set_pods("Running")
    step(60)
    assert fake.job is not None and fake.job["status"]["phase"] == "Running"
    fake.job["spec"]["suspend"] = True
    step(61)
    fake.objects = {k: v for k, v in fake.objects.items() if k[0] != "Pod"}  # the kubelet stopped them
    step(62)
    fake.job["spec"]["suspend"] = False
    step(63)
    fake.set_pods("Running")
    step(64)
    fake.objects[("Pod", "j-controller")]["status"] = {"phase": "Succeeded"}
    step(65)
    assert fake.job is not None and fake.job["status"]["phase"] == "Succeeded"
    assert echoes >= 4  # the check above ran (most writes here come with pod changes)
    assert not ex.own_write("ns", "j", "someone else's")
    ex.forget("ns", "j")  # the operator's metrics are global: leave no job behind


def test_with_debug_logging_each_pass_says_where_its_time_went(caplog: pytest.LogCaptureFixture) -> None:
    fake = FakeKube(job())
    with caplog.at_level("DEBUG", logger="rlhf_operator"):
        run(Executor(fake, create_workers=4))  # type: ignore[arg-type]
    (line,) = [r.getMessage() for r in caplog.records if ": pass " in r.getMessage()]
    stages = [part.split()[0] for part in line.split("(", 1)[1].rstrip(")").split(", ")]
    assert stages == ["get", "parse/autoscale", "pods", "plan[Pending]", "static", "status", "create[6]"]
