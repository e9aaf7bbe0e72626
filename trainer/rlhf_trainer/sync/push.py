"""Weight push: the controller's side of the weight-sync group (`sync.group.SyncGroup`), driving
the actor ranks and the rollout replicas through their Ray handles.

    push = WeightPush(actor_workers, timeout=60)
    push.open()                                   # the group's store on actor rank 0
    pids = push.connect({"rollout-0": handle})    # new replicas join the store
    push.rebuild(members, leaving)                # every member builds generation g + 1 at once
    record = push.push(members, version, step)    # bucketed broadcast, acks, dropped members

Each call is made on every process at once (the group's collectives need them all); a member
that died meanwhile only shows up as a failed call or a drop.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger(__name__)

#: Name of the sync source (actor rank 0) in every generation's member list.
SOURCE = "actor"


@dataclass(frozen=True)
class SyncStart:
    """Passed to `ElasticOptions.on_sync_start` once every member has been asked to sync."""

    step: int
    generation: int
    members: list[str]
    pids: dict[str, int]


@dataclass
class SyncRecord:
    """One completed weight sync, as `ElasticOptions.on_sync` sees it."""

    step: int
    version: int
    generation: int
    epoch: int
    members: list[str]
    dropped: list[str]
    attempts: int
    seconds: float
    """Seconds of the last (successful) stream on the source."""
    wall_seconds: float
    """Seconds of the whole sync as the controller saw it (dropped members' waits included)."""
    bytes: int
    actor_digest: str | None = None
    replica_digests: dict[str, str] = field(default_factory=dict)

    def metrics(self) -> dict[str, float]:
        return {
            "sync/seconds": self.wall_seconds,
            "sync/stream_seconds": self.seconds,
            "sync/bytes": float(self.bytes),
            "sync/attempts": float(self.attempts),
            "sync/dropped": float(len(self.dropped)),
        }


def gather(refs: Sequence[Any]) -> list[Any]:
    """`ray.get` of several refs, raising as soon as any of them failed (instead of waiting for
    the others, which may be blocked in a collective with the failed one)."""
    import ray

    pending = list(refs)
    results: dict[Any, Any] = {}
    while pending:
        ready, pending = ray.wait(pending, num_returns=1)
        for ref in ready:
            results[ref] = ray.get(ref)
    return [results[r] for r in refs]


class WeightPush:
    """The sync group as the controller drives it: every actor rank (`actor_workers`, rank 0 the
    source) and the named rollout replicas. `generation` counts the group's rebuilds."""

    def __init__(
        self,
        actor_workers: Sequence[Any],
        *,
        timeout: float = 60.0,
        verify: bool = False,
        backend: str = "gloo",
    ):
        self.actor_workers = list(actor_workers)
        self.timeout = timeout
        #: gloo or nccl (`placement.sync_backend`): every member builds its groups with it.
        self.backend = backend
        self.verify = verify
        self.store: tuple[str, int] | None = None
        self.generation = 0
        self.synced_generation = 0

    def open(self) -> None:
        """Host the group's long-lived store on actor rank 0."""
        self.store = gather([self.actor_workers[0].start_sync.remote(self.timeout, self.backend)])[0]

    def connect(self, replicas: Mapping[str, Any]) -> dict[str, int]:
        """Connect new replicas to the store (no generation yet); returns their process ids (for
        the logs and the kill tests: a replica busy in a sync cannot answer a call)."""
        if not replicas:
            return {}
        gather(
            [w.join_sync.remote(self.store, name, self.timeout, self.backend) for name, w in replicas.items()]
        )
        return dict(zip(replicas, gather([w.pid.remote() for w in replicas.values()])))

    def rebuild(self, members: Mapping[str, Any], leaving: Mapping[str, Any] | None = None) -> int:
        """Every member (staying, new and leaving) builds the next generation at once: `members`
        in it, `leaving` out. Returns the new generation."""
        import ray

        self.generation += 1
        names = [SOURCE, *members]
        source = self.actor_workers[0].sync_rebuild.remote(names, self.generation)
        calls = {m: w.sync_rebuild.remote(names, self.generation) for m, w in members.items()}
        calls.update({m: w.sync_rebuild.remote(names, self.generation) for m, w in (leaving or {}).items()})
        gather([source])
        for name, ref in calls.items():
            try:
                ray.get(ref)
            except ray.exceptions.RayError as err:
                # A member that died meanwhile sends no ack: the next push drops it.
                log.warning("generation %d: %s failed to rebuild: %s", self.generation, name, err)
        return self.generation

    def push(
        self,
        members: Mapping[str, Any],
        version: int,
        step: int,
        *,
        pids: Mapping[str, int] | None = None,
        on_start: Callable[[SyncStart], None] | None = None,
    ) -> SyncRecord:
        """Push the actor's weights (policy `version`) to every member. Members that die or
        stall are dropped (`SyncRecord.dropped`); the others end with the actor's exact weights
        (checked by hash with `verify`)."""
        import ray

        t0 = time.perf_counter()
        verify = self.verify
        names = list(members)
        receives = {name: w.sync_receive.remote(verify) for name, w in members.items()}
        pushes = [w.sync_push.remote(version, verify) for w in self.actor_workers]
        if on_start is not None:
            on_start(SyncStart(step, self.generation, names, dict(pids or {})))
        result = gather(pushes)[0]
        replies: dict[str, dict[str, Any]] = {}
        for name, ref in receives.items():
            try:
                replies[name] = ray.get(ref)
            except ray.exceptions.RayError as err:
                replies[name] = {"dropped": True, "error": str(err)}
        dropped = sorted(set(result["dropped"]) | {n for n, r in replies.items() if r.get("dropped")})
        self.synced_generation = self.generation
        record = SyncRecord(
            step=step,
            version=version,
            generation=self.generation,
            epoch=int(result["epoch"]),
            members=[m for m in names if m not in dropped],
            dropped=dropped,
            attempts=int(result["attempts"]),
            seconds=float(result["seconds"]),
            wall_seconds=time.perf_counter() - t0,
            bytes=int(result["bytes"]),
            actor_digest=result.get("digest"),
            replica_digests={
                n: r["digest"] for n, r in replies.items() if "digest" in r and n not in dropped
            },
        )
        if verify:
            bad = {n: d for n, d in record.replica_digests.items() if d != record.actor_digest}
            if bad or len(record.replica_digests) != len(record.members):
                raise RuntimeError(
                    f"step {step}: weights differ after the sync: actor {record.actor_digest}, replicas {record.replica_digests}"
                )
        return record
