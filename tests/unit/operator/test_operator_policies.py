"""Each policy module on its own: failure, gang, rollout (resharding protocol), TTL, suspend."""

from __future__ import annotations

from typing import Any

import pytest
from operator_helpers import T0, at

from rlhf_operator import failure_policy, gang, rollout, suspend, ttl
from rlhf_trainer.spec import FailurePolicySpec


def pod(name: str, role: str = "actor", index: int = 0, **status: Any) -> dict[str, Any]:
    meta: dict[str, Any] = {
        "name": name,
        "labels": {"rlhf.dev/role": role, "rlhf.dev/replica-index": str(index)},
    }
    if status.pop("deleting", False):
        meta["deletionTimestamp"] = "2025-01-01T00:00:00Z"
    spec = {"nodeName": status.pop("node")} if "node" in status else {}
    return {"metadata": meta, "spec": spec, "status": status}


@pytest.mark.parametrize(
    "restarts,expected",
    [(0, 0), (1, 10), (2, 20), (3, 40), (4, 60), (10, 60)],
)
def test_backoff_doubles_and_is_capped(restarts: int, expected: float) -> None:
    policy = FailurePolicySpec(max_restarts=10, backoff_seconds=10, max_backoff_seconds=60)
    assert failure_policy.backoff_seconds(policy, restarts) == expected


@pytest.mark.parametrize("restarts,done", [(0, False), (2, False), (3, True), (4, True)])
def test_exhausted(restarts: int, done: bool) -> None:
    assert failure_policy.exhausted(FailurePolicySpec(max_restarts=3), restarts) is done


@pytest.mark.parametrize(
    "observed,reason",
    [
        (pod("a", phase="Running"), None),
        (pod("a", phase="Pending"), None),
        (pod("a", phase="Succeeded"), None),
        (pod("a", phase="Failed", reason="Evicted", message="low memory"), "Evicted"),
        (
            pod(
                "a",
                phase="Failed",
                containerStatuses=[{"state": {"terminated": {"reason": "OOMKilled", "exitCode": 137}}}],
            ),
            "OOMKilled (exit code 137)",
        ),
        (pod("a", phase="Failed"), "PodFailed"),
        (pod("a", phase="Running", deleting=True), "PodDeleted"),
        (
            pod(
                "a",
                phase="Running",
                deleting=True,
                conditions=[{"type": "DisruptionTarget", "status": "True", "reason": "DeletionByPodGC"}],
            ),
            "DeletionByPodGC",
        ),
    ],
)
def test_pod_failure_classification(observed: dict[str, Any], reason: str | None) -> None:
    f = failure_policy.pod_failure(observed)
    assert (f.reason if f else None) == reason
    if f:
        assert "pod a" in f.message


def test_gang_roles() -> None:
    assert [
        r
        for r in ("controller", "actor", "critic", "reference", "reward", "rollout")
        if failure_policy.is_gang_role(r)
    ] == [
        "controller",
        "actor",
        "critic",
        "reference",
        "reward",
    ]


def test_gang_state_counts_and_reports_the_scheduler_message() -> None:
    pods = [
        pod("a", phase="Running", node="n1"),
        pod("b", phase="Pending", node="n2"),
        pod(
            "c",
            phase="Pending",
            conditions=[
                {
                    "type": "PodScheduled",
                    "status": "False",
                    "reason": "Unschedulable",
                    "message": "0/3 nodes are available",
                }
            ],
        ),
    ]
    state = gang.gang_state(pods, expected=3)
    assert (state.scheduled, state.running, state.all_scheduled, state.all_running) == (2, 1, False, False)
    assert state.reason == "c: Unschedulable: 0/3 nodes are available"
    assert gang.gang_state(pods[:1], expected=1).all_running


@pytest.mark.parametrize("waited,timeout,out", [(0, 10, False), (9.9, 10, False), (10, 10, True)])
def test_gang_timeout(waited: float, timeout: int, out: bool) -> None:
    assert gang.timed_out(waited, timeout) is out


def rp(i: int, phase: str = "Running", **kw: Any) -> dict[str, Any]:
    return pod(f"j-rollout-{i}", "rollout", i, phase=phase, **kw)


# (case, pods, desired, previous, generation, synced, started) -> (generation, create, delete, draining, ready)
ROLLOUT_CASES = [
    ("first pass", [], 2, None, 0, 0, False, (1, [0, 1], [], [], 0)),
    ("steady", [rp(0), rp(1)], 2, 2, 3, 3, True, (3, [], [], [], 2)),
    ("scale up", [rp(0), rp(1)], 3, 2, 3, 3, True, (4, [2], [], [], 2)),
    ("scale down waits for sync", [rp(0), rp(1), rp(2)], 2, 3, 3, 3, True, (4, [], [], ["j-rollout-2"], 2)),
    ("scale down, synced", [rp(0), rp(1), rp(2)], 2, 2, 4, 4, True, (4, [], ["j-rollout-2"], [], 2)),
    (
        "scale down before start: no drain",
        [rp(0), rp(1), rp(2)],
        2,
        3,
        1,
        0,
        False,
        (2, [], ["j-rollout-2"], [], 2),
    ),
    (
        "failed member deleted, no bump yet",
        [rp(0), rp(1, "Failed")],
        2,
        2,
        3,
        3,
        True,
        (3, [], ["j-rollout-1"], [], 1),
    ),
    ("lost member recreated with a bump", [rp(0)], 2, 2, 3, 3, True, (4, [1], [], [], 1)),
    ("deleting member waits", [rp(0), rp(1, deleting=True)], 2, 2, 3, 3, True, (3, [], [], [], 1)),
]


@pytest.mark.parametrize(
    "case,pods,desired,previous,generation,synced,started,expected",
    ROLLOUT_CASES,
    ids=[c[0] for c in ROLLOUT_CASES],
)
def test_rollout_plan(
    case: str,
    pods: list[dict[str, Any]],
    desired: int,
    previous: int | None,
    generation: int,
    synced: int,
    started: bool,
    expected: tuple[int, list[int], list[str], list[str], int],
) -> None:
    plan = rollout.plan_rollout(pods, desired, previous, generation, synced, started)
    got = (
        plan.generation,
        plan.create,
        [p["metadata"]["name"] for p in plan.delete],
        plan.draining,
        plan.ready,
    )
    assert got == expected


@pytest.mark.parametrize(
    "completed,ttl_s,now,left",
    [
        (None, 10, at(100), None),
        (T0, None, at(100), None),
        (T0, 30, at(10), 20.0),
        (T0, 30, at(45), -15.0),
        (T0, 0, T0, 0.0),
    ],
)
def test_ttl_seconds_left(completed: Any, ttl_s: int | None, now: Any, left: float | None) -> None:
    assert ttl.seconds_left(completed, ttl_s, now) == left


def test_suspend() -> None:
    pods = [pod("a"), pod("b", deleting=True)]
    assert [p["metadata"]["name"] for p in suspend.pods_to_remove(pods)] == ["a"]
    assert suspend.resumed("Suspended", False)
    assert not suspend.resumed("Suspended", True)
    assert not suspend.resumed("Running", False)
