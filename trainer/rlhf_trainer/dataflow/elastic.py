"""The elastic rollout fleet of a disaggregated job: prompts leased through a `PromptQueue`,
weights pushed through the membership-generation `SyncGroup`, and the resharding protocol of
`shared/DESIGN.md` driven by the autoscaling policy shared with the operator.

    fleet = RolloutFleet.start(ctx, options)       # store on actor rank 0, replicas join gen 1
    # each step:
    batch = fleet.generate(prompts, n, step)       # rollout: replicas lease prompts, ack results
    reshard_if_needed(ctx, metrics)                # step boundary: policy -> add / drain / rebuild
    fleet.sync(version, step)                      # weight sync: bucketed broadcast, acks, drops

`reshard_if_needed` evaluates `autoscale.Autoscaler` once per `periodSeconds` (stabilization and
cooldown on the same clock, injectable through `ElasticOptions.clock`), from the run's own step
metrics (default) or from Prometheus when `autoscaling.prometheus` is set. A change of the
desired size, or a member lost since the last boundary, starts a new generation: new
`RolloutWorker`s are started and connected, leaving ones are drained (whatever they still hold
is requeued), and every member rebuilds the group. The sync that follows gives every member,
new ones included, the current weights before it serves, and sets `synced_generation`.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

log = logging.getLogger(__name__)

#: Name of the sync source (actor rank 0) in every generation's member list.
SOURCE = "actor"
#: Flat step-metric key of each built-in autoscaling signal (the run's own metrics).
SIGNAL_KEYS = {
    "rollout_wait_fraction": "rollout/wait_fraction",
    "queue_depth": "rollout/queue_depth",
    "tokens_per_second": "perf/tokens_per_second",
}


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


@dataclass
class ElasticOptions:
    """Hooks of the elastic fleet for embedding callers and tests (`controller.run(elastic=...)`).
    The defaults are what `rlhf run` uses."""

    clock: Callable[[], float] = time.monotonic
    """Seconds on the policy's clock (period, stabilization window, cooldown)."""
    signal: Callable[[int, dict[str, float]], float | None] | None = None
    """`signal(step, step_metrics)` replaces the metric source (e.g. a scripted load curve)."""
    sync_timeout: float = float(os.environ.get("RLHF_SYNC_TIMEOUT_S", "60"))
    """Seconds a dead member can hold a sync up (gloo timeout; acks wait twice this)."""
    verify_weights: bool = False
    """Hash the weights on the actor and on every replica after each sync (`SyncRecord` digests)."""
    generation_delay: Callable[[int], float] | None = None
    """`delay(step)` seconds per prompt added to every replica's generation (induced load)."""
    on_sync_start: Callable[[SyncStart], None] | None = None
    on_sync: Callable[[SyncRecord], None] | None = None


