"""PromptQueue: exactly-once accounting under drains and deaths."""

from __future__ import annotations

import random
import threading
import time

from rlhf_trainer.fleet.queue import PromptQueue


def test_requeue_goes_first_and_late_acks_are_refused() -> None:
    q: PromptQueue[str] = PromptQueue()
    q.enqueue(["a", "b", "c", "d"])
    a = q.lease("r0", 2)
    b = q.lease("r1", 1)
    assert [i for _, i in a] == ["a", "b"] and [i for _, i in b] == ["c"]
    assert q.requeue_replica("r0") == 2  # r0 drained
    assert q.ack("r0", [a[0][0]]) == [False]  # a late answer from the drained replica
    again = q.lease("r1", 3)
    assert [i for _, i in again] == ["a", "b", "d"]  # requeued first, in order
    assert q.ack("r1", [pid for pid, _ in again + b]) == [True] * 4
    assert q.ack("r1", [b[0][0]]) == [False]  # double ack
    q.check()
    c = q.counters
    assert (c.enqueued, c.acked, c.requeued, c.stale_acks, c.leased) == (4, 4, 2, 2, 6)
    assert q.done_ids() == {0, 1, 2, 3} and q.queued() == 0 and q.in_flight() == 0


def test_exactly_once_under_random_fleet_changes() -> None:
    """Replicas (threads) lease and ack; a chaos thread drains/kills replicas at random. Every
    prompt is acked exactly once, whatever happens."""
    rng = random.Random(0)
    q: PromptQueue[int] = PromptQueue()
    n = 2000
    q.enqueue(range(n))
    done: list[int] = []
    lock = threading.Lock()
    stop = threading.Event()

    def replica(name: str, seed: int) -> None:
        r = random.Random(seed)
        while not stop.is_set():
            batch = q.lease(name, r.randint(1, 8))
            if not batch:
                if q.queued() == 0 and q.in_flight() == 0:
                    return
                time.sleep(0.001)
                continue
            ok = q.ack(name, [pid for pid, _ in batch])
            with lock:
                done.extend(item for (_, item), accepted in zip(batch, ok) if accepted)

    names = [f"r{i}" for i in range(4)]
    threads = [threading.Thread(target=replica, args=(nm, i)) for i, nm in enumerate(names)]
    for t in threads:
        t.start()
    for _ in range(200):
        q.requeue_replica(rng.choice(names))  # a drain or a death: its leases go back
    for t in threads:
        t.join(timeout=60)
    stop.set()
    q.check()
    assert sorted(done) == list(range(n))
    assert q.counters.acked == n and q.counters.leased == n + q.counters.requeued
