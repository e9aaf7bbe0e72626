"""Kueue's plain-pod protocol, driven through the pure `reconcile.plan` with the pods Kueue's
webhook and controller would produce (its admission gate, its `TerminationTarget` condition and
deletions). Written against Kueue's documented contract (`rlhf_operator.kueue`); no Kueue runs here
(tests/cluster/test_operator_kueue.py runs Kueue's real controller)."""

from __future__ import annotations

import copy
from typing import Any

from operator_helpers import job, names, running, scheduled, unschedulable
from test_operator_reconcile import pods_of, step

from rlhf_operator import failure_policy, kueue
from rlhf_operator.status import get_condition

GANG = ["j-actor-0", "j-actor-1", "j-controller", "j-reference-0"]
ROLLOUT = ["j-rollout-0", "j-rollout-1"]
GROUP_LABEL = "kueue.x-k8s.io/pod-group-name"
COUNT = "kueue.x-k8s.io/pod-group-total-count"


def queued_job(**spec: Any) -> dict[str, Any]:
    return job(scheduling={"queueName": "team-a", "timeoutSeconds": 60, "onTimeout": "fail", **spec})


def gated(pod: dict[str, Any]) -> dict[str, Any]:
    """As Kueue's webhook leaves a pod it manages: pending, its admission gate on."""
    p = copy.deepcopy(pod)
    p["metadata"]["uid"] = "uid-" + p["metadata"]["name"]
    p["metadata"]["labels"]["kueue.x-k8s.io/managed"] = "true"
    p["spec"]["schedulingGates"] = [{"name": kueue.ADMISSION_GATE}]
    p["status"] = {
        "phase": "Pending",
        "conditions": [{"type": "PodScheduled", "status": "False", "reason": "SchedulingGated"}],
    }
    return p


def stopped(pod: dict[str, Any]) -> dict[str, Any]:
    """What Kueue does to each pod of a group it preempts: TerminationTarget, then a delete."""
    p = running(pod)
    p["metadata"]["deletionTimestamp"] = "2025-01-01T12:00:30Z"
    p["status"]["conditions"].append(
        {"type": "TerminationTarget", "status": "True", "reason": "WorkloadEvicted", "message": "Preempted"}
    )
    return p


def group(pod: dict[str, Any]) -> str | None:
    return pod["metadata"]["labels"].get(GROUP_LABEL)


def cond(body: dict[str, Any], type_: str) -> tuple[str, str] | None:
    c = get_condition(body["status"], type_)
    return (c["status"], c["reason"]) if c else None


def running_queued_job() -> tuple[dict[str, Any], list[dict[str, Any]]]:
    body = queued_job()
    _, body = step(body, [])
    _, body = step(body, pods_of(body, state=gated), t=1)
    _, body = step(body, pods_of(body), t=2)
    assert body["status"]["phase"] == "Running"
    return body, pods_of(body)


