"""The pure reconcile: observed job + pods in, plan out. Each test is one situation a restarted
operator could find; no cluster, no kopf."""

from __future__ import annotations

import copy
from typing import Any

from operator_helpers import at, job, names, phase, running, scheduled, unschedulable, with_status

from rlhf_api.loader import parse_job
from rlhf_operator import children, pass_state, reconcile
from rlhf_operator.status import get_condition

ALL = ["j-actor-0", "j-actor-1", "j-controller", "j-reference-0", "j-rollout-0", "j-rollout-1"]
GANG = ["j-actor-0", "j-actor-1", "j-controller", "j-reference-0"]


def pods_of(
    body: dict[str, Any], attempt: int = 0, rollout: int | None = None, state: Any = running
) -> list[dict[str, Any]]:
    built = children.build_pods(parse_job(body), attempt, rollout_replicas=rollout)
    return [state(p) for p in built.values()]


def step(
    body: dict[str, Any], pods: list[dict[str, Any]], t: float = 0
) -> tuple[pass_state.Plan, dict[str, Any]]:
    """One pass; returns the plan and the job with the plan's status applied (as the API would)."""
    plan = reconcile.plan(body, pods, at(t))
    return plan, with_status(body, plan.status)


def running_job(restarts: int = 0) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    body = job()
    _, body = step(body, [])
    _, body = step(body, pods_of(body, state=scheduled))
    _, body = step(body, pods_of(body))
    assert body["status"]["phase"] == "Running"
    return body, pods_of(body)


def test_new_job_creates_every_pod_then_waits_for_the_scheduler() -> None:
    body = job()
    plan, body = step(body, [])
    assert names(plan.create) == ALL
    assert plan.delete == []
    assert body["status"]["phase"] == "Pending"
    assert body["status"]["rollout"] == {
        "desired": 2,
        "ready": 0,
        "selector": "rlhf.dev/job-name=j,rlhf.dev/role=rollout",
        "generation": 1,
    }
    assert body["status"]["summary"] == {"step": "0/20", "rollout": "0/2"}

    plan, body = step(body, pods_of(body, state=lambda p: p), t=1)
    assert plan.create == []
    assert body["status"]["phase"] == "Scheduling"
    assert [e.reason for e in plan.events] == ["PodsCreated"]

    plan, body = step(body, pods_of(body), t=2)
    assert body["status"]["phase"] == "Running"
    assert body["status"]["startTime"] == "2025-01-01T12:00:02Z"
    assert body["status"]["rollout"]["ready"] == 2
    assert get_condition(body["status"], "Running")["status"] == "True"  # type: ignore[index]


def test_operator_killed_mid_creation_creates_only_the_missing_pods() -> None:
    body = job()
    plan, body = step(body, [])
    half = [scheduled(p) for p in plan.create[:3]]
    plan2, body2 = step(body, half, t=1)
    assert names(plan2.create) == sorted(set(ALL) - set(names(half)))
    assert body2["status"]["phase"] == "Pending"


def test_steady_state_plan_is_empty_and_status_unchanged() -> None:
    body, pods = running_job()
    plan, _ = step(body, pods, t=10)
    assert (plan.create, plan.delete, plan.events) == ([], [], [])
    assert pass_state.operator_status(body["status"]) == pass_state.operator_status(plan.status)


def test_failed_actor_restarts_the_whole_gang_after_backoff() -> None:
    body, pods = running_job()
    pods = [phase(p, "Failed", "Error") if p["metadata"]["name"] == "j-actor-1" else p for p in pods]
    plan, body = step(body, pods, t=100)
    st = body["status"]
    assert st["phase"] == "Restarting" and st["restarts"] == 1
    assert names(plan.delete) == ALL  # every pod of attempt 0
    assert plan.create == []
    assert plan.requeue_after == 10
    assert [e.reason for e in plan.events] == ["GangRestart"]
    assert "j-actor-1 failed" in get_condition(st, "Restarting")["message"]  # type: ignore[index]
    assert st["rollout"]["generation"] == 2

    # Old pods still terminating, backoff not over: nothing created.
    deleting = [dict(p, metadata={**p["metadata"], "deletionTimestamp": "x"}) for p in pods]
    plan, body = step(body, deleting, t=105)
    assert plan.create == [] and plan.delete == []
    assert plan.requeue_after == 5

    # Backoff over, old pods gone: attempt 1 created with the same names.
    plan, body = step(body, [], t=111)
    assert names(plan.create) == ALL
    assert {p["metadata"]["labels"]["rlhf.dev/restart-attempt"] for p in plan.create} == {"1"}
    plan, body = step(body, pods_of(body, attempt=1, state=lambda p: p), t=112)
    assert body["status"]["phase"] == "Scheduling"
    assert get_condition(body["status"], "Restarting")["status"] == "False"  # type: ignore[index]
    plan, body = step(body, pods_of(body, attempt=1), t=113)
    assert body["status"]["phase"] == "Running" and body["status"]["restarts"] == 1


