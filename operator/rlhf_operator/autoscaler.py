"""The operator's autoscaler: the shared policy (`rlhf_api.autoscale.decide`) applied to one
RLTrainingJob, as pure functions of the job and its status.

The policy needs a memory between periods: the recent recommendations (for the scale-down
stabilization window) and the time of the last completed reshard (for the cooldown). The operator
is level-based, so that memory lives in the job's `status.autoscaling`, not in the process: a
restarted operator continues where the last one stopped. Each pass the executor

1. asks `observe_reshard` whether `status.rollout.syncedGeneration` has caught up with
   `generation` since the last look (then the reshard completed: `lastReshardTime` = now);
2. asks `due_in` whether `periodSeconds` have passed since `lastEvaluationTime`;
3. if due, reads the signal from `metric_source(...)` (the only I/O, done by the executor) and
   calls `evaluate`, which returns the new `status.autoscaling`, the replica count to write to the
   `/scale` subresource (None: unchanged), an Event and a log line.

Writing `/scale` is all the autoscaler does to the fleet: the ordinary reconcile then creates the
new pods, bumps `status.rollout.generation` and deletes leaving pods only once the controller
reports them drained (`rollout.py`), exactly as after `kubectl scale` or an HPA's write.

A job may name its own Prometheus (`spec.autoscaling.prometheus.url`), but the operator sends
the request from its own pod, so the URL is honoured only when the operator allows it: it must lie
under one of the URL prefixes the operator is given (`RLHF_OPERATOR_PROMETHEUS_URL_PREFIXES`,
comma-separated; the chart's `autoscaler.prometheusUrlPrefixes`; none by default). Any other URL
is refused (`refusal`): the signal is read from the job's own controller pod instead, and the job
carries the condition `PrometheusRefused` (True, reason `URLNotAllowed`) naming the URL and what
is allowed, with one Warning Event, until the URL is allowed or removed.

The query is the operator's too: a job's URL is queried with the built-in PromQL template of its
`metric`, selecting only the job's own series (`rlhf_job` and `namespace` labels, their values
escaped as PromQL strings), so the signal written to `status.autoscaling.signal` is the job's own,
never another tenant's. A job's own `prometheus.query` (free PromQL: any tenant's series) is
honoured only where the operator allows it (`RLHF_OPERATOR_PROMETHEUS_CUSTOM_QUERIES=true`, the
chart's `autoscaler.allowCustomQueries`; off by default); otherwise it is refused like a URL
(`PrometheusRefused`, reason `QueryNotAllowed`). A URL with a query string, a fragment or user
information is refused whatever the prefixes: a `#` would drop the path the operator appends.

One rule beyond the shared policy: while a reshard is in flight (the controller has reported a
`syncedGeneration`, but an older one than `generation`) the fleet is held, because the trainer's
wait during a sync is not evidence of load and the previous change has not yet taken effect.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import math
import posixpath
import urllib.parse
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from rlhf_api import contract
from rlhf_api.autoscale import (
    Decision,
    MetricSource,
    PrometheusSource,
    Recommendation,
    ScrapeSource,
    decide,
    metric_def,
    prune,
    render_query,
)
from rlhf_api.contract import ROLLOUT_GENERATION, ROLLOUT_SYNCED_GENERATION
from rlhf_api.job import RLTrainingJob
from rlhf_api.status import PROMETHEUS_REFUSED, parse_time
from rlhf_operator.status import get_condition, set_condition

#: Where the controller pod serves `/metrics` when no Prometheus is configured; `{job}` and
#: `{namespace}` are substituted. `rlhf operator --controller-metrics-url` overrides it.
DEFAULT_CONTROLLER_METRICS_URL = contract.CONTROLLER_METRICS_URL
#: The most recommendations kept in status (the CRD's maxItems).
MAX_RECOMMENDATIONS = 64
#: Seconds a metric read may take before the evaluation counts as "no data".
READ_TIMEOUT_SECONDS = 3.0
#: The most bytes of a job's /metrics the operator reads (the controller serves tens of KiB; the
#: job's author controls the endpoint, and the operator's threads serve every tenant).
MAX_SCRAPE_BYTES = 256 << 10


def stamp(t: dt.datetime) -> str:
    """RFC 3339 with microseconds (like Kubernetes' MicroTime): periods and cooldowns of a few
    seconds must not lose up to a second to truncation."""
    return t.astimezone(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def parse_stamp(value: str | None) -> dt.datetime | None:
    """A time written by `stamp`, or by `rlhf_api.status.rfc3339` (whole seconds)."""
    if value and "." in value:
        return dt.datetime.strptime(value, "%Y-%m-%dT%H:%M:%S.%fZ").replace(tzinfo=dt.timezone.utc)
    return parse_time(value)


def enabled(job: RLTrainingJob | None, phase: str | None) -> bool:
    """The autoscaler runs only for a valid job with autoscaling on, while it is Running."""
    return job is not None and job.spec.autoscaling.enabled and phase == "Running"


def controller_metrics_url(template: str, job: str, namespace: str) -> str:
    return template.replace("{job}", job).replace("{namespace}", namespace)


#: The operator's allow-list of Prometheus URL prefixes (comma-separated; the chart sets it).
PROMETHEUS_URL_PREFIXES_ENV = "RLHF_OPERATOR_PROMETHEUS_URL_PREFIXES"
_DEFAULT_PORTS = {"http": 80, "https": 443}


#: `true`: a job's own `prometheus.query` is sent as written (see the module's docstring).
PROMETHEUS_CUSTOM_QUERIES_ENV = "RLHF_OPERATOR_PROMETHEUS_CUSTOM_QUERIES"


def custom_queries_allowed(env: Mapping[str, str]) -> bool:
    """Whether the operator sends a job's own PromQL (`true`), or only its built-in templates."""
    raw = env.get(PROMETHEUS_CUSTOM_QUERIES_ENV, "").strip().lower()
    if raw not in ("", "true", "false"):
        raise ValueError(f"{PROMETHEUS_CUSTOM_QUERIES_ENV}={raw!r} is not valid; valid: true or false")
    return raw == "true"


def promql_string(value: str) -> str:
    """`value` escaped for the inside of a PromQL double-quoted string."""
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def prometheus_url_prefixes(env: Mapping[str, str]) -> tuple[str, ...]:
    """The allow-list from the operator's environment (empty: no job may name a Prometheus)."""
    return tuple(filter(None, (p.strip() for p in env.get(PROMETHEUS_URL_PREFIXES_ENV, "").split(","))))


def _origin_and_path(url: str) -> tuple[tuple[str, str, int | None], str] | None:
    """((scheme, host, port), normalised path) of an http(s) URL; None when it is not one, or
    when its path climbs out of itself (`..`, also percent-encoded)."""
    try:
        parts = urllib.parse.urlsplit(url.strip())
        port = parts.port
    except ValueError:
        return None
    scheme = parts.scheme.lower()
    if scheme not in _DEFAULT_PORTS or not parts.hostname:
        return None
    if parts.query or parts.fragment or "#" in url or "?" in url or parts.username is not None:
        return None  # the operator appends /api/v1/query?...: a '#' or '?' would change what it sends
    path = urllib.parse.unquote(parts.path)
    if ".." in path.split("/"):
        return None
    path = posixpath.normpath("/" + path).rstrip("/") if path.strip("/") else ""
    return (scheme, parts.hostname.lower(), port or _DEFAULT_PORTS[scheme]), path


def prometheus_url_allowed(url: str, prefixes: Sequence[str]) -> bool:
    """True when `url` lies under one of `prefixes`: the same scheme, host and port, and a path at
    or below the prefix's (`http://prom:9090` allows `http://prom:9090/api`, not
    `http://prom:9090.evil.example`, `http://prom:90901` or `http://prom:9090@evil.example`)."""
    target = _origin_and_path(url)
    if target is None:
        return False
    for prefix in prefixes:
        allowed = _origin_and_path(prefix)
        if allowed is None or allowed[0] != target[0]:
            continue
        base, path = allowed[1], target[1]
        if not base or path == base or path.startswith(base + "/"):
            return True
    return False


QUERY_REFUSED = "spec.autoscaling.prometheus.query"


def refusal(job: RLTrainingJob, prefixes: Sequence[str], custom_queries: bool = False) -> str | None:
    """Why the operator will not query the job's Prometheus (None: it will, or there is none)."""
    prometheus = job.spec.autoscaling.prometheus
    if prometheus is None:
        return None
    if prometheus.query and not custom_queries:
        return (
            f"{QUERY_REFUSED} is not allowed by the operator (its own PromQL could read any tenant's "
            f"series; {PROMETHEUS_CUSTOM_QUERIES_ENV}, the chart's autoscaler.allowCustomQueries): remove it "
            f"to query the built-in {job.spec.autoscaling.metric} template; the signal is read from the "
            "job's controller pod (/metrics) meanwhile"
        )
    if prometheus_url_allowed(prometheus.url, prefixes):
        return None
    allowed = ", ".join(prefixes) if prefixes else "none"
    return (
        f"spec.autoscaling.prometheus.url {prometheus.url!r} is not allowed by the operator (allowed URL "
        f"prefixes: {allowed}; the chart's autoscaler.prometheusUrlPrefixes): the signal is read from the "
        "job's controller pod (/metrics) instead"
    )


def refusal_conditions(
    conditions: list[dict[str, Any]], refused: str | None, now: dt.datetime
) -> list[dict[str, Any]] | None:
    """The job's conditions with `PrometheusRefused` brought up to date, or None when unchanged (it
    is written only once a URL was refused)."""
    was = get_condition({"conditions": conditions}, PROMETHEUS_REFUSED)
    if refused is not None:
        if was and was.get("status") == "True" and was.get("message") == refused:
            return None
        reason = "QueryNotAllowed" if refused.startswith(QUERY_REFUSED) else "URLNotAllowed"
        return set_condition(conditions, PROMETHEUS_REFUSED, True, reason, refused, now)
    if was and was.get("status") == "True":
        message = "spec.autoscaling.prometheus.url is allowed or unset"
        return set_condition(conditions, PROMETHEUS_REFUSED, False, "URLAllowed", message, now)
    return None


def metric_source(
    job: RLTrainingJob,
    url_template: str = DEFAULT_CONTROLLER_METRICS_URL,
    prometheus_prefixes: Sequence[str] = (),
    custom_queries: bool = False,
) -> MetricSource:
    """PromQL against `spec.autoscaling.prometheus.url` when set and allowed (`refusal`), else a
    scrape of the job's controller pod. The PromQL is the metric's built-in template over the
    job's own series, the job's name and namespace escaped (its own query only where allowed)."""
    a = job.spec.autoscaling
    name, namespace = job.metadata_name, job.namespace
    if a.prometheus is not None and refusal(job, prometheus_prefixes, custom_queries) is None:
        query = a.prometheus.query if custom_queries and a.prometheus.query else None
        template = query or metric_def(a.metric).promql
        rendered = render_query(template, promql_string(name), promql_string(namespace))
        return PrometheusSource(a.prometheus.url, rendered, READ_TIMEOUT_SECONDS)
    url = controller_metrics_url(url_template, name, namespace)
    source = ScrapeSource.for_metric(url, a.metric, timeout=READ_TIMEOUT_SECONDS)
    return dataclasses.replace(source, max_bytes=MAX_SCRAPE_BYTES)


def observe_reshard(auto: dict[str, Any], rollout: dict[str, Any], now: dt.datetime) -> dict[str, Any] | None:
    """The new `status.autoscaling` when a reshard completed since the last look, else None.

    A reshard completes when the controller's `syncedGeneration` reaches the operator's
    `generation`; `reshardedGeneration` remembers which one was seen, so it is stamped once.
    """
    generation = int(rollout.get(ROLLOUT_GENERATION) or 0)
    synced = int(rollout.get(ROLLOUT_SYNCED_GENERATION) or 0)
    seen = int(auto.get("reshardedGeneration") or 0)
    if generation <= 0 or synced < generation or seen >= generation:
        return None
    return {**auto, "reshardedGeneration": generation, "lastReshardTime": stamp(now)}


def due_in(auto: dict[str, Any], period_seconds: float, now: dt.datetime) -> float:
    """Seconds until the next evaluation (<= 0: now)."""
    last = parse_stamp(auto.get("lastEvaluationTime"))
    if last is None:
        return 0.0
    return period_seconds - (now - last).total_seconds()


def compact(history: list[Recommendation], limit: int = MAX_RECOMMENDATIONS) -> list[Recommendation]:
    """Drop entries that can never be the window's maximum: one followed by a later entry at least
    as high (the later one stays in the window longer). Keeps the newest `limit`."""
    kept: list[Recommendation] = []
    for rec in reversed(history):
        if not kept or rec.replicas > kept[-1].replicas:
            kept.append(rec)
    return list(reversed(kept))[-limit:]


@dataclass(frozen=True)
class Evaluation:
    """What one evaluation decided."""

    #: The new `status.autoscaling` (written whatever the decision).
    status: dict[str, Any]
    decision: Decision
    #: Write this to the /scale subresource (None: the count stays).
    replicas: int | None
    #: One line for the log, and for an Event when `replicas` is set.
    message: str
    #: Event reason (`AutoscaledUp`, `AutoscaledDown`) when `replicas` is set.
    event_reason: str | None


def evaluate(
    job: RLTrainingJob,
    auto: dict[str, Any],
    rollout: dict[str, Any],
    signal: float | None,
    now: dt.datetime,
    read_error: str | None = None,
) -> Evaluation:
    """Run the policy once. `auto` and `rollout` are the job's `status.autoscaling` and
    `status.rollout`; `signal` the value just read (None: absent or unreadable, see `read_error`)."""
    a, r = job.spec.autoscaling, job.spec.roles.rollout
    t = now.timestamp()
    history = [Recommendation.from_dict(d) for d in auto.get("recommendations") or []]
    last_reshard = parse_stamp(auto.get("lastReshardTime"))
    generation = int(rollout.get(ROLLOUT_GENERATION) or 0)
    synced = int(rollout.get(ROLLOUT_SYNCED_GENERATION) or 0)
    current = r.replicas
    if 0 < synced < generation:
        d = Decision(
            current,
            current,
            "none",
            "resharding",
            f"reshard in flight (generation {generation}, synced {synced}); holding {current}",
            current,
            signal=signal,
        )
    else:
        d = decide(
            current=current,
            min_replicas=r.min_replicas,
            max_replicas=r.max_replicas,
            signal=signal,
            target=a.target,
            tolerance=a.tolerance,
            history=history,
            now=t,
            last_reshard=None if last_reshard is None else last_reshard.timestamp(),
            window=float(a.stabilization_window_seconds),
            cooldown=float(a.cooldown_seconds),
            metric=a.metric,
        )
    history = compact(
        prune([*history, Recommendation(t, d.recommendation)], t, a.stabilization_window_seconds)
    )
    reason = d.reason if read_error is None or d.cause != "no_data" else f"{d.reason} ({read_error})"
    status = {
        **auto,
        "recommendations": [h.to_dict() for h in history],
        "lastEvaluationTime": stamp(now),
        "signal": signal if signal is not None and math.isfinite(signal) else None,
        "desiredReplicas": d.desired,
        "reason": reason[:1024],
    }
    changed = d.desired != current
    message = f"rollout replicas {current} -> {d.desired} [{d.cause}]: {reason}"
    return Evaluation(
        status=status,
        decision=d,
        replicas=d.desired if changed else None,
        message=message[:1024],
        event_reason=("AutoscaledUp" if d.direction == "up" else "AutoscaledDown") if changed else None,
    )
