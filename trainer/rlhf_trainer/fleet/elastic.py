"""`RolloutFleet`: the elastic rollout fleet of a disaggregated job, as the controller runs it.

It composes three parts, each its own module:

* membership (`membership`): a `MembershipSource` says how many slots should serve; the pure
  `plan_change` says which replicas leave, which slots get a new one;
* prompt leasing (`leasing`): the step's prompts spread over the members through a `PromptQueue`,
  requeued from a replica that leaves or dies, never dropped;
* weight push (`rlhf_trainer.sync.push`): the membership-generation `SyncGroup` rebuilt on every
  change and the bucketed broadcast from the actor to every member.

    fleet = RolloutFleet.start(actor_workers, launcher, source, options)  # members join gen 1
    # each step:
    outputs, positions = fleet.generate(prompts, n, step)   # rollout
    fleet.boundary(step, metrics)    # step boundary: target -> drain / start / adopt -> rebuild
    fleet.sync(version, step)        # weight sync; then `source.synced` when the fleet matches

The resharding protocol of `shared/DESIGN.md`, as one boundary and the sync after it run it:

1. `source.target()`: locally the autoscaling policy's decision, on a cluster the operator's
   `status.rollout` (a new generation also makes the fleet ping its members: a pod that was
   replaced took its replica with it);
2. replicas in slots `>= replicas` are drained (their leases requeued) and replicas still loading
   for such slots are cancelled; every empty slot below gets a new `RolloutWorker` (placed by
   `source.placement(slot)`); new replicas that have loaded (waiting `source.join_wait`) connect
   to the group's store;
3. every member, new and leaving ones included, rebuilds the next generation of the sync group;
4. the sync gives every member the current weights; then leaving replicas are stopped and, if the
   fleet now matches the target, `source.synced(target)` (on a cluster: `syncedGeneration`, after
   which the operator deletes the leaving pods).

The fleet never imports the workers: it drives Ray handles, and a `ReplicaLauncher` (the rollout
`WorkerGroup`) starts and stops them.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from rlhf_api import contract
from rlhf_trainer.sync.push import SyncRecord, SyncStart, WeightPush

from .leasing import PromptLeasing
from .membership import MembershipSource, PolicyMembership, Target, matches, plan_change

if TYPE_CHECKING:
    from rlhf_api.job import JobSpec

log = logging.getLogger(__name__)

#: Seconds a member may take to answer a ping when the owner's generation moved; one that does
#: not is taken as gone (its pod was replaced) and its slot refilled.
PROBE_SECONDS = 10.0


def _sync_timeout() -> float:
    return contract.ENV_SYNC_TIMEOUT_S.get_float()


@dataclass
class ElasticOptions:
    """Hooks of the elastic fleet for embedding callers and tests (`controller.run(elastic=...)`).
    The defaults are what `rlhf run` uses."""

    membership: MembershipSource | None = None
    """Who decides the fleet's size. None: the autoscaling policy on this process
    (`PolicyMembership`, `rlhf run`); the controller pod passes a `ClusterMembership`."""
    clock: Callable[[], float] = time.monotonic
    """Seconds on the local policy's clock (period, stabilization window, cooldown)."""
    signal: Callable[[int, dict[str, float]], float | None] | None = None
    """`signal(step, step_metrics)` replaces the local policy's metric source (a scripted load)."""
    sync_timeout: float = field(default_factory=_sync_timeout)
    """Seconds a dead member can hold a sync up (gloo timeout; acks wait twice this)."""
    sync_backend: str = field(default_factory=lambda: contract.ENV_SYNC_BACKEND.get_str())
    """Weight-sync backend, gloo or nccl (`RLHF_SYNC_BACKEND`; checked by `placement.sync_backend`)."""
    verify_weights: bool = field(default_factory=lambda: contract.ENV_VERIFY_WEIGHT_SYNC.get() == "1")
    """Hash the weights on the actor and on every replica after each sync (`SyncRecord` digests;
    a mismatch fails the step, a match is logged). Default: `RLHF_VERIFY_WEIGHT_SYNC=1`."""
    generation_delay: Callable[[int], float] | None = None
    """`delay(step)` seconds per prompt added to every replica's generation (induced load)."""
    refill_timeout: float = 600.0
    """Seconds a rollout with no replica left waits for a replacement to load before the step fails."""
    on_sync_start: Callable[[SyncStart], None] | None = None
    on_sync: Callable[[SyncRecord], None] | None = None


def membership_source(spec: JobSpec, job_name: str, options: ElasticOptions) -> MembershipSource:
    """`options.membership`, else the local autoscaling policy of `spec`."""
    if options.membership is not None:
        return options.membership
    return PolicyMembership.from_spec(spec, job_name, clock=options.clock, signal=options.signal)


