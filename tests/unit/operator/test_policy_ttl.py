"""`ttlSecondsAfterFinished` on its own (`ttl.py`): when a finished job is deleted."""

from __future__ import annotations

from typing import Any

import pytest
from operator_helpers import T0, at

from rlhf_operator import ttl


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


@pytest.mark.parametrize(
    "completed,ttl_s,expiry", [(None, 10, None), (T0, None, None), (T0, 30, at(30)), (T0, 0, T0)]
)
def test_ttl_expires_at(completed: Any, ttl_s: int | None, expiry: Any) -> None:
    assert ttl.expires_at(completed, ttl_s) == expiry
