"""`SyncGroup`: the weight-sync process group of a changing rollout fleet.

Membership changes without restarting any process: every membership *generation* (the
operator's `status.rollout.generation`) gets a brand-new process group constructed directly on a
per-generation prefix of one long-lived `TCPStore` (hosted by the sync source, actor rank 0):

    ProcessGroupGloo(PrefixStore(f"{prefix}/g{generation}e{epoch}/pg/", store), rank, size, timeout)

No default process group is involved, so the actor's own training group (FSDP2) is untouched, a
process can be in several sync groups at once (one per TP channel, see below), and an old group is
simply dropped. Constructing one costs tens of milliseconds on one host (measured: 2-70 ms for 2-3
members). `backend="nccl"` builds a `ProcessGroupNCCL` the same way, with the buckets on the
rank's GPU (`device`); the control channel (start marks, acks, outcomes) stays on the TCPStore, so
the protocol below is the same. A dead member must not take the trainer down with NCCL's watchdog
(by default it tears the process down when an op times out): the CPU polls each collective and
gives up after `timeout` (`buckets.complete`), the group is then aborted (`ProcessGroupNCCL.abort`)
and dropped, the NCCL op timeout is set longer than that (`buckets.nccl_watchdog_timeout`), a
receiver marks itself ready in the store before each NCCL stream (the source streams only when
all did: a communicator's creation would wait for a dead rank with no timeout), and
the group is built with `TORCH_NCCL_ASYNC_ERROR_HANDLING=2` (abort the communicator only, never
the process; torch reads it when a group is constructed). Written against the documented torch.distributed APIs; the NCCL path runs
only on GPUs (tests/gpu), which no session has had so far. (torch >= 2.8 also has
`Backend.shrink`/`reconfigure` on some backends; a fresh group works on every version and backend.)

One sync (`push` on the source, `receive` on every other member) is confirmed, not hoped for:

1. the source marks the start in the store and streams the weights (`bucketed_broadcast`); each
   receiver waits for that mark in the store (so a source busy elsewhere is not mistaken for a
   stalled transfer by the gloo timeout), then receives;
2. each receiver writes `ack/<member>` = ok | error into the store (whether its stream succeeded
   or failed, e.g. because a peer died and gloo raised or timed out);
3. the source waits up to `2 x timeout` for the acks (a receiver may be blocked in a gloo
   operation for one timeout before it can ack). All ok and its own stream ok: it writes
   `outcome = ok` and the sync is done. Otherwise a member with no ack is declared dead and
   dropped; the survivors are told (`outcome = {members, epoch}`) to build the next *epoch* of the
   group among themselves, and the stream is repeated — so a replica that dies mid-sync delays the
   others by about one `timeout` (at most two) and the sync completes for everyone alive.

`PushResult.dropped` names the dropped members, for the controller to requeue their prompts
(`PromptQueue.requeue_replica`) and to ask the operator for a replacement.

Tensor-parallel engines: build one `SyncGroup` per TP rank ("channel", `prefix=f"rlhf-sync/tp{r}"`)
holding the source and rank `r` of every replica, and push with `ReshardPlan.transform(r)` /
`metas`: each engine rank receives only its own slices.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Literal

import torch
import torch.distributed as dist

from rlhf_api import contract

from .buckets import (
    DEFAULT_BUCKET_BYTES,
    DEFAULT_MAX_INFLIGHT,
    Sink,
    SyncStats,
    bucketed_broadcast,
    nccl_watchdog_timeout,
    receive_broadcast,
)
from .reshard import ReshardPlan

log = logging.getLogger(__name__)

#: PyTorch's documented switch (TORCH_NCCL_ASYNC_ERROR_HANDLING) for what ProcessGroupNCCL's
#: watchdog does on an error or timeout: 3 (torch's default) and 1 (the pods', for gang restarts
#: of the training groups) tear the process down; 2 only aborts the communicator.
NCCL_ABORT_COMMUNICATOR_ONLY = "2"


class SyncError(RuntimeError):
    """A weight sync could not complete."""


class DroppedError(SyncError):
    """This member was dropped from the sync group (it was declared dead by the source)."""


@dataclass
class PushResult:
    stats: SyncStats
    #: Receivers that confirmed the weights, in group order.
    members: list[str]
    #: Receivers dropped during this push (dead or too slow to acknowledge).
    dropped: list[str] = field(default_factory=list)
    attempts: int = 1
    generation: int = 0
    epoch: int = 0


def connect_store(host: str, port: int, *, is_source: bool, timeout: float = 60.0) -> dist.TCPStore:
    """The long-lived store of the sync group: hosted by the source, joined by every receiver."""
    return dist.TCPStore(
        host, port, is_master=is_source, wait_for_workers=False, timeout=timedelta(seconds=timeout)
    )


class SyncGroup:
    """One member's handle on the weight-sync group. `members[0]` of every generation is the
    source. All methods are called at the same time on every member (the controller drives them).

    `timeout` bounds every collective and the wait for acknowledgements: it is how long a dead
    member can hold the others up. `hostname` pins the gloo device's address (default: resolve
    this host's name, as torch does).
    """

    def __init__(
        self,
        store: dist.Store,
        me: str,
        *,
        timeout: float = 60.0,
        prefix: str = "rlhf-sync",
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        hostname: str | None = None,
        max_attempts: int = 3,
        poll_seconds: float = 0.005,
        backend: Literal["gloo", "nccl"] = "gloo",
        device: torch.device | str | None = None,
        max_inflight: int = DEFAULT_MAX_INFLIGHT,
        gloo_threads: int | None = None,
    ):
        self.store = store
        self.me = me
        self.timeout = timeout
        self.prefix = prefix
        self.bucket_bytes = bucket_bytes
        self.hostname = hostname
        self.max_attempts = max_attempts
        self.poll_seconds = poll_seconds
        self.members: list[str] = []
        self.generation = -1
        self.epoch = 0
        self._seq = 0
        self._pg: Any = None
        self._connect_error: BaseException | None = None
        self.rebuild_seconds = 0.0
        if backend not in ("gloo", "nccl"):
            raise ValueError(f"backend must be gloo or nccl, got {backend!r}")
        self.backend = backend
        self.max_inflight = max_inflight
        self.gloo_threads = gloo_threads
        if device is None:
            device = f"cuda:{torch.cuda.current_device()}" if backend == "nccl" else "cpu"
        self.device = torch.device(device)

    # -- membership -----------------------------------------------------------------------------

    @property
    def is_source(self) -> bool:
        return bool(self.members) and self.members[0] == self.me

    @property
    def rank(self) -> int:
        return self.members.index(self.me)

    @property
    def active(self) -> bool:
        return self.me in self.members

    def rebuild(self, members: Sequence[str], generation: int) -> None:
        """Join generation `generation` with these members (source first). A member not listed
        leaves: its old group is dropped and it takes part in no further sync."""
        if len(set(members)) != len(members) or not members:
            raise ValueError(f"members must be a non-empty list of distinct names, got {list(members)}")
        if generation <= self.generation:
            raise ValueError(f"generation must increase: at {self.generation}, got {generation}")
        self.members, self.generation, self.epoch, self._seq = list(members), generation, 0, 0
        self._connect()

    def _base(self) -> str:
        return f"{self.prefix}/g{self.generation}e{self.epoch}"

    def _connect(self) -> None:
        self._retire()
        if not self.active:
            return
        t0 = time.perf_counter()
        store = dist.PrefixStore(self._base() + "/pg/", self.store)
        try:
            if self.backend == "nccl":
                nccl_opts = dist.ProcessGroupNCCL.Options()
                nccl_opts._timeout = timedelta(seconds=nccl_watchdog_timeout(self.timeout))
                # This group only: on an error its watchdog aborts the communicator, never the
                # process (the training group keeps the pod's tear-down for gang restarts).
                with contract.ENV_TORCH_NCCL_ASYNC_ERROR_HANDLING.overridden(NCCL_ABORT_COMMUNICATOR_ONLY):
                    self._pg = dist.ProcessGroupNCCL(store, self.rank, len(self.members), nccl_opts)
            else:
                opts = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
                opts._timeout = timedelta(seconds=self.timeout)
                device = (
                    dist.ProcessGroupGloo.create_device(hostname=self.hostname)
                    if self.hostname is not None
                    else dist.ProcessGroupGloo.create_default_device()
                )
                opts._devices = [device]
                # One gloo worker thread per message in flight, so they progress concurrently.
                opts._threads = self.gloo_threads or max(2, self.max_inflight)
                self._pg = dist.ProcessGroupGloo(store, self.rank, len(self.members), opts)
            self._connect_error = None
        except Exception as e:  # a member that never showed up: handled by the ack protocol
            log.warning("sync group %s: %s could not connect: %s", self._base(), self.me, e)
            self._pg, self._connect_error = None, e
        self.rebuild_seconds = time.perf_counter() - t0

    def _retire(self) -> None:
        pg, self._pg = self._pg, None
        if pg is not None:
            # Abort outstanding operations (a failed stream may have broadcasts posted).
            # Not every backend supports abort; dropping the group then suffices.
            with contextlib.suppress(Exception):
                pg.abort()

    def _abort_gpu_group(self) -> None:
        """NCCL: a failed stream leaves a kernel waiting for a dead peer on this GPU; abort the
        communicator now (the next epoch builds a new group). Gloo's ops already returned."""
        if self.backend == "nccl":
            self._retire()

    def close(self) -> None:
        self._retire()
        self.members = []

    # -- one sync -------------------------------------------------------------------------------

    def push(
        self,
        named_tensors: Iterable[tuple[str, torch.Tensor]],
        version: int,
        *,
        plan: ReshardPlan | None = None,
        tp_rank: int = 0,
    ) -> PushResult:
        """Send the weights (source only) and wait until every live receiver confirmed them.
        With `plan`, every receiver of this group gets rank `tp_rank`'s slices.

        FSDP2 sources: DTensors in `named_tensors` are gathered per parameter during the stream,
        and gathered again by each retry after a dropped member — the other FSDP ranks must then
        run `drain_full_tensors` once per attempt (`PushResult.attempts`), which they cannot know
        in advance. Either pass materialized tensors (holds the full model for the push; what
        `workers/actor.py` does) or accept that a retry needs that coordination."""
        if not self.is_source:
            raise SyncError(f"{self.me} is not the source of generation {self.generation} ({self.members})")
        items = list(named_tensors)
        transform = metas = None
        if plan is not None:
            transform = plan.transform(tp_rank)
            metas = plan.metas(tp_rank, {n: t.dtype for n, t in items})
        dropped: list[str] = []
        for attempt in range(1, self.max_attempts + 1):
            base = f"{self._base()}/s{self._seq}"
            stats, err = SyncStats(), self._connect_error
            streams = self._pg is not None and len(self.members) > 1
            missing = self._unready(base, self.members[1:]) if streams else []
            if missing:  # NCCL: never start a stream (or a communicator) with a member already gone
                err, streams = (
                    SyncError(f"{missing} not ready for the stream within {self.timeout:g}s"),
                    False,
                )
            if len(self.members) > 1:  # tell the receivers to go (or, without a group, to ack an error)
                self.store.set(base + "/start", "go" if streams else "skip")
            if streams:
                try:
                    stats = bucketed_broadcast(
                        items, self._pg, 0, self.bucket_bytes, version=version,
                        timeout=self.timeout, transform=transform, metas=metas, device=self.device, max_inflight=self.max_inflight,
                    )  # fmt: skip
                except Exception as e:
                    err = e
                    self._abort_gpu_group()
            elif len(self.members) == 1:
                err = None  # nobody to send to
            receivers = self.members[1:]
            acks = self._wait_acks(base, receivers)
            if err is None and all(acks.get(m) == "ok" for m in receivers):
                self.store.set(base + "/outcome", json.dumps({"ok": True}))
                self._seq += 1
                return PushResult(stats, receivers, dropped, attempt, self.generation, self.epoch)
            dead = [m for m in receivers if m not in acks]
            dropped += dead
            survivors = [self.me] + [m for m in receivers if m in acks]
            log.warning(
                "weight sync %s attempt %d failed (%s); dropping %s, retrying with %s",
                base, attempt, err or "receiver errors", dead, survivors,
            )  # fmt: skip
            self.store.set(
                base + "/outcome", json.dumps({"ok": False, "members": survivors, "epoch": self.epoch + 1})
            )
            self.members, self.epoch, self._seq = survivors, self.epoch + 1, 0
            self._connect()
        raise SyncError(f"weight sync failed {self.max_attempts} times; last members {self.members}")

    def receive(self, sink: Sink) -> SyncStats:
        """Receive the weights into `sink` (receivers only). Raises `DroppedError` when the source
        dropped this member (then `rebuild` with a later generation to rejoin)."""
        if not self.active or self.is_source:
            raise SyncError(f"{self.me} is not a receiver of generation {self.generation} ({self.members})")
        while True:
            base = f"{self._base()}/s{self._seq}"
            stats, err = SyncStats(), self._connect_error
            if self._pg is not None:
                try:
                    if self.backend == "nccl":
                        self.store.set(f"{base}/ready/{self.me}", "1")
                    # Wait in the store, not in a gloo op, for the source to start: its gloo
                    # timeout is for a stalled transfer, not for a source still busy elsewhere.
                    self._wait_key(base + "/start")
                    if self.store.get(base + "/start") != b"go":
                        raise SyncError(f"the source could not connect at {base}")
                    stats = receive_broadcast(
                        sink,
                        self._pg,
                        0,
                        timeout=self.timeout,
                        device=self.device,
                        max_inflight=self.max_inflight,
                    )
                except Exception as e:
                    err = e
                    self._abort_gpu_group()
            self.store.set(f"{base}/ack/{self.me}", "ok" if err is None else "error")
            outcome = self._wait_outcome(base)
            if outcome["ok"]:
                self._seq += 1
                if hasattr(sink, "version"):
                    sink.version = stats.version
                return stats
            if self.me not in outcome["members"]:
                self._retire()
                self.members = []
                raise DroppedError(f"{self.me} was dropped from the sync group at {base}")
            log.warning("weight sync %s failed (%s); rejoining epoch %d", base, err, outcome["epoch"])
            self.members, self.epoch, self._seq = list(outcome["members"]), int(outcome["epoch"]), 0
            self._connect()

    def _unready(self, base: str, receivers: list[str]) -> list[str]:
        """NCCL only: the receivers that did not mark themselves ready within `timeout`. A NCCL
        communicator is created at the first collective and that creation waits, on the CPU and
        with no timeout, for every rank; a member that died before the sync is caught here, in the
        store, instead. (One that dies mid-stream is caught by `buckets.complete`.)"""
        if self.backend != "nccl":
            return []
        deadline = time.monotonic() + self.timeout
        while True:
            missing = [m for m in receivers if not self.store.check([f"{base}/ready/{m}"])]
            if not missing or time.monotonic() > deadline:
                return missing
            time.sleep(self.poll_seconds)

    def _wait_acks(self, base: str, receivers: list[str]) -> dict[str, str]:
        # A receiver can sit in a gloo operation for up to one timeout after the source's own
        # operation failed (its peer died mid-tree), and only then acks: wait twice that.
        deadline = time.monotonic() + 2 * self.timeout
        acks: dict[str, str] = {}
        while True:
            for m in receivers:
                key = f"{base}/ack/{m}"
                if m not in acks and self.store.check([key]):
                    acks[m] = self.store.get(key).decode()
            if len(acks) == len(receivers) or time.monotonic() > deadline:
                return acks
            time.sleep(self.poll_seconds)

    def _wait_key(self, *keys: str) -> str:
        """Wait until one of `keys` is in the store; returns it. The source decides within its
        stream time plus one timeout for the acks; a receiver whose source is gone gives up after
        a generous multiple of that."""
        limit = 4 * self.timeout + 10
        deadline = time.monotonic() + limit
        while True:
            for k in keys:
                if self.store.check([k]):
                    return k
            if time.monotonic() > deadline:
                raise SyncError(f"no {' or '.join(keys)} from the source within {limit:.0f}s")
            time.sleep(self.poll_seconds)

    def _wait_outcome(self, base: str) -> dict[str, Any]:
        key = self._wait_key(base + "/outcome")
        result: dict[str, Any] = json.loads(self.store.get(key).decode())
        return result