class ReplicaLauncher(Protocol):
    """Starts and stops rollout replicas (`workers.group.WorkerGroup` of `RolloutWorker`)."""

    def launch(self, rank: int) -> tuple[Any, Any]:
        """Start a replica for slot `rank` without waiting: (its handle, the ref of its setup)."""
        ...

    def adopt(self, worker: Any) -> None:
        """A launched replica finished its setup and serves from now on."""
        ...

    def remove(self, worker: Any) -> None:
        """Stop a replica (drained, lost, or cancelled while loading)."""
        ...


@dataclass
class Replica:
    """A member of the fleet, or a replica still loading its model."""

    name: str
    """`rollout-<serial>`: unique for the run (the sync group's and the queue's name for it)."""
    index: int
    """Its slot: rollout pod `index` on a cluster."""
    handle: Any
    pid: int = 0
    ready: Any = None
    """While loading: the ref of its setup."""


class RolloutFleet:
    """The controller's view of the rollout replicas. See the module docstring."""

    def __init__(
        self,
        push: WeightPush,
        launcher: ReplicaLauncher,
        source: MembershipSource,
        options: ElasticOptions,
        *,
        max_replicas: int = 1,
    ):
        self.push = push
        self.launcher = launcher
        self.source = source
        self.options = options
        self.max_replicas = max_replicas
        self.leasing = PromptLeasing()
        self.members: dict[str, Replica] = {}
        self.loading: dict[str, Replica] = {}
        self.leaving: dict[str, Replica] = {}
        self.target = Target(0)
        self.next_id = 0
        self.changed = False
        """The membership changed since `source.synced` was last told."""
        self.stale_group = False
        """A member was forgotten since the group's last rebuild (it still counts it)."""
        self.version = 0
        """The policy version the members hold (the last one pushed)."""
        self.lock = threading.RLock()
        """One caller at a time: asynchronous rollouts generate on a background thread
        (`dataflow.rollout_ahead`) while the controller's thread reaches the boundary and the sync."""
        self._warned_empty = False

    # -- start ----------------------------------------------------------------------------------
    @classmethod
    def start(
        cls,
        actor_workers: Sequence[Any],
        launcher: ReplicaLauncher,
        replicas: Sequence[Any],
        source: MembershipSource,
        options: ElasticOptions,
        *,
        max_replicas: int = 1,
    ) -> RolloutFleet:
        """Host the store on actor rank 0 and make the group's first generation of `replicas`
        (already set up; replica `i` in slot `i`)."""
        push = WeightPush(
            actor_workers,
            timeout=options.sync_timeout,
            verify=options.verify_weights,
            backend=options.sync_backend,
        )
        push.open()
        fleet = cls(push, launcher, source, options, max_replicas=max_replicas)
        fleet.target = Target(len(replicas))  # the source's generation is read at the first boundary
        joining = {fleet._new_name(): Replica("", i, w) for i, w in enumerate(replicas)}
        fleet._join(joining)
        push.rebuild({name: r.handle for name, r in fleet.members.items()})
        return fleet

    def _new_name(self) -> str:
        self.next_id += 1
        return f"rollout-{self.next_id - 1}"

    def _join(self, joining: dict[str, Replica]) -> list[str]:
        """Connect loaded replicas to the store and make them members; returns their names."""
        pids = self.push.connect({name: r.handle for name, r in joining.items()})
        for name, r in joining.items():
            r.name, r.ready = name, None
            if name not in pids:  # died between its setup and the store
                self.launcher.remove(r.handle)
                continue
            r.pid = pids[name]
            self.members[name] = r
        return [name for name in joining if name in pids]

    # -- rollout --------------------------------------------------------------------------------
    def generate(
        self,
        prompts: list[Any],
        n: int,
        step: int,
        greedy: bool = False,
        temperature: float | None = None,
    ) -> tuple[list[dict[str, Any]], list[list[int]]]:
        """Spread `prompts` over the members through the queue (`PromptLeasing.generate`); a
        member that dies has its leases requeued for the others and its slot refilled at the
        next boundary, or at once when it was the last one (`_refill`)."""
        delay = self.options.generation_delay(step) if self.options.generation_delay else 0.0
        with self.lock:
            return self._generate(prompts, n, step, delay, greedy, temperature)

    def _generate(
        self, prompts: list[Any], n: int, step: int, delay: float, greedy: bool, temperature: float | None
    ) -> tuple[list[dict[str, Any]], list[list[int]]]:
        handles = {name: r.handle for name, r in self.members.items()}
        return self.leasing.generate(
            handles,
            prompts,
            n,
            step,
            delay=delay,
            on_lost=self._lost,
            refill=lambda: self._refill(step),
            greedy=greedy,
            temperature=temperature,
        )

    def _lost(self, name: str, err: BaseException) -> None:
        self._forget(name)

    def _refill(self, step: int) -> dict[str, Any]:
        """No member left in the middle of a rollout: start replicas in the empty slots and wait
        (up to `refill_timeout`) for one to load; the new members join a rebuilt group and get the
        current weights before they serve. Returns them (name -> handle)."""
        import ray

        deadline = time.monotonic() + self.options.refill_timeout
        while not self.members:
            serving = max(1, self.target.replicas)
            change = plan_change(self._slots(self.members), self._slots(self.loading), serving)
            for index in change.launch:
                handle, ready = self.launcher.launch(index)
                self.loading[self._new_name()] = Replica("", index, handle, ready=ready)
            left = deadline - time.monotonic()
            if left <= 0:
                raise RuntimeError(
                    f"step {step}: every rollout replica died and none loaded within "
                    f"{self.options.refill_timeout:.0f}s; nothing left to generate with"
                )
            log.warning("step %d: no rollout replica left; waiting for %d to load", step, len(self.loading))
            ray.wait([r.ready for r in self.loading.values()], num_returns=1, timeout=left)
            self._adopt_loaded(step)
        self._rebuild()
        record = self.push.push({name: r.handle for name, r in self.members.items()}, self.version, step)
        for name in record.dropped:
            self._forget(name)
        return {name: r.handle for name, r in self.members.items()}

    def _rebuild(self) -> None:
        self.push.rebuild(
            {name: r.handle for name, r in self.members.items()},
            {name: r.handle for name, r in self.leaving.items()},
        )
        self.changed = True
        self.stale_group = False

    def _forget(self, name: str) -> None:
        """A member is gone (dead, dropped, unreachable): requeue its leases, stop it."""
        replica = self.members.pop(name, None)
        if replica is None:
            return
        self.leasing.drain(name)
        self.launcher.remove(replica.handle)
        self.changed = self.stale_group = True

    # -- the step boundary ----------------------------------------------------------------------
    def boundary(self, step: int, metrics: dict[str, float]) -> dict[str, float]:
        """Ask the source for its target and change the fleet to match (see the module docstring).
        Returns `reshard/*` metrics when the membership changed."""
        with self.lock:
            return self._boundary(step, metrics)

    def _boundary(self, step: int, metrics: dict[str, float]) -> dict[str, float]:
        metrics.update(self.step_metrics())  # the local policy's signal may be the fleet's own
        target = self.source.target(step, metrics)
        if target.generation != self.target.generation and self.target.generation:
            self._probe(step)
        self.target = target
        serving = target.replicas
        if serving < 1:
            # No replica cannot generate: keep slot 0 (and never report this target synced).
            serving = 1
            if not self._warned_empty:
                log.warning(
                    "step %d: rollout replicas %d asked for; the fleet keeps one (a step cannot "
                    "generate without one) and does not report generation %d synced",
                    step, target.replicas, target.generation,
                )  # fmt: skip
                self._warned_empty = True
        change = plan_change(self._slots(self.members), self._slots(self.loading), serving)
        if not (change or self.loading or self.stale_group):
            return {}
        t0 = time.perf_counter()
        before = list(self.members)
        for name in change.cancel:
            self.launcher.remove(self.loading.pop(name).handle)
        requeued = 0
        for name in change.leaving:
            requeued += self.leasing.drain(name)  # drained: nothing dropped
            self.leaving[name] = self.members.pop(name)
        for index in change.launch:
            handle, ready = self.launcher.launch(index)
            self.loading[self._new_name()] = Replica("", index, handle, ready=ready)
        joined = self._adopt_loaded(step)
        # A forgotten member would hold the next push up until it is dropped: rebuild without it
        # (a group of the source alone waits until someone joins).
        if not (joined or change.leaving or self.stale_group) or not self.members:
            return {}
        self._rebuild()
        log.info(
            "step %d reshard to generation %d: %d -> %d replicas (+%s -%s, %d prompts requeued%s)",
            step, self.push.generation, len(before), len(self.members), joined, change.leaving, requeued,
            f"; {len(self.loading)} still loading" if self.loading else "",
        )  # fmt: skip
        return {"reshard/seconds": time.perf_counter() - t0, "reshard/requeued": float(requeued)}

    def _adopt_loaded(self, step: int) -> list[str]:
        """Make the loading replicas that finished their setup members (waiting up to
        `source.join_wait`); returns their names."""
        import ray

        if not self.loading:
            return []
        wait = self.source.join_wait
        refs = {r.ready: name for name, r in self.loading.items()}
        ready, _ = ray.wait(list(refs), num_returns=len(refs), timeout=wait)
        loaded: dict[str, Replica] = {}
        for ref in ready:
            name = refs[ref]
            replica = self.loading.pop(name)
            try:
                ray.get(ref)
            except ray.exceptions.RayError as err:
                self.launcher.remove(replica.handle)
                if wait is None:  # locally nothing else would start it: say why and stop
                    raise RuntimeError(
                        f"rollout replica for slot {replica.index} failed to start: {err}"
                    ) from err
                log.warning(
                    "step %d: rollout replica for slot %d failed to start (%s); retried at the next boundary",
                    step, replica.index, err,
                )  # fmt: skip
                continue
            loaded[name] = replica
        for replica in loaded.values():
            self.launcher.adopt(replica.handle)
        return self._join(loaded)

    def _probe(self, step: int) -> None:
        """Ping every member; forget those that are gone or do not answer within `PROBE_SECONDS`."""
        import ray

        refs = {r.handle.pid.remote(): name for name, r in self.members.items()}
        ready, late = ray.wait(list(refs), num_returns=len(refs), timeout=PROBE_SECONDS)
        gone = [refs[ref] for ref in late]
        for ref in ready:
            try:
                ray.get(ref)
            except ray.exceptions.RayError:
                gone.append(refs[ref])
        for name in gone:
            log.warning("step %d: rollout replica %s is gone; its slot is refilled", step, name)
            self._forget(name)

    @staticmethod
    def _slots(replicas: dict[str, Replica]) -> dict[str, int]:
        return {name: r.index for name, r in replicas.items()}

    # -- weight sync ----------------------------------------------------------------------------
    def sync(self, version: int, step: int) -> dict[str, float]:
        """Push the actor's weights to every member; members that die or stall are dropped (their
        prompts requeued) and replaced at the next boundary. Then leaving replicas are stopped,
        and the source hears that the fleet matches its target, when it does."""
        with self.lock:
            return self._sync(version, step)

    def _sync(self, version: int, step: int) -> dict[str, float]:
        self.version = version
        if not self.members:  # every replica gone: the next rollout waits for a replacement
            self._stop_leaving()
            return {}
        record = self.push.push(
            {name: r.handle for name, r in self.members.items()},
            version,
            step,
            pids=self.pids(),
            on_start=self.options.on_sync_start,
        )
        for name in record.dropped:
            back = self.leasing.drain(name)
            log.warning(
                "step %d: rollout replica %s dropped from the weight sync; %d prompts requeued",
                step,
                name,
                back,
            )
            self._forget(name)
        if record.actor_digest is not None:  # verified (push raised if any member differed)
            log.info(
                "step %d: weights verified after the sync (sync group %d): actor %s, replicas %s",
                step,
                record.generation,
                record.actor_digest,
                ", ".join(
                    f"{n}@{self.members[n].index}={d}" for n, d in sorted(record.replica_digests.items())
                ),
            )
        self._stop_leaving()
        if matches(self._slots(self.members), self._slots(self.loading), self.target):
            self.source.synced(self.target, self.changed)
            self.changed = False
        if self.options.on_sync is not None:
            self.options.on_sync(record)
        return record.metrics()

    def _stop_leaving(self) -> None:
        for replica in self.leaving.values():
            self.launcher.remove(replica.handle)
        self.leaving = {}

    def pids(self) -> dict[str, int]:
        return {name: r.pid for name, r in self.members.items()}

    # -- metrics --------------------------------------------------------------------------------
    def attach_metrics(self, registry: Any) -> None:
        """Series only the elastic fleet has, on the controller's registry."""
        from prometheus_client import Gauge

        Gauge("rlhf_rollout_max_replicas", "Upper bound of the rollout fleet.", registry=registry).set(
            self.max_replicas
        )
        self.source.attach_metrics(registry)

    def step_metrics(self) -> dict[str, float]:
        return {
            "rollout/replicas": float(len(self.members)),
            "rollout/desired_replicas": float(self.target.replicas),
            "rollout/loading": float(len(self.loading)),
            "rollout/generation": float(self.push.generation),
            "rollout/synced_generation": float(self.push.synced_generation),
            **self.leasing.metrics(),
            **self.source.step_metrics(),
        }

    def shutdown(self) -> None:
        for replica in [*self.leaving.values(), *self.loading.values()]:
            self.launcher.remove(replica.handle)
        self.leaving, self.loading = {}, {}