def test_pod_lost_with_its_node_counts_as_a_failure() -> None:
    body, pods = running_job()
    plan, body = step(body, [p for p in pods if p["metadata"]["name"] != "j-actor-0"], t=50)
    assert body["status"]["restarts"] == 1
    assert get_condition(body["status"], "Restarting")["reason"] == "PodLost"  # type: ignore[index]


def test_restart_counts_once_even_if_the_pass_is_repeated() -> None:
    body, pods = running_job()
    pods = [phase(p, "Failed") if p["metadata"]["name"] == "j-actor-0" else p for p in pods]
    _, body = step(body, pods, t=50)
    _, body = step(body, pods, t=51)  # same observation again (events replayed)
    assert body["status"]["restarts"] == 1


def test_max_restarts_exhausted_fails_the_job() -> None:
    body, pods = running_job()
    body = with_status(body, {"restarts": 2})
    pods = pods_of(body, attempt=2)
    pods = [phase(p, "Failed", "OOMKilled") if p["metadata"]["name"] == "j-reference-0" else p for p in pods]
    plan, body = step(body, pods, t=60)
    st = body["status"]
    assert st["phase"] == "Failed" and st["restarts"] == 2
    failed = get_condition(st, "Failed")
    assert failed["reason"] == "MaxRestartsExceeded"  # type: ignore[index]
    assert "maxRestarts (2) exhausted" in failed["message"] and "j-reference-0" in failed["message"]  # type: ignore[index]
    assert st["completionTime"] == "2025-01-01T12:01:00Z"
    assert names(plan.delete) == sorted(set(ALL) - {"j-reference-0"})  # running pods freed, failed kept


def test_failed_rollout_pod_is_replaced_alone() -> None:
    body, pods = running_job()
    pods = [phase(p, "Failed") if p["metadata"]["name"] == "j-rollout-1" else p for p in pods]
    plan, body = step(body, pods, t=30)
    assert body["status"]["phase"] == "Running" and body["status"]["restarts"] == 0
    assert names(plan.delete) == ["j-rollout-1"]
    assert [e.reason for e in plan.events] == ["RolloutReplicaFailed"]
    gen = body["status"]["rollout"]["generation"]
    # Once gone it is recreated, and the membership generation moves once.
    plan, body = step(body, [p for p in pods if p["metadata"]["name"] != "j-rollout-1"], t=31)
    assert names(plan.create) == ["j-rollout-1"]
    assert body["status"]["rollout"]["generation"] == gen + 1
    assert body["status"]["restarts"] == 0


def test_scale_up_creates_pods_and_bumps_generation() -> None:
    body, pods = running_job()
    body["spec"]["roles"]["rollout"]["replicas"] = 4
    plan, body = step(body, pods, t=40)
    assert names(plan.create) == ["j-rollout-2", "j-rollout-3"]
    assert body["status"]["rollout"]["generation"] == 2
    assert body["status"]["rollout"]["desired"] == 4
    assert body["status"]["summary"]["rollout"] == "2/4"
    assert [e.reason for e in plan.events] == ["RolloutMembershipChanged"]


def test_scale_down_deletes_a_leaving_pod_only_after_the_controller_synced() -> None:
    body, pods = running_job()
    body["spec"]["roles"]["rollout"]["replicas"] = 1
    plan, body = step(body, pods, t=40)
    assert plan.delete == []  # j-rollout-1 drains first
    assert body["status"]["rollout"]["generation"] == 2
    plan, body = step(body, pods, t=41)
    assert plan.delete == []
    body = with_status(body, {"rollout": {**body["status"]["rollout"], "syncedGeneration": 2}})
    plan, body = step(body, pods, t=42)
    assert names(plan.delete) == ["j-rollout-1"]
    assert body["status"]["rollout"]["generation"] == 2  # no second bump
    assert body["status"]["rollout"]["syncedGeneration"] == 2  # the controller's key is never rewritten


def test_controller_pod_succeeded_finishes_the_job_then_ttl_deletes_it() -> None:
    body, pods = running_job()
    body["spec"]["ttlSecondsAfterFinished"] = 30
    pods = [phase(p, "Succeeded") if p["metadata"]["name"] == "j-controller" else p for p in pods]
    plan, body = step(body, pods, t=100)
    assert body["status"]["phase"] == "Succeeded"
    assert names(plan.delete) == sorted(set(ALL) - {"j-controller"})
    assert plan.requeue_after == 30
    plan, body = step(body, pods, t=120)
    assert not plan.delete_job and plan.requeue_after == 10
    plan, _ = step(body, pods, t=130)
    assert plan.delete_job


