"""The rollout autoscaling policy, shared by the operator and `rlhf run`, and its metric sources.

The policy (`decide`) is a pure function: replicas, bounds, a signal value, the target, the
recent recommendations and the time of the last reshard go in; a `Decision` comes out. It does no
I/O and imports neither torch nor a Kubernetes client, so the operator (which writes the
RLTrainingJob's `/scale` subresource) and the local controller (which adds and drains Ray rollout
workers) run exactly the same rule. `Autoscaler` is a thin stateful convenience that keeps the
history between calls; the operator, being level-based, may instead persist `history` in the job's
status and call `decide` directly.

The rule is the Kubernetes HPA's (`kube-controller-manager`'s replica calculator), in order:

1. **Bounds first.** A fleet outside `[min, max]` is brought back inside, whatever the signal.
2. **Cooldown.** Within `cooldown` seconds of the last completed reshard the fleet is held:
   metrics measured during a reshard (the trainer waits for the sync) are not evidence of load.
3. **No data, no change.** A missing or non-finite signal holds the fleet.
4. **Proportional rule with tolerance.** `ratio = usage / target`; when `|ratio - 1| <= tolerance`
   the recommendation is the current size, else `ceil(current * ratio)`, clamped to `[min, max]`.
5. **Scale-down stabilization.** The fleet scales up at once but scales down only to the highest
   recommendation made within the last `window` seconds (including this one), so a short dip in
   load does not tear down replicas that will be needed again a minute later.

How `usage` is derived from the signal is a property of the metric (`METRICS`):

* `rollout_wait_fraction` (default) — fraction of step time the trainer waits for rollouts, a
  fleet-wide value: `usage = signal`. Higher means the fleet is too small.
* `queue_depth` — prompts queued for the fleet (a total); the target is prompts per replica:
  `usage = signal / current` (HPA's `AverageValue`), so `desired = ceil(signal / target)`.
* `tokens_per_second` — generated tokens/s of the whole fleet (a total); the target is the
  throughput one replica should sustain when busy, set somewhat below its capacity the way a CPU
  target of 70% is: `usage = signal / current`. Replicas that deliver more than the target per
  replica are saturated, so scale up; replicas that deliver much less are starved (the trainer is
  the bottleneck), so scale down.

A metric with `higher_is_worse=False` (none built in; for custom signals such as an idle fraction)
uses `ratio = target / usage`.
"""

from __future__ import annotations

import json
import math
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

Direction = Literal["up", "down", "none"]


@dataclass(frozen=True)
class MetricDef:
    """How a signal relates to the fleet size."""

    name: str
    #: Prometheus metric the controller exports for this signal.
    series: str
    #: The signal is a fleet total; the target is per replica (usage = signal / replicas).
    per_replica_target: bool
    #: A larger usage means more replicas are needed.
    higher_is_worse: bool = True
    #: Default PromQL; `{job}` and `{namespace}` are substituted with the job's name and namespace.
    promql: str = ""
    #: How ScrapeSource combines several samples of the series (several label sets).
    combine: Literal["sum", "max"] = "max"


_SEL = 'rlhf_job="{job}",namespace="{namespace}"'

METRICS: dict[str, MetricDef] = {
    m.name: m
    for m in (
        MetricDef(
            "rollout_wait_fraction",
            "rlhf_rollout_wait_fraction",
            per_replica_target=False,
            promql="max(avg_over_time(rlhf_rollout_wait_fraction{" + _SEL + "}[2m]))",
        ),
        MetricDef(
            "queue_depth",
            "rlhf_queue_depth",
            per_replica_target=True,
            promql="max(avg_over_time(rlhf_queue_depth{" + _SEL + "}[2m]))",
        ),
        MetricDef(
            "tokens_per_second",
            "rlhf_tokens_per_second",
            per_replica_target=True,
            promql="sum(avg_over_time(rlhf_tokens_per_second{" + _SEL + "}[2m]))",
            combine="sum",
        ),
    )
}


def metric_def(name: str) -> MetricDef:
    """The definition of a built-in signal; an unknown name lists the valid ones."""
    try:
        return METRICS[name]
    except KeyError:
        raise ValueError(
            f"unknown autoscaling metric {name!r}; valid: {', '.join(sorted(METRICS))}"
        ) from None


