"""Who belongs to the rollout fleet: the source that decides its size, and the plan that turns a
size into joins and drains.

The fleet is a row of *slots* `0, 1, 2, ...`. A target of `replicas = n` means: slots `0..n-1`
hold a serving replica, every replica in a slot `>= n` leaves. On a cluster slot `i` is rollout
pod `i` (its replica-index label); locally it is a position in the row. Replica *names*
(`rollout-<serial>`) are never reused, so a replacement in slot 1 is a new member of the sync
group and the prompt queue, not the ghost of the old one.

One interface, two implementations, chosen once at start (`elastic.membership_source`):

    PolicyMembership                          ClusterMembership (fleet.cluster_membership)
    `rlhf run`                                `rlhf controller` in the job's controller pod
    the autoscaling policy decides,           the operator decides (its autoscaler, `kubectl
      every periodSeconds, from the             scale`, HPA, KEDA); the pod follows
      run's own metrics or Prometheus           status.rollout.{generation, desired}
    placement: anywhere on the local Ray      placement: slot i asks Ray for rlhf.dev/rollout-<i>
    new replicas: wait until loaded           new replicas: adopted when loaded (pods start slowly)
    synced: starts the policy's cooldown      synced: patches status.rollout.syncedGeneration
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from rlhf_api.autoscale import Autoscaler, MetricSource
    from rlhf_api.job import JobSpec

log = logging.getLogger(__name__)

#: Flat step-metric key of each built-in autoscaling signal (the run's own metrics).
SIGNAL_KEYS = {
    "rollout_wait_fraction": "rollout/wait_fraction",
    "queue_depth": "rollout/queue_depth",
    "tokens_per_second": "perf/tokens_per_second",
}


@dataclass(frozen=True)
class Target:
    """The fleet the owner of its size asks for."""

    replicas: int
    """Slots `0..replicas-1` serve; replicas in higher slots leave."""
    generation: int = 0
    """The owner's membership generation (`status.rollout.generation`); 0 when it keeps none."""


class MembershipSource(Protocol):
    """Where the fleet's size comes from. The fleet calls `target` at every step boundary, then
    changes itself to match, and calls `synced` after every weight sync that left it matching."""

    join_wait: float | None
    """Seconds a boundary waits for newly started replicas to load; those not loaded yet are
    adopted at a later boundary. None: wait until they are (and fail the run if one cannot start)."""

    def initial(self) -> Target:
        """The fleet to start with (before the first step)."""
        ...

    def target(self, step: int, metrics: dict[str, float]) -> Target:
        """The fleet wanted after `step`; may add its own entries to the step's `metrics`."""
        ...

    def placement(self, index: int) -> dict[str, float]:
        """Ray resources that pin the replica of slot `index` to where it must run."""
        ...

    def synced(self, target: Target, changed: bool) -> None:
        """The fleet matches `target` and every member holds the current weights. `changed`:
        the membership changed since the last call."""
        ...

    def attach_metrics(self, registry: Any) -> None:
        """Prometheus series of this source on the controller's registry."""
        ...

    def step_metrics(self) -> dict[str, float]:
        """Entries for the step's log line."""
        ...


# --------------------------------------------------------------------------------------------
# The plan: from slots held to slots wanted (pure)
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Change:
    """What a boundary does to reach a target."""

    leaving: list[str] = field(default_factory=list)
    """Members in a slot `>= replicas`: drained, left out of the next generation, then stopped."""
    cancel: list[str] = field(default_factory=list)
    """Replicas still loading for a slot `>= replicas`: stopped before they ever join."""
    launch: list[int] = field(default_factory=list)
    """Slots `< replicas` with neither a member nor a loading replica: start one there."""

    def __bool__(self) -> bool:
        return bool(self.leaving or self.cancel or self.launch)


def plan_change(members: Mapping[str, int], loading: Mapping[str, int], replicas: int) -> Change:
    """The change from `members` and `loading` (name -> slot) to `replicas` serving slots."""
    held = {i for i in [*members.values(), *loading.values()] if i < replicas}
    return Change(
        leaving=[name for name, i in members.items() if i >= replicas],
        cancel=[name for name, i in loading.items() if i >= replicas],
        launch=[i for i in range(replicas) if i not in held],
    )


def matches(members: Mapping[str, int], loading: Mapping[str, int], target: Target) -> bool:
    """True when exactly slots `0..target.replicas-1` hold a member and nothing is loading."""
    return not loading and sorted(members.values()) == list(range(target.replicas))