def test_the_gang_is_one_group_and_the_rollout_fleet_is_admitted_pod_by_pod() -> None:
    body = queued_job()
    plan, _ = step(body, [])
    by_name = {p["metadata"]["name"]: p for p in plan.create}
    groups = {group(by_name[n]) for n in GANG}
    assert len(groups) == 1 and None not in groups
    # The group's count is the number of pods that carry its label: Kueue admits it once they exist.
    assert {by_name[n]["metadata"]["annotations"][COUNT] for n in GANG} == {str(len(GANG))}
    for n in ROLLOUT:
        assert group(by_name[n]) is None and COUNT not in by_name[n]["metadata"].get("annotations", {})
        assert by_name[n]["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "team-a"


def test_scale_changes_neither_the_group_nor_its_count() -> None:
    body, pods = running_queued_job()
    scaled = copy.deepcopy(body)
    scaled["spec"]["roles"]["rollout"]["replicas"] = 4
    plan, scaled = step(scaled, pods, t=10)
    assert names(plan.create) == ["j-rollout-2", "j-rollout-3"]
    assert all(group(p) is None for p in plan.create)
    everything = pods + [gated(p) for p in plan.create]
    members = [p for p in everything if group(p)]
    assert len({group(p) for p in members}) == 1
    assert {p["metadata"]["annotations"][COUNT] for p in members} == {str(len(members))}
    # The scale-up waits for its own admission; the running job is not disturbed.
    plan, scaled = step(scaled, everything, t=11)
    assert scaled["status"]["phase"] == "Running" and plan.delete == [] and plan.create == []


def test_a_queued_job_waits_without_its_scheduling_timeout_then_times_from_admission() -> None:
    body = queued_job()
    _, body = step(body, [])
    waiting = pods_of(body, state=gated)
    for t in (1, 100, 10_000):  # far past timeoutSeconds (60) with onTimeout: fail
        plan, body = step(body, waiting, t=t)
        assert body["status"]["phase"] == "Scheduling", t
        assert cond(body, "Queued") == ("True", "WaitingForKueue")
        assert cond(body, "Unschedulable") is None
        assert plan.delete == [] and plan.release == []
    assert (
        "6/6 pods wait for Kueue to admit them (LocalQueue team-a)"
        in get_condition(body["status"], "Queued")["message"]
    )  # type: ignore[index]

    # Admitted (gates gone) but no node fits: the timeout counts from the admission.
    stuck = [unschedulable(p, "0/3 nodes are available") for p in pods_of(body)]
    plan, body = step(body, stuck, t=20_000)
    assert cond(body, "Queued") == ("False", "Admitted")
    plan, body = step(body, stuck, t=20_059)
    assert body["status"]["phase"] == "Scheduling"
    plan, body = step(body, stuck, t=20_061)
    assert body["status"]["phase"] == "Failed" and cond(body, "Unschedulable") == ("True", "Unschedulable")
    # Failed: the group is released so that Kueue frees its quota.
    assert names(plan.release) == GANG


def test_success_releases_the_groups_quota() -> None:
    body, pods = running_queued_job()
    done = [running(p) if p["metadata"]["name"] != "j-controller" else p for p in pods]
    done = [copy.deepcopy(p) for p in done]
    next(p for p in done if p["metadata"]["name"] == "j-controller")["status"]["phase"] = "Succeeded"
    plan, body = step(body, done, t=10)
    assert body["status"]["phase"] == "Succeeded"
    # The workers are deleted (they end Failed, not Succeeded): Kueue would wait for replacements
    # and hold the quota; the annotation lets it finish the group once they stop.
    assert names(plan.delete) == sorted(set(GANG + ROLLOUT) - {"j-controller"})
    assert names(plan.release) == GANG  # the group's pods; rollout pods are single Workloads
    # Level-based: a later pass annotates what is still missing, nothing once done.
    annotated = [copy.deepcopy(p) for p in done]
    for p in annotated:
        if p["metadata"]["name"] != "j-actor-0":
            p["metadata"].setdefault("annotations", {})[kueue.RETRIABLE_IN_GROUP] = "false"
    plan, _ = step(body, annotated, t=11)
    assert names(plan.release) == ["j-actor-0"]


def test_kueue_preemption_is_a_suspension_then_a_new_group_queues_without_a_restart() -> None:
    body, pods = running_queued_job()
    old_group = group(next(p for p in pods if p["metadata"]["name"] == "j-controller"))
    preempted = [stopped(p) if p["metadata"]["name"] in GANG else p for p in pods]
    plan, body = step(body, preempted, t=30)
    assert body["status"]["phase"] == "Suspended"
    assert cond(body, "Suspended") == ("True", "StoppedByKueue")
    assert names(plan.delete) == ROLLOUT  # Kueue deletes the group's pods itself
    assert names(plan.release) == GANG
    assert [e.reason for e in plan.events] == ["StoppedByKueue"]

    # Next pass: resumed as a new pod group; the old pods still terminate (their names are held).
    released = copy.deepcopy(preempted)
    for p in released:
        if group(p):
            p["metadata"].setdefault("annotations", {})[kueue.RETRIABLE_IN_GROUP] = "false"
    plan, body = step(body, released, t=31)
    assert body["status"]["phase"] == "Pending" and body["status"]["restarts"] == 0
    assert plan.create == [] and not [e for e in plan.events if e.type == "Warning"]

    # The old pods gone: the gang comes back in a new group, which Kueue queues afresh.
    plan, body = step(body, [], t=40)
    assert names(plan.create) == sorted(GANG + ROLLOUT)
    new_groups = {group(p) for p in plan.create if p["metadata"]["name"] in GANG}
    assert len(new_groups) == 1 and old_group not in new_groups
    plan, body = step(body, [gated(p) for p in plan.create], t=41)
    assert body["status"]["phase"] == "Scheduling" and cond(body, "Queued") == ("True", "WaitingForKueue")
    assert body["status"]["restarts"] == 0


def test_a_gang_restart_releases_the_old_group_and_starts_a_new_one() -> None:
    body, pods = running_queued_job()
    old_group = group(pods[0]) or group(pods[1])
    crashed = [
        running(p) if p["metadata"]["name"] != "j-actor-0" else {**running(p), "status": {"phase": "Failed"}}
        for p in pods
    ]
    plan, body = step(body, crashed, t=10)
    assert body["status"]["phase"] == "Restarting" and body["status"]["restarts"] == 1
    assert names(plan.release) == GANG
    plan, body = step(body, [], t=100)
    new = {group(p) for p in plan.create if group(p)}
    assert len(new) == 1 and old_group not in new


def test_spec_suspend_releases_the_group() -> None:
    body, pods = running_queued_job()
    body["spec"]["suspend"] = True
    plan, body = step(body, pods, t=10)
    assert body["status"]["phase"] == "Suspended"
    assert names(plan.release) == GANG


def test_a_recreated_job_never_joins_its_predecessors_group() -> None:
    first = pods_of(queued_job())
    again = queued_job()
    again["metadata"]["uid"] = "uid-2"
    second = pods_of(again)
    assert {group(p) for p in first if group(p)}.isdisjoint({group(p) for p in second if group(p)})


def test_group_names_fit_a_label_value() -> None:
    name = kueue.group_name("x" * 63, "uid", 7, "2025-01-01T00:00:00Z")
    assert len(name) <= 63 and name.startswith("x")
    assert kueue.group_name("j", "uid", 0) != kueue.group_name("j", "uid", 1)
    assert kueue.group_name("j", "uid", 0) != kueue.group_name("j", "uid", 0, "2025-01-01T00:00:00Z")


def test_without_a_queue_nothing_is_gated_released_or_labelled() -> None:
    body = job()
    plan, body = step(body, [])
    assert all(GROUP_LABEL not in p["metadata"]["labels"] for p in plan.create)
    _, body = step(body, pods_of(body, state=scheduled), t=1)
    plan, body = step(body, [running(p) for p in pods_of(body)], t=2)
    body["spec"]["suspend"] = True
    plan, _ = step(body, [running(p) for p in pods_of(body)], t=3)
    assert plan.release == [] and cond(body, "Queued") is None


def test_a_rollout_pod_kueue_stopped_is_a_preemption_replaced_alone() -> None:
    body, pods = running_queued_job()
    hit = [stopped(p) if p["metadata"]["name"] == "j-rollout-0" else p for p in pods]
    f = failure_policy.pod_failure(next(p for p in hit if p["metadata"]["name"] == "j-rollout-0"))
    assert f is not None and (f.reason, f.cause) == ("StoppedByKueue", "Preempted")
    plan, body = step(body, hit, t=30)
    assert body["status"]["phase"] == "Running" and body["status"]["restarts"] == 0
    assert plan.release == []  # a single pod's Workload ends when the pod does
    plan, body = step(body, [p for p in hit if p["metadata"]["name"] != "j-rollout-0"], t=31)
    assert names(plan.create) == ["j-rollout-0"]
    assert body["status"]["phase"] == "Running" and body["status"]["restarts"] == 0