def test_suspend_removes_pods_and_resume_recreates_them() -> None:
    body, pods = running_job()
    body["spec"]["suspend"] = True
    plan, body = step(body, pods, t=10)
    assert body["status"]["phase"] == "Suspended"
    assert names(plan.delete) == ALL
    assert body["status"]["restarts"] == 0
    body["spec"]["suspend"] = False
    plan, body = step(body, [], t=20)
    assert body["status"]["phase"] == "Pending"
    assert names(plan.create) == ALL
    assert get_condition(body["status"], "Suspended")["reason"] == "Resumed"  # type: ignore[index]


def test_unschedulable_after_timeout_reports_the_scheduler_message() -> None:
    body = job()
    _, body = step(body, [])
    waiting = pods_of(body, state=scheduled)
    waiting[0] = unschedulable(waiting[0], "0/12 nodes are available: 12 Insufficient nvidia.com/gpu.")
    plan, body = step(body, waiting, t=1)
    assert body["status"]["phase"] == "Scheduling"
    plan, body = step(body, waiting, t=30)
    assert get_condition(body["status"], "Unschedulable") is None
    assert plan.requeue_after == 31
    plan, body = step(body, waiting, t=62)
    cond = get_condition(body["status"], "Unschedulable")
    assert cond and cond["status"] == "True" and "Insufficient nvidia.com/gpu" in cond["message"]
    assert body["status"]["phase"] == "Scheduling"  # onTimeout: wait
    assert [e.reason for e in plan.events] == ["Unschedulable"]
    plan, body = step(body, waiting, t=63)
    assert plan.events == []  # reported once


def test_unschedulable_with_on_timeout_fail_fails_the_job() -> None:
    body = job(scheduling={"timeoutSeconds": 5, "onTimeout": "fail"})
    _, body = step(body, [])
    waiting = pods_of(body, state=lambda p: unschedulable(p, "no nodes"))
    _, body = step(body, waiting, t=1)
    plan, body = step(body, waiting, t=7)
    assert body["status"]["phase"] == "Failed"
    assert get_condition(body["status"], "Failed")["reason"] == "Unschedulable"  # type: ignore[index]
    assert names(plan.delete) == ALL


def test_invalid_spec_fails_with_the_field_named() -> None:
    body = job(training={"promptsPerStep": 3, "miniBatchSize": 5})
    plan, body = step(body, [])
    assert plan.invalid and "spec.training.miniBatchSize" in plan.invalid
    assert body["status"]["phase"] == "Failed"
    assert get_condition(body["status"], "Failed")["reason"] == "InvalidSpec"  # type: ignore[index]


def test_stale_attempt_pods_are_deleted_not_adopted() -> None:
    body, pods = running_job()
    body = with_status(body, {"restarts": 1, "phase": "Scheduling"})
    current = pods_of(body, attempt=1)
    stale = copy.deepcopy(current[0])
    stale["metadata"]["labels"]["rlhf.dev/restart-attempt"] = "0"
    stale["metadata"]["name"] = "j-rollout-9"
    plan, _ = step(body, [*current, stale], t=5)
    assert names(plan.delete) == ["j-rollout-9"]


def test_progress_written_by_the_controller_shows_in_the_summary() -> None:
    body, pods = running_job()
    body = with_status(body, {"progress": {"step": 7, "totalSteps": 20, "reward": 0.5}})
    plan, body = step(body, pods, t=5)
    assert body["status"]["summary"]["step"] == "7/20"
    assert "progress" not in plan.status  # never written by the operator


def test_reward_column_reads_either_progress_shape() -> None:
    body, pods = running_job()
    _, top = step(with_status(body, {"progress": {"step": 2, "reward": 0.25}}), pods, t=5)
    assert top["status"]["summary"]["reward"] == 0.25
    _, nested = step(
        with_status(body, {"progress": {"step": 2, "metrics": {"reward_mean": "0.5"}}}), pods, t=5
    )
    assert nested["status"]["summary"]["reward"] == 0.5
    _, none = step(body, pods, t=5)
    assert "reward" not in none["status"]["summary"]  # a null in the merge patch removes the key


def test_non_finite_reward_is_dropped_not_written() -> None:
    """A step whose every sample failed its reward reports NaN; JSON cannot carry it."""
    body, pods = running_job()
    for bad in ("nan", float("inf")):
        _, top = step(
            with_status(body, {"progress": {"step": 2, "metrics": {"reward_mean": bad}}}), pods, t=5
        )
        assert "reward" not in top["status"]["summary"]