# --------------------------------------------------------------------------------------------
# The local source: the autoscaling policy shared with the operator
# --------------------------------------------------------------------------------------------


class PolicyMembership:
    """`rlhf run`: the fleet's size is the autoscaling policy's (`autoscale.Autoscaler`), evaluated
    once per `periodSeconds` on `clock` at the step boundary. Without `spec.autoscaling.enabled`
    the size stays `spec.roles.rollout.replicas` (a lost replica is still replaced)."""

    join_wait: float | None = None

    def __init__(
        self,
        replicas: int,
        autoscaler: Autoscaler | None = None,
        *,
        period: float = 15.0,
        metric: str = "rollout_wait_fraction",
        clock: Callable[[], float] = time.monotonic,
        signal: Callable[[int, dict[str, float]], float | None] | None = None,
        metric_source: MetricSource | None = None,
    ):
        # Zero replicas cannot generate: the local fleet keeps at least one.
        self.desired = max(1, replicas)
        self.autoscaler = autoscaler
        if autoscaler is not None:
            autoscaler.min_replicas = max(1, autoscaler.min_replicas)
        self.period = period
        self.metric = metric
        self.clock = clock
        self.signal = signal
        self.metric_source = metric_source
        self.last_eval: float | None = None
        self.counters: Any = None

    @classmethod
    def from_spec(
        cls,
        spec: JobSpec,
        job_name: str,
        *,
        clock: Callable[[], float] = time.monotonic,
        signal: Callable[[int, dict[str, float]], float | None] | None = None,
    ) -> PolicyMembership:
        a = spec.autoscaling
        autoscaler = metric_source = None
        if a.enabled:
            from rlhf_api.autoscale import Autoscaler

            autoscaler = Autoscaler.from_spec(a, spec.roles.rollout)
            metric_source = prometheus_source(job_name, a)
        return cls(
            spec.roles.rollout.replicas,
            autoscaler,
            period=a.period_seconds,
            metric=a.metric,
            clock=clock,
            signal=signal,
            metric_source=metric_source,
        )

    def initial(self) -> Target:
        return Target(self.desired)

    def target(self, step: int, metrics: dict[str, float]) -> Target:
        if self.autoscaler is None:
            return Target(self.desired)
        now = self.clock()
        if self.last_eval is not None and now - self.last_eval < self.period:
            return Target(self.desired)
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
            level, "step %d autoscale %s: %d -> %d (%s; %s)",
            step, d.direction, d.current, d.desired, d.cause, d.reason,
        )  # fmt: skip
        self.desired = d.desired
        return Target(self.desired)

    def read_signal(self, step: int, metrics: dict[str, float]) -> float | None:
        from rlhf_api.autoscale import MetricError

        if self.signal is not None:
            return self.signal(step, metrics)
        if self.metric_source is not None:
            try:
                return self.metric_source.read()
            except MetricError as err:  # hold the fleet, say why
                log.warning("autoscaling signal unavailable: %s", err)
                return None
        return step_signal(self.metric, metrics)

    def placement(self, index: int) -> dict[str, float]:
        return {}

    def synced(self, target: Target, changed: bool) -> None:
        if changed and self.autoscaler is not None:
            self.autoscaler.resharded(self.clock())  # the cooldown starts when the reshard is done

    def attach_metrics(self, registry: Any) -> None:
        from prometheus_client import Counter

        if self.autoscaler is not None:
            self.counters = Counter(
                "rlhf_autoscale_decisions",
                "Autoscaling policy evaluations, by direction and cause.",
                ["direction", "cause"],
                registry=registry,
            )

    def step_metrics(self) -> dict[str, float]:
        return {}


def step_signal(metric: str, metrics: dict[str, float]) -> float | None:
    """The built-in signal from the step's own metrics (what `/metrics` would show for it).
    Rates come from `metrics.step_rates` over the phases timed so far (the sync follows)."""
    from rlhf_trainer.metrics import step_rates

    value = {**step_rates(metrics), **metrics}.get(SIGNAL_KEYS[metric])
    return None if value is None or not math.isfinite(value) else float(value)


def prometheus_source(job: str, autoscaling: Any) -> MetricSource | None:
    """`PrometheusSource` when `autoscaling.prometheus` is set, else None (the run's own metrics)."""
    prom = autoscaling.prometheus
    if prom is None:
        return None
    from rlhf_api import contract
    from rlhf_api.autoscale import PrometheusSource

    namespace = contract.ENV_NAMESPACE.get() or "default"
    return PrometheusSource.for_job(
        prom.url, autoscaling.metric, job, namespace, getattr(prom, "query", None)
    )
