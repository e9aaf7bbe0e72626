"""Suspend on its own (`suspend.py`): which pods a suspension removes, which pass ends it, and
which terminating pods a resumed job waits for instead of counting them as failures (the
reconcile-level cases are in test_operator_suspend.py)."""

from __future__ import annotations

import pytest
from operator_helpers import bare_pod as pod

from rlhf_operator import suspend


def test_pods_to_remove_skips_those_already_going() -> None:
    pods = [pod("a"), pod("b", deleting=True), pod("c", phase="Failed")]
    assert [p["metadata"]["name"] for p in suspend.pods_to_remove(pods)] == ["a", "c"]


@pytest.mark.parametrize(
    "previous,suspend_now,resumed",
    [
        ("Suspended", False, True),
        ("Suspended", True, False),
        ("Running", False, False),
        ("Pending", False, False),
    ],
)
def test_resumed(previous: str, suspend_now: bool, resumed: bool) -> None:
    assert suspend.resumed(previous, suspend_now) is resumed


@pytest.mark.parametrize(
    "deleting,phase,waits",
    [
        (True, "Pending", True),  # resumed while the suspension's pods terminate
        (False, "Pending", False),
        (True, "Scheduling", False),  # the gang started: a deleted pod is a failure
        (True, "Running", False),
    ],
)
def test_awaiting_removal(deleting: bool, phase: str, waits: bool) -> None:
    assert suspend.awaiting_removal(pod("a", deleting=deleting), phase) is waits