@dataclass(frozen=True)
class Recommendation:
    """One past output of the proportional rule (before stabilization), kept for the window."""

    time: float
    replicas: int

    def to_dict(self) -> dict[str, float | int]:
        return {"time": self.time, "replicas": self.replicas}

    @staticmethod
    def from_dict(d: dict[str, float | int]) -> Recommendation:
        return Recommendation(float(d["time"]), int(d["replicas"]))


@dataclass(frozen=True)
class Decision:
    """What the policy wants, and why.

    `recommendation` is what the caller appends to the history (with `now`), whatever `desired` is.
    """

    desired: int
    current: int
    direction: Direction
    #: A stable machine-readable cause: bounds (fleet was outside [min, max]), cooldown, no_data,
    #: tolerance, limit (wants to go past min/max), scale, stabilized.
    cause: str
    #: One human-readable line for logs and Kubernetes Events.
    reason: str
    recommendation: int
    ratio: float | None = None
    signal: float | None = None


def _direction(current: int, desired: int) -> Direction:
    return "up" if desired > current else "down" if desired < current else "none"


def _proportional(
    metric: MetricDef, current: int, signal: float, target: float, tolerance: float
) -> tuple[int, float | None, str]:
    """The HPA rule. Returns (recommendation before clamping, ratio, explanation)."""
    if current == 0:
        # Nothing to be proportional to (HPA disables itself at 0). Any demand starts one
        # replica; a total with a per-replica target starts as many as the total needs.
        if signal <= 0:
            return 0, None, f"{metric.name}={signal:g} with 0 replicas: no demand"
        if metric.per_replica_target:
            n = math.ceil(signal / target)
            return n, None, f"{metric.name}={signal:g} with 0 replicas: ceil({signal:g}/{target:g})={n}"
        return 1, None, f"{metric.name}={signal:g} with 0 replicas: start one"
    usage = signal / current if metric.per_replica_target else signal
    ratio = usage / target if metric.higher_is_worse else target / usage if usage > 0 else math.inf
    what = f"{metric.name} usage {usage:g} / target {target:g} = ratio {ratio:.3g}"
    if abs(ratio - 1.0) <= tolerance:
        return current, ratio, f"{what}, within tolerance {tolerance:g}"
    if math.isinf(ratio):
        return 10**9, ratio, f"{what}: unbounded"
    # A tiny epsilon keeps ceil(3 * 1.0000000001) from adding a replica through float noise.
    n = math.ceil(current * ratio - 1e-9)
    return n, ratio, f"{what}: ceil({current} x {ratio:.3g}) = {n}"


def decide(
    *,
    current: int,
    min_replicas: int,
    max_replicas: int,
    signal: float | None,
    target: float,
    tolerance: float,
    history: Sequence[Recommendation],
    now: float,
    last_reshard: float | None,
    window: float,
    cooldown: float,
    metric: str | MetricDef = "rollout_wait_fraction",
) -> Decision:
    """The policy. Times are seconds on one clock (e.g. `time.time()`); `history` may hold
    entries older than the window (they are ignored). See the module docstring for the rules."""
    if min_replicas < 0 or max_replicas < min_replicas:
        raise ValueError(
            f"replica bounds must satisfy 0 <= min <= max, got min={min_replicas} max={max_replicas}"
        )
    if not target > 0:
        raise ValueError(f"target must be > 0, got {target!r}")
    if tolerance < 0 or window < 0 or cooldown < 0:
        raise ValueError(
            f"tolerance, window and cooldown must be >= 0, got {tolerance!r}, {window!r}, {cooldown!r}"
        )
    m = metric_def(metric) if isinstance(metric, str) else metric

    def out(desired: int, cause: str, reason: str, rec: int, ratio: float | None = None) -> Decision:
        return Decision(desired, current, _direction(current, desired), cause, reason, rec, ratio, signal)

    # 1. Bounds.
    if current < min_replicas or current > max_replicas:
        bounded = min(max(current, min_replicas), max_replicas)
        return out(bounded, "bounds", f"{current} replicas outside [{min_replicas}, {max_replicas}]", bounded)
    # 2. Cooldown. The held size is recorded so a scale-down right after the cooldown still
    #    waits for the window's evidence.
    if last_reshard is not None and now - last_reshard < cooldown:
        left = cooldown - (now - last_reshard)
        return out(current, "cooldown", f"cooldown after reshard: {left:.0f}s left of {cooldown:g}s", current)
    # 3. No data.
    if signal is None or not math.isfinite(signal):
        return out(current, "no_data", f"no value for {m.name}; holding {current}", current)
    # 4. Proportional rule.
    raw, ratio, why = _proportional(m, current, float(signal), target, tolerance)
    rec = min(max(raw, min_replicas), max_replicas)
    if rec != raw:
        why += f", clamped to [{min_replicas}, {max_replicas}] -> {rec}"
    # 5. Stabilization of scale-down: the highest recommendation within the window, this one included.
    desired = rec
    cause = "scale" if rec != current else "limit" if raw != rec else "tolerance"
    if rec < current:
        recent = [h.replicas for h in history if now - h.time < window]
        highest = max([rec, *recent])
        desired = min(highest, current)
        if desired != rec:
            cause = "stabilized"
            why += f"; stabilized to {desired} (highest recommendation in the last {window:g}s)"
    return out(desired, cause, why, rec, ratio)


