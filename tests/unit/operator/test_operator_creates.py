"""`executor.create_all`: a pass's pods created in their order, several at once up to a bound, and
a refusal reported as the sequential loop did (the first in order; nothing started after it)."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from rlhf_operator import kube
from rlhf_operator.executor import create_all


def objs(n: int) -> list[dict[str, Any]]:
    return [{"kind": "Pod", "metadata": {"name": f"p{i}"}} for i in range(n)]


class Recorder:
    """A create that records the order of calls and the most calls in flight at once."""

    def __init__(self, refuse: set[str] = frozenset(), exists: set[str] = frozenset(), barrier: int = 0):  # type: ignore[assignment]
        self.calls: list[str] = []
        self.refuse, self.exists = refuse, exists
        self.lock = threading.Lock()
        self.in_flight = self.peak = 0
        # Every call waits until `barrier` calls are in flight: a pool that ran fewer at once would
        # break it (BrokenBarrierError) instead of passing.
        self.barrier = threading.Barrier(barrier, timeout=30) if barrier else None

    def __call__(self, obj: dict[str, Any]) -> bool:
        name = obj["metadata"]["name"]
        with self.lock:
            self.calls.append(name)
            self.in_flight += 1
            self.peak = max(self.peak, self.in_flight)
        try:
            if self.barrier is not None:
                self.barrier.wait()
            if name in self.refuse:
                raise kube.Rejected(f"POST {name}: HTTP 403", 403, "exceeded quota")
            return name not in self.exists
        finally:
            with self.lock:
                self.in_flight -= 1


def test_without_a_pool_one_at_a_time_in_order_stopping_at_a_refusal() -> None:
    rec = Recorder(refuse={"p2"}, exists={"p0"})
    out = create_all(rec, objs(5))
    assert rec.calls == ["p0", "p1", "p2"] and rec.peak == 1
    assert out.created == 1  # p0 already existed
    assert out.rejected is not None and out.rejected[0]["metadata"]["name"] == "p2"


def test_a_pool_creates_up_to_its_size_at_once() -> None:
    rec = Recorder(barrier=4)
    with ThreadPoolExecutor(4) as pool:
        out = create_all(rec, objs(8), pool)
    assert out.created == 8 and out.rejected is None
    assert rec.peak == 4  # all four workers busy at once (the barrier), never more
    assert sorted(rec.calls) == [f"p{i}" for i in range(8)]


def test_a_pool_of_one_keeps_the_order_and_starts_nothing_after_a_refusal() -> None:
    created: list[str] = []
    rec = Recorder(refuse={"p1"})
    with ThreadPoolExecutor(1) as pool:
        out = create_all(rec, objs(4), pool, on_created=lambda: created.append("x"))
    assert rec.calls == ["p0", "p1"]
    assert out.created == 1 and created == ["x"]
    assert out.rejected is not None and out.rejected[0]["metadata"]["name"] == "p1"


def test_the_first_refusal_in_order_is_reported_whichever_finished_first() -> None:
    rec = Recorder(refuse={"p1", "p2"}, barrier=3)
    with ThreadPoolExecutor(3) as pool:
        out = create_all(rec, objs(3), pool)
    assert out.rejected is not None and out.rejected[0]["metadata"]["name"] == "p1"
    assert out.created == 1


def test_another_error_is_raised_once_the_started_creates_finished() -> None:
    def create(obj: dict[str, Any]) -> bool:
        if obj["metadata"]["name"] == "p0":
            raise kube.Retry("connection reset")
        return True

    with ThreadPoolExecutor(2) as pool, pytest.raises(kube.Retry, match="connection reset"):
        create_all(create, objs(3), pool)