class RolloutFleet:
    """The controller's view of the rollout replicas: names, the prompt queue, the sync group's
    generation, and the autoscaler. Members are named `rollout-<n>`, never reused."""

    def __init__(self, ctx: Any, options: ElasticOptions):
        from rlhf_trainer.sync import PromptQueue

        self.ctx = ctx
        self.options = options
        self.group = ctx.rollout  # WorkerGroup of RolloutWorker
        self.queue: PromptQueue[Any] = PromptQueue()
        self.replicas: dict[str, Any] = {}
        self.store: tuple[str, int] | None = None
        self.generation = 0
        self.synced_generation = 0
        self.next_id = 0
        spec = ctx.spec
        self.desired = max(1, spec.roles.rollout.replicas)
        self.leaving: list[Any] = []
        self._joining: dict[str, Any] = {}
        self._pids: dict[str, int] = {}
        self.resharded = False
        self.queue_depth = 0
        self.autoscaler: Any = None
        self.source: Any = None
        self.last_eval: float | None = None
        self.counters: Any = None
        if spec.autoscaling.enabled:
            from rlhf_trainer.autoscale import Autoscaler

            # Zero replicas cannot generate: the local fleet keeps at least one.
            self.autoscaler = Autoscaler.from_spec(spec.autoscaling, spec.roles.rollout)
            self.autoscaler.min_replicas = max(1, self.autoscaler.min_replicas)
            self.source = metric_source(ctx.job_name, spec.autoscaling)

    # -- start ----------------------------------------------------------------------------------
    @classmethod
    def start(cls, ctx: Any, options: ElasticOptions) -> RolloutFleet:
        """Host the store on actor rank 0 and make the group's first generation of the running replicas."""
        from rlhf_trainer.workers.group import get

        fleet = cls(ctx, options)
        fleet.store = get([ctx.actor.workers[0].start_sync.remote(options.sync_timeout)])[0]
        joining = {fleet._new_name(): w for w in fleet.group.workers}
        fleet._join(joining)
        fleet.replicas = joining
        fleet._rebuild(list(joining), [])
        return fleet

    def _new_name(self) -> str:
        self.next_id += 1
        return f"rollout-{self.next_id - 1}"

    def _join(self, workers: dict[str, Any]) -> None:
        """Connect new replicas to the store; note their process ids (for logs and the kill tests:
        a replica busy in a sync cannot answer a call)."""
        from rlhf_trainer.workers.group import get

        get([w.join_sync.remote(self.store, name, self.options.sync_timeout) for name, w in workers.items()])
        self._pids.update(zip(workers, get([w.pid.remote() for w in workers.values()])))

    def _rebuild(self, members: list[str], leaving: list[Any]) -> None:
        """Every member (old, new and leaving) builds the next generation at once."""
        import ray

        from rlhf_trainer.workers.group import get

        self.generation += 1
        names = [SOURCE, *members]
        source = self.ctx.actor.workers[0].sync_rebuild.remote(names, self.generation)
        calls = {m: self.replicas_or_new(m).sync_rebuild.remote(names, self.generation) for m in members}
        calls.update(
            {f"leaving-{i}": w.sync_rebuild.remote(names, self.generation) for i, w in enumerate(leaving)}
        )
        get([source])
        for name, ref in calls.items():
            try:
                ray.get(ref)
            except ray.exceptions.RayError as err:
                # A member that died meanwhile sends no ack: the next push drops it.
                log.warning("generation %d: %s failed to rebuild: %s", self.generation, name, err)

    def replicas_or_new(self, name: str) -> Any:
        return self.replicas.get(name) or self._joining[name]

    # -- rollout --------------------------------------------------------------------------------
    def generate(self, prompts: list[Any], n: int, step: int) -> tuple[list[dict[str, Any]], list[list[int]]]:
        """Spread `prompts` over the replicas through the queue: each replica leases a share,
        generates, and acks; a replica that fails has its leases requeued for the others (and is
        replaced at the next step boundary). Returns each call's output and, per output, the
        positions in `prompts` of its prompts."""
        import ray

        self.queue.enqueue(range(len(prompts)))  # items: positions in `prompts`
        self.queue_depth = self.queue.queued()  # what the step's rollout started with
        share = math.ceil(len(prompts) / max(1, len(self.replicas)))
        delay = self.options.generation_delay(step) if self.options.generation_delay else 0.0
        running: dict[Any, tuple[str, list[int], list[int]]] = {}
        outputs: list[dict[str, Any]] = []
        positions: list[list[int]] = []

        def lease(name: str) -> None:
            got = self.queue.lease(name, share)
            if got:
                ref = self.replicas[name].generate.remote([prompts[p].ids for _, p in got], n, step, delay)
                running[ref] = (name, [pid for pid, _ in got], [p for _, p in got])

        for name in list(self.replicas):
            lease(name)
        while running:
            (ref,), _ = ray.wait(list(running), num_returns=1)
            name, pids, pos = running.pop(ref)
            try:
                out = ray.get(ref)
            except ray.exceptions.RayActorError as err:
                back = self.queue.requeue_replica(name)
                log.warning(
                    "rollout replica %s died while generating (%s); %d prompts requeued", name, err, back
                )
                self._forget(name)
                if not self.replicas:
                    raise RuntimeError("every rollout replica died; nothing left to generate with") from err
                for other in list(self.replicas):
                    if self.queue.queued() and self.queue.in_flight(other) == 0:
                        lease(other)
                continue
            acked = self.queue.ack(name, pids)
            if not any(acked):
                continue
            if not all(acked):  # refused (this replica lost those leases): the requeued copies count
                out = keep_prompts(out, [i for i, ok in enumerate(acked) if ok])
            outputs.append(out)
            positions.append(pos)
            if self.queue.queued():
                lease(name)
        self.queue.check()
        done = sorted(ps[i] for out, ps in zip(outputs, positions) for i in sorted(set(out["prompt_index"])))
        if done != list(range(len(prompts))):
            raise RuntimeError(
                f"step {step}: prompts generated {done} are not each of 0..{len(prompts) - 1} once"
            )
        return outputs, positions

    def _forget(self, name: str) -> None:
        worker = self.replicas.pop(name, None)
        if worker is not None:
            self.group.remove(worker)

    # -- the step boundary ----------------------------------------------------------------------
    def evaluate(self, step: int, metrics: dict[str, float]) -> None:
        """One period of the autoscaling policy: sets `desired` (logged and counted)."""
        if self.autoscaler is None:
            return
        now = self.options.clock()
        period = self.ctx.spec.autoscaling.period_seconds
        if self.last_eval is not None and now - self.last_eval < period:
            return
        self.last_eval = now
        signal = self.read_signal(step, metrics)
        # The committed size, like the HPA's current scale: a replica lost since the last
        # boundary is owed a replacement, not taken as a decision to shrink.
        d = self.autoscaler.step(self.desired, signal, now)
        metrics["autoscale/signal"] = float("nan") if signal is None else float(signal)
        metrics["autoscale/desired_replicas"] = float(d.desired)
        metrics["autoscale/recommendation"] = float(d.recommendation)
        if self.counters is not None:
            self.counters.labels(d.direction, d.cause).inc()
        level = logging.INFO if d.direction != "none" else logging.DEBUG
        log.log(
            level,
            "step %d autoscale %s: %d -> %d (%s; %s)",
            step,
            d.direction,
            d.current,
            d.desired,
            d.cause,
            d.reason,
        )
        self.desired = d.desired

    def read_signal(self, step: int, metrics: dict[str, float]) -> float | None:
        from rlhf_trainer.autoscale import MetricError

        if self.options.signal is not None:
            return self.options.signal(step, metrics)
        if self.source is not None:
            try:
                value: float | None = self.source.read()
                return value
            except MetricError as err:  # hold the fleet, say why
                log.warning("autoscaling signal unavailable: %s", err)
                return None
        return step_signal(self.ctx.spec.autoscaling.metric, {**self.step_metrics(), **metrics})

    def reshard(self, step: int) -> dict[str, float]:
        """Follow the resharding protocol when the fleet differs from `desired` (a decision, or a
        member lost): start and connect new replicas, drain leaving ones, rebuild the group."""
        if len(self.replicas) == self.desired:
            return {}
        t0 = time.perf_counter()
        current = list(self.replicas)
        keep = current[: self.desired]
        leaving = {name: self.replicas[name] for name in current[self.desired :]}
        requeued = sum(self.queue.requeue_replica(name) for name in leaving)  # drained: nothing dropped
        self._joining = self._start_replicas(self.desired - len(keep))
        members = keep + list(self._joining)
        self._rebuild(members, list(leaving.values()))
        self.replicas = {name: self.replicas_or_new(name) for name in members}
        self.leaving = list(leaving.values())  # stopped once the new generation is synced
        self._joining = {}
        self.resharded = True
        log.info(
            "step %d reshard to generation %d: %d -> %d replicas (+%s -%s, %d prompts requeued)",
            step, self.generation, len(current), len(members),
            [m for m in members if m not in current], list(leaving), requeued,
        )  # fmt: skip
        return {"reshard/seconds": time.perf_counter() - t0, "reshard/requeued": float(requeued)}

    def _start_replicas(self, count: int) -> dict[str, Any]:
        if count <= 0:
            return {}
        names = [self._new_name() for _ in range(count)]
        workers = self.group.add_replicas([int(n.rsplit("-", 1)[1]) for n in names])
        joining = dict(zip(names, workers))
        self._join(joining)
        return joining

    # -- weight sync ----------------------------------------------------------------------------
    def sync(self, version: int, step: int) -> dict[str, float]:
        """Push the actor's weights to every member through the sync group; members that die or
        stall are dropped (their prompts requeued) and replaced at the next boundary."""
        import ray

        from rlhf_trainer.workers.group import get

        t0 = time.perf_counter()
        verify = self.options.verify_weights
        members = list(self.replicas)
        receives = {name: w.sync_receive.remote(verify) for name, w in self.replicas.items()}
        pushes = [w.sync_push.remote(version, verify) for w in self.ctx.actor.workers]
        if self.options.on_sync_start is not None:
            self.options.on_sync_start(SyncStart(step, self.generation, members, self.pids()))
        result = get(pushes)[0]
        replies: dict[str, dict[str, Any]] = {}
        for name, ref in receives.items():
            try:
                replies[name] = ray.get(ref)
            except ray.exceptions.RayError as err:
                replies[name] = {"dropped": True, "error": str(err)}
        dropped = sorted(set(result["dropped"]) | {n for n, r in replies.items() if r.get("dropped")})
        for name in dropped:
            back = self.queue.requeue_replica(name)
            log.warning(
                "step %d: rollout replica %s dropped from the weight sync; %d prompts requeued",
                step,
                name,
                back,
            )
            self._forget(name)
        for w in self.leaving:
            self.group.remove(w)
        self.leaving = []
        self.synced_generation = self.generation
        if self.resharded and self.autoscaler is not None:
            self.autoscaler.resharded(self.options.clock())
        self.resharded = False
        record = SyncRecord(
            step=step,
            version=version,
            generation=self.generation,
            epoch=int(result["epoch"]),
            members=[m for m in members if m not in dropped],
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
        if self.options.on_sync is not None:
            self.options.on_sync(record)
        return {
            "sync/seconds": record.wall_seconds,
            "sync/stream_seconds": record.seconds,
            "sync/bytes": float(record.bytes),
            "sync/attempts": float(record.attempts),
            "sync/dropped": float(len(dropped)),
        }

    def pids(self) -> dict[str, int]:
        return {name: self._pids[name] for name in self.replicas}

    # -- metrics --------------------------------------------------------------------------------
    def attach_metrics(self, registry: Any) -> None:
        """Series only the elastic fleet has, on the controller's registry."""
        from prometheus_client import Counter, Gauge

        self.counters = Counter(
            "rlhf_autoscale_decisions",
            "Autoscaling policy evaluations, by direction and cause.",
            ["direction", "cause"],
            registry=registry,
        )
        Gauge("rlhf_rollout_max_replicas", "Upper bound of the rollout fleet.", registry=registry).set(
            self.ctx.spec.roles.rollout.max_replicas
        )

    def step_metrics(self) -> dict[str, float]:
        c = self.queue.counters
        return {
            "rollout/replicas": float(len(self.replicas)),
            "rollout/desired_replicas": float(self.desired),
            "rollout/generation": float(self.generation),
            "rollout/synced_generation": float(self.synced_generation),
            "rollout/queue_depth": float(self.queue_depth),
            "queue/enqueued": float(c.enqueued),
            "queue/leased": float(c.leased),
            "queue/acked": float(c.acked),
            "queue/requeued": float(c.requeued),
            "queue/stale_acks": float(c.stale_acks),
        }

    def shutdown(self) -> None:
        for w in self.leaving:
            self.group.remove(w)
        self.leaving = []


def step_signal(metric: str, metrics: dict[str, float]) -> float | None:
    """The built-in signal from the step's own metrics (what `/metrics` would show for it).
    Rates come from `metrics.step_rates` over the phases timed so far (the sync follows)."""
    from rlhf_trainer.metrics import step_rates

    value = {**step_rates(metrics), **metrics}.get(SIGNAL_KEYS[metric])
    return None if value is None or not math.isfinite(value) else float(value)


def metric_source(job: str, autoscaling: Any) -> Any:
    """PrometheusSource when `autoscaling.prometheus` is set, else None (the run's own metrics)."""
    prom = autoscaling.prometheus
    if prom is None:
        return None
    from rlhf_trainer.autoscale import PrometheusSource

    namespace = os.environ.get("POD_NAMESPACE", "default")
    return PrometheusSource.for_job(
        prom.url, autoscaling.metric, job, namespace, getattr(prom, "query", None)
    )


def reshard_if_needed(ctx: Any, metrics: dict[str, float]) -> None:
    """The elastic-rollout phase at the step boundary: the autoscaling policy's decision, then
    the resharding protocol when the fleet must change. Colocated jobs have no fleet."""
    fleet = ctx.fleet
    if fleet is None:
        return
    fleet.evaluate(ctx.step, metrics)
    metrics.update(fleet.reshard(ctx.step))


def keep_prompts(out: dict[str, Any], keep: list[int]) -> dict[str, Any]:
    """The rows of one `generate` output whose prompt (index in that call) is in `keep`."""
    from rlhf_trainer.rollout import RolloutBatch

    version = out.pop("policy_version")
    batch = RolloutBatch.from_dict(out)
    rows = [r for r, i in enumerate(batch.prompt_index) if i in set(keep)]
    kept: dict[str, Any] = batch.select(rows).to_dict()
    kept["policy_version"] = version[torch.tensor(rows, dtype=torch.long)]
    return kept


def rollout_tensors(outputs: list[dict[str, Any]], positions: list[list[int]]) -> Any:
    """One `RolloutBatch` of the fleet's outputs in prompt order, `prompt_index` the position of
    each row's prompt in the step's list; and the rows' policy versions."""
    from rlhf_trainer.rollout import RolloutBatch

    versions = [out.pop("policy_version") for out in outputs]
    parts = []
    for out, pos in zip(outputs, positions):
        part = RolloutBatch.from_dict(out)
        part.prompt_index = [pos[i] for i in part.prompt_index]
        parts.append(part)
    batch = RolloutBatch.concat(parts)
    version = torch.cat(versions)
    order = sorted(range(len(batch)), key=lambda r: batch.prompt_index[r])  # stable: samples stay in order
    return batch.select(order), version[torch.tensor(order, dtype=torch.long)]