def prune(history: Iterable[Recommendation], now: float, window: float) -> list[Recommendation]:
    """The entries still inside the window (what is worth persisting)."""
    return [h for h in history if now - h.time < window]


@dataclass
class Autoscaler:
    """`decide` plus the history it needs, for a caller that lives across periods (`rlhf run`)."""

    min_replicas: int
    max_replicas: int
    target: float
    tolerance: float = 0.1
    window: float = 60.0
    cooldown: float = 30.0
    metric: str = "rollout_wait_fraction"
    history: list[Recommendation] = field(default_factory=list)
    last_reshard: float | None = None

    @classmethod
    def from_spec(cls, autoscaling: object, rollout_role: object) -> Autoscaler:
        """From `spec.AutoscalingSpec` and `spec.RolloutRoleSpec` (duck-typed: no import needed)."""
        a, r = autoscaling, rollout_role
        return cls(
            min_replicas=r.min_replicas,  # type: ignore[attr-defined]
            max_replicas=r.max_replicas,  # type: ignore[attr-defined]
            target=a.target,  # type: ignore[attr-defined]
            tolerance=a.tolerance,  # type: ignore[attr-defined]
            window=a.stabilization_window_seconds,  # type: ignore[attr-defined]
            cooldown=a.cooldown_seconds,  # type: ignore[attr-defined]
            metric=a.metric,  # type: ignore[attr-defined]
        )

    def step(self, current: int, signal: float | None, now: float) -> Decision:
        d = decide(
            current=current,
            min_replicas=self.min_replicas,
            max_replicas=self.max_replicas,
            signal=signal,
            target=self.target,
            tolerance=self.tolerance,
            history=self.history,
            now=now,
            last_reshard=self.last_reshard,
            window=self.window,
            cooldown=self.cooldown,
            metric=self.metric,
        )
        self.history = prune([*self.history, Recommendation(now, d.recommendation)], now, self.window)
        return d

    def resharded(self, now: float) -> None:
        """Call when a reshard (fleet change) completed: starts the cooldown."""
        self.last_reshard = now


# ---------------------------------------------------------------------------------------------
# Metric sources. Both return None when the value is absent, and raise MetricError when the
# endpoint is unreachable or answers garbage, so the caller can log it and hold the fleet.
# ---------------------------------------------------------------------------------------------


class MetricError(RuntimeError):
    """The metric endpoint could not be read. The message never quotes the endpoint's answer (it
    lands in the job's status and Events, and the URL may point anywhere the job's author likes)."""


class MetricSource(Protocol):
    def read(self) -> float | None: ...


