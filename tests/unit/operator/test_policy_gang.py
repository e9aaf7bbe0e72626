"""Gang scheduling on its own (`gang.py`): how many pods of the gang are bound and running, the
scheduler's message for the first one that is not, and the scheduling timeout."""

from __future__ import annotations

from typing import Any

import pytest
from operator_helpers import bare_pod as pod

from rlhf_operator import gang

UNSCHEDULABLE = [
    {
        "type": "PodScheduled",
        "status": "False",
        "reason": "Unschedulable",
        "message": "0/3 nodes are available",
    }
]

# (case, pods, expected) -> (scheduled, running, all scheduled, all running, reason)
STATES: list[tuple[str, list[dict[str, Any]], int, tuple[int, int, bool, bool, str]]] = [
    ("nothing created", [], 2, (0, 0, False, False, "pods not created yet")),
    (
        "one waits without a message",
        [pod("a", phase="Running", node="n1"), pod("b", phase="Pending")],
        2,
        (1, 1, False, False, "waiting for the scheduler: b"),
    ),
    (
        "the scheduler's message",
        [
            pod("a", phase="Running", node="n1"),
            pod("b", phase="Pending", node="n2"),
            pod("c", phase="Pending", conditions=UNSCHEDULABLE),
        ],
        3,
        (2, 1, False, False, "c: Unschedulable: 0/3 nodes are available"),
    ),
    (
        "bound, not all running",
        [pod("a", phase="Running", node="n1"), pod("b", phase="Pending", node="n2")],
        2,
        (2, 1, True, False, ""),
    ),
    (
        "a terminating pod does not run",
        [pod("a", phase="Running", node="n1"), pod("b", phase="Running", node="n2", deleting=True)],
        2,
        (2, 1, True, False, ""),
    ),
    ("all running", [pod("a", phase="Running", node="n1")], 1, (1, 1, True, True, "")),
]


@pytest.mark.parametrize("pods,expected,want", [c[1:] for c in STATES], ids=[c[0] for c in STATES])
def test_gang_state(
    pods: list[dict[str, Any]], expected: int, want: tuple[int, int, bool, bool, str]
) -> None:
    s = gang.gang_state(pods, expected)
    assert (s.scheduled, s.running, s.all_scheduled, s.all_running, s.reason) == want


@pytest.mark.parametrize("waited,timeout,out", [(0, 10, False), (9.9, 10, False), (10, 10, True)])
def test_gang_timeout(waited: float, timeout: int, out: bool) -> None:
    assert gang.timed_out(waited, timeout) is out
