"""`PromptQueue`: prompts leased to rollout replicas, with exactly-once accounting across drains
and deaths.

A prompt is *queued*, then *leased* to one replica, then *acked* when its samples come back.
When a replica leaves (drained at a step boundary, or dropped because it died), everything leased
to it goes back to the front of the queue (`requeue_replica`), so no prompt is lost; an ack that
arrives later from the replica that lost the lease is refused (`False`, counted in `stale_acks`),
so no prompt is counted twice. At all times

    enqueued == acked + queued + in_flight

which `check()` asserts. Thread-safe: the controller's rollout threads share one queue.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Hashable, Iterable
from dataclasses import dataclass
from typing import Generic, TypeVar

T = TypeVar("T")


@dataclass
class QueueCounters:
    enqueued: int = 0
    leased: int = 0  # leases granted (a requeued prompt is leased again: counted again)
    acked: int = 0
    requeued: int = 0
    stale_acks: int = 0  # acks refused: the prompt was not (or no longer) leased to that replica


class PromptQueue(Generic[T]):
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._queue: deque[tuple[int, T]] = deque()
        self._leases: dict[int, tuple[Hashable, T]] = {}  # prompt id -> (replica, item)
        self._done: set[int] = set()
        self._next_id = 0
        self.counters = QueueCounters()

    def enqueue(self, items: Iterable[T]) -> list[int]:
        """Add prompts; returns their ids (unique for the queue's lifetime)."""
        with self._lock:
            ids = []
            for item in items:
                self._queue.append((self._next_id, item))
                ids.append(self._next_id)
                self._next_id += 1
            self.counters.enqueued += len(ids)
            return ids

    def lease(self, replica: Hashable, n: int) -> list[tuple[int, T]]:
        """Up to `n` prompts for `replica` (requeued ones first)."""
        with self._lock:
            out: list[tuple[int, T]] = []
            while self._queue and len(out) < n:
                pid, item = self._queue.popleft()
                self._leases[pid] = (replica, item)
                out.append((pid, item))
            self.counters.leased += len(out)
            return out

    def ack(self, replica: Hashable, ids: Iterable[int]) -> list[bool]:
        """Mark prompts done by `replica`. Per id: True if counted now, False if refused (not
        leased to this replica: already requeued, already acked, or unknown)."""
        with self._lock:
            res = []
            for pid in ids:
                lease = self._leases.get(pid)
                if lease is None or lease[0] != replica:
                    self.counters.stale_acks += 1
                    res.append(False)
                    continue
                del self._leases[pid]
                self._done.add(pid)
                self.counters.acked += 1
                res.append(True)
            return res

    def requeue_replica(self, replica: Hashable) -> int:
        """Return every prompt leased to `replica` to the front of the queue (in lease order)."""
        with self._lock:
            back = [(pid, item) for pid, (r, item) in self._leases.items() if r == replica]
            for pid, _ in back:
                del self._leases[pid]
            self._queue.extendleft(reversed(back))
            self.counters.requeued += len(back)
            return len(back)

    def queued(self) -> int:
        with self._lock:
            return len(self._queue)

    def in_flight(self, replica: Hashable | None = None) -> int:
        with self._lock:
            if replica is None:
                return len(self._leases)
            return sum(1 for r, _ in self._leases.values() if r == replica)

    def done_ids(self) -> set[int]:
        with self._lock:
            return set(self._done)

    def check(self) -> None:
        """Assert the exactly-once invariant (raises AssertionError naming the counts)."""
        with self._lock:
            c, q, f = self.counters, len(self._queue), len(self._leases)
            assert c.enqueued == c.acked + q + f, (
                f"enqueued {c.enqueued} != acked {c.acked} + queued {q} + in flight {f}"
            )
            assert len(self._done) == c.acked, f"{len(self._done)} distinct done != acked {c.acked}"