#: The most bytes of a Prometheus query answer read (one aggregated series needs a few hundred).
MAX_QUERY_ANSWER_BYTES = 1 << 20
#: The most bytes of a scraped exposition read (the controller's /metrics is tens of KiB).
MAX_SCRAPE_BYTES = 4 << 20
_CHUNK = 64 << 10


class _NoRedirects(urllib.request.HTTPRedirectHandler):
    """A 3xx is an answer like any other non-200: the read fails (no request leaves for the
    Location, which could aim the operator's pod at another address)."""

    def redirect_request(self, *args: Any, **kwargs: Any) -> None:
        return None


_OPENER = urllib.request.build_opener(_NoRedirects())


def fetch(url: str, timeout: float, max_bytes: int) -> bytes:
    """GET `url` (http or https only) with every cost bounded: no redirects followed, at most
    `timeout` seconds for the connection and for the whole body, at most `max_bytes` read (the
    rest is never received). Any failure is a MetricError that names the URL and the limit, never
    the answer's content."""
    scheme = urllib.parse.urlsplit(url).scheme
    if scheme not in ("http", "https"):
        raise MetricError(f"{url}: scheme {scheme!r} is not allowed (use http or https)")
    deadline = time.monotonic() + timeout
    try:
        with _OPENER.open(urllib.request.Request(url, headers={"Accept": "*/*"}), timeout=timeout) as resp:
            length = resp.headers.get("Content-Length")
            if length is not None and length.isdigit() and int(length) > max_bytes:
                raise MetricError(f"{url}: answer of {int(length)} bytes exceeds the {max_bytes}-byte limit")
            chunks: list[bytes] = []
            size = 0
            while True:
                if time.monotonic() > deadline:
                    raise MetricError(f"{url}: no complete answer within {timeout:g} s")
                chunk = resp.read1(_CHUNK)
                if not chunk:
                    return b"".join(chunks)
                size += len(chunk)
                if size > max_bytes:
                    raise MetricError(f"{url}: answer exceeds the {max_bytes}-byte limit")
                chunks.append(chunk)
    except urllib.error.HTTPError as e:  # its text is the server's reason phrase: not quoted
        note = " (redirects are not followed)" if 300 <= e.code < 400 else ""
        raise MetricError(f"{url}: answered HTTP {e.code}{note}") from None
    except TimeoutError:
        raise MetricError(f"{url}: no answer within {timeout:g} s") from None
    except urllib.error.URLError as e:  # a local cause: refused, unresolvable, TLS
        reason = "timed out" if isinstance(e.reason, TimeoutError) else type(e.reason).__name__
        raise MetricError(f"{url}: cannot connect ({reason})") from None
    except (OSError, ValueError) as e:  # reset mid-body, malformed status line or headers
        raise MetricError(f"{url}: read failed ({type(e).__name__})") from None


def default_query(metric: str, job: str, namespace: str) -> str:
    """The default PromQL for a built-in signal of one RLTrainingJob."""
    return render_query(metric_def(metric).promql, job, namespace)


def render_query(query: str, job: str, namespace: str) -> str:
    # Plain replacement, not str.format: PromQL is full of braces.
    return query.replace("{job}", job).replace("{namespace}", namespace)


@dataclass
class PrometheusSource:
    """An instant query against the Prometheus HTTP API (`GET /api/v1/query`).

    The query must yield one scalar or a vector of one element; a vector of several is an error
    (the query should aggregate), an empty vector is `None`. Series labels: the chart's
    ServiceMonitor copies the pod label `rlhf.dev/job-name` to `rlhf_job` and Prometheus adds
    `namespace`.
    """

    url: str
    query: str
    timeout: float = 5.0
    max_bytes: int = MAX_QUERY_ANSWER_BYTES

    @classmethod
    def for_job(
        cls, url: str, metric: str, job: str, namespace: str, query: str | None = None, timeout: float = 5.0
    ) -> PrometheusSource:
        """The source for a job: `query` (with `{job}`/`{namespace}`) or the metric's default."""
        q = render_query(query, job, namespace) if query else default_query(metric, job, namespace)
        return cls(url, q, timeout)

    def read(self) -> float | None:
        endpoint = self.url.rstrip("/") + "/api/v1/query?" + urllib.parse.urlencode({"query": self.query})
        try:
            body = json.loads(fetch(endpoint, self.timeout, self.max_bytes))
        except MetricError as e:
            raise MetricError(f"Prometheus query {self.query!r} failed: {e}") from None
        except ValueError:
            raise MetricError(
                f"Prometheus query {self.query!r} at {self.url}: the answer is not JSON"
            ) from None
        try:
            return parse_query_response(body, self.query)
        except MetricError as e:
            raise MetricError(f"{e} (Prometheus at {self.url})") from None


