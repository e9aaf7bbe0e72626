"""The rollout fleet's resharding protocol on its own (`rollout.py`): which rollout pods to
create, drain and delete, and when the membership generation moves."""

from __future__ import annotations

from typing import Any

import pytest
from operator_helpers import bare_pod

from rlhf_operator import rollout


def rp(i: int, phase: str = "Running", **kw: Any) -> dict[str, Any]:
    return bare_pod(f"j-rollout-{i}", "rollout", i, phase=phase, **kw)


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