def parse_query_response(body: object, query: str = "") -> float | None:
    """The value of a `/api/v1/query` JSON answer (see `PrometheusSource`). Errors describe the
    answer's shape, never its text (see MetricError)."""
    if not isinstance(body, dict) or body.get("status") != "success":
        raise MetricError(f'Prometheus query {query!r} failed: the answer\'s status is not "success"')
    data = body.get("data")
    data = data if isinstance(data, dict) else {}
    kind, result = data.get("resultType"), data.get("result") or []
    try:
        if kind == "scalar":
            return float(result[1])
        if kind == "vector":
            if not result:
                return None
            if len(result) > 1:
                raise MetricError(f"query {query!r} returned {len(result)} series; aggregate it to one")
            return float(result[0]["value"][1])
    except (TypeError, ValueError, KeyError, IndexError):
        raise MetricError(f"query {query!r}: the answer's value is not a number") from None
    raise MetricError(
        f"query {query!r} returned neither a scalar nor a vector; need a scalar or a one-element vector"
    )


@dataclass
class ScrapeSource:
    """Reads one series from a Prometheus text exposition (the controller's `/metrics`) directly,
    for clusters and local runs without Prometheus. Several samples are combined by the metric's
    rule (`sum` or `max`); `labels` restricts the samples considered."""

    url: str
    series: str
    combine: Literal["sum", "max"] = "max"
    labels: dict[str, str] = field(default_factory=dict)
    timeout: float = 5.0
    max_bytes: int = MAX_SCRAPE_BYTES

    @classmethod
    def for_metric(cls, url: str, metric: str, timeout: float = 5.0) -> ScrapeSource:
        m = metric_def(metric)
        return cls(url, m.series, m.combine, timeout=timeout)

    def read(self) -> float | None:
        try:
            text = fetch(self.url, self.timeout, self.max_bytes).decode("utf-8")
        except MetricError as e:
            raise MetricError(f"scraping failed: {e}") from None
        except UnicodeDecodeError:
            raise MetricError(f"scraping {self.url} failed: the answer is not UTF-8 text") from None
        return parse_exposition(text, self.series, self.combine, self.labels)


def parse_exposition(
    text: str, series: str, combine: Literal["sum", "max"] = "max", labels: dict[str, str] | None = None
) -> float | None:
    """The value of `series` in a Prometheus text exposition; None when it has no (finite) sample.

    Only the lines of `series` reach the parser (a C-speed filter first: the endpoint's author
    controls the rest of the text, and the full parser costs seconds per MiB). Whatever the text
    holds, the only exception is a MetricError."""
    from prometheus_client.parser import text_string_to_metric_families

    want = labels or {}
    values: list[float] = []
    try:
        for family in text_string_to_metric_families(series_lines(text, series)):
            for s in family.samples:
                matches = s.name == series and all(s.labels.get(k) == v for k, v in want.items())
                if matches and math.isfinite(s.value):
                    values.append(float(s.value))
        total = (sum(values) if combine == "sum" else max(values)) if values else None
    except Exception as err:  # ValueError, and whatever else the parser raises on junk
        raise MetricError(f"invalid exposition text ({type(err).__name__})") from None
    if total is not None and not math.isfinite(total):
        raise MetricError(f"{series}: the samples add up to more than a float can hold")
    return total


def series_lines(text: str, series: str) -> str:
    """The lines of `text` that can hold a sample of `series` (name, then `{`, a space or a tab)."""
    lines = [line for line in text.splitlines() if line.startswith(series)]
    return "\n".join(line for line in lines if line[len(series) : len(series) + 1] in ("{", " ", "\t")) + "\n"
