"""The autoscaling policy, rule by rule, and its metric parsers. Pure: no processes, no network
except a local HTTP server for the sources."""

from __future__ import annotations

import http.server
import json
import math
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest

from rlhf_api.autoscale import (
    METRICS,
    Autoscaler,
    MetricDef,
    MetricError,
    PrometheusSource,
    Recommendation,
    ScrapeSource,
    decide,
    default_query,
    parse_exposition,
    parse_query_response,
)


@dataclass
class Case:
    name: str
    current: int
    signal: float | None
    want: int
    cause: str
    metric: str = "rollout_wait_fraction"
    target: float = 0.2
    tolerance: float = 0.1
    lo: int = 1
    hi: int = 8
    history: list[tuple[float, int]] = field(default_factory=list)
    now: float = 1000.0
    last_reshard: float | None = None
    window: float = 60.0
    cooldown: float = 30.0


CASES = [
    # Proportional rule, higher-is-worse fleet fraction: ceil(current * signal / target).
    Case("double load doubles", 2, 0.4, 4, "scale"),
    Case("ratio 1.5 rounds up", 3, 0.3, 5, "scale"),  # ceil(4.5)
    Case("exact ratio no float noise", 3, 0.2 * 4 / 3, 4, "scale"),
    Case("half load halves", 4, 0.1, 2, "scale"),
    Case("zero wait goes to min", 4, 0.0, 1, "scale"),
    # Tolerance band: |ratio - 1| <= tolerance holds.
    Case("inside tolerance above", 4, 0.219, 4, "tolerance"),
    Case("inside tolerance below", 4, 0.181, 4, "tolerance"),
    Case("edge of tolerance holds", 4, 0.22, 4, "tolerance"),
    Case("just outside tolerance", 4, 0.2201, 5, "scale"),
    Case("zero tolerance acts on any change", 10, 0.21, 11, "scale", tolerance=0.0, hi=20),
    # Clamping to [min, max].
    Case("clamped to max", 4, 2.0, 8, "scale"),
    Case("at max wants more", 8, 0.8, 8, "limit"),
    Case("at min wants less", 1, 0.0, 1, "limit"),
    Case("clamped to min", 4, 0.01, 2, "scale", lo=2),
    # Bounds win over everything, even cooldown and missing data.
    Case("below min raised", 0, None, 1, "bounds"),
    Case("above max lowered", 10, 5.0, 8, "bounds", last_reshard=999.0),
    # Missing data holds.
    Case("no data holds", 3, None, 3, "no_data"),
    Case("nan holds", 3, math.nan, 3, "no_data"),
    Case("inf holds", 3, math.inf, 3, "no_data"),
    # Cooldown after a reshard holds; it ends at exactly `cooldown` seconds.
    Case("cooldown holds up", 2, 0.8, 2, "cooldown", last_reshard=990.0),
    Case("cooldown holds down", 4, 0.0, 4, "cooldown", last_reshard=971.0),
    Case("cooldown over", 2, 0.8, 8, "scale", last_reshard=970.0),
    Case("zero cooldown", 2, 0.8, 8, "scale", last_reshard=1000.0, cooldown=0.0),
    # Stabilization: scale down only to the highest recommendation within the window...
    Case("down stabilized", 6, 0.1, 5, "stabilized", history=[(950.0, 5), (980.0, 4)]),
    Case("window keeps current", 6, 0.1, 6, "stabilized", history=[(990.0, 7)]),
    Case("old entries ignored", 6, 0.1, 3, "scale", history=[(939.0, 6)]),
    Case(
        "window edge excluded", 6, 0.1, 3, "scale", history=[(940.0, 6)]
    ),  # HPA: strictly after now - window
    Case("inside window edge", 6, 0.1, 6, "stabilized", history=[(940.5, 6)]),
    Case("zero window", 6, 0.1, 3, "scale", history=[(1000.0, 6)], window=0.0),
    # ... and up immediately, whatever the history says.
    Case("up ignores window", 2, 0.4, 4, "scale", history=[(990.0, 1)]),
    # Queue depth: a total, target per replica -> ceil(signal / target).
    Case("queue 40 at 8 per replica", 2, 40, 5, "scale", metric="queue_depth", target=8),
    Case("queue in tolerance", 5, 41, 5, "tolerance", metric="queue_depth", target=8),
    Case("queue empty", 5, 0, 1, "scale", metric="queue_depth", target=8),
    # Tokens/s: fleet total, target per busy replica.
    Case("tokens saturated", 2, 3000, 3, "scale", metric="tokens_per_second", target=1000),
    Case("tokens starved", 4, 1000, 1, "scale", metric="tokens_per_second", target=1000),
    # Zero replicas allowed by min=0: any demand starts the fleet.
    Case("zero fleet no demand", 0, 0.0, 0, "tolerance", lo=0),
    Case("zero fleet wait starts one", 0, 0.5, 1, "scale", lo=0),
    Case("zero fleet queue sized", 0, 20, 3, "scale", metric="queue_depth", target=8, lo=0),
]


@pytest.mark.parametrize("c", CASES, ids=[c.name for c in CASES])
def test_policy_table(c: Case) -> None:
    d = decide(
        current=c.current,
        min_replicas=c.lo,
        max_replicas=c.hi,
        signal=c.signal,
        target=c.target,
        tolerance=c.tolerance,
        history=[Recommendation(t, r) for t, r in c.history],
        now=c.now,
        last_reshard=c.last_reshard,
        window=c.window,
        cooldown=c.cooldown,
        metric=c.metric,
    )
    assert (d.desired, d.cause) == (c.want, c.cause), d.reason
    assert d.direction == ("up" if c.want > c.current else "down" if c.want < c.current else "none")
    assert c.lo <= d.desired <= c.hi
    assert d.reason


def test_recommendation_is_unstabilized() -> None:
    d = decide(
        current=6, min_replicas=1, max_replicas=8, signal=0.1, target=0.2, tolerance=0.1,
        history=[Recommendation(990.0, 6)], now=1000.0, last_reshard=None, window=60, cooldown=0,
    )  # fmt: skip
    assert (d.desired, d.recommendation) == (6, 3)


def test_inverted_metric() -> None:
    idle = MetricDef("idle_fraction", "x_idle", per_replica_target=False, higher_is_worse=False)
    kw: dict[str, Any] = dict(min_replicas=1, max_replicas=10, target=0.5, tolerance=0.1, history=[], now=0.0,
              last_reshard=None, window=0, cooldown=0, metric=idle)  # fmt: skip
    assert decide(current=4, signal=0.25, **kw).desired == 8  # too little idle: more replicas
    assert decide(current=4, signal=1.0, **kw).desired == 2
    assert decide(current=4, signal=0.0, **kw).desired == 10  # no idle at all: unbounded, clamped


@pytest.mark.parametrize(
    "kw, msg",
    [
        (dict(min_replicas=3, max_replicas=2), "min=3 max=2"),
        (dict(target=0.0), "target must be > 0"),
        (dict(tolerance=-1), "must be >= 0"),
        (dict(metric="latency"), "valid: queue_depth, rollout_wait_fraction, tokens_per_second"),
    ],
)
def test_invalid_arguments(kw: dict[str, Any], msg: str) -> None:
    base: dict[str, Any] = dict(current=1, min_replicas=1, max_replicas=2, signal=0.1, target=0.2, tolerance=0.1,
                history=[], now=0.0, last_reshard=None, window=0, cooldown=0)  # fmt: skip
    with pytest.raises(ValueError, match=msg):
        decide(**{**base, **kw})


def test_autoscaler_sequence() -> None:
    """A load spike and its end: immediate scale-up, cooldown, stabilized scale-down."""
    a = Autoscaler(min_replicas=1, max_replicas=3, target=0.2, tolerance=0.1, window=60, cooldown=30)
    n, trace = 1, []
    for t, wait in [(0, 0.2), (15, 0.6), (30, 0.6), (45, 0.6), (60, 0.3), (75, 0.0), (90, 0.0),
                    (105, 0.0), (120, 0.0), (135, 0.0), (150, 0.0)]:  # fmt: skip
        d = a.step(n, wait, float(t))
        if d.desired != n:
            a.resharded(float(t))
        n = d.desired
        trace.append((t, n, d.cause))
    causes = {t: c for t, _, c in trace}
    sizes = {t: s for t, s, _ in trace}
    assert sizes[15] == 3 and causes[15] == "scale"
    assert causes[30] == "cooldown"
    assert causes[45] == "limit"  # 30 s after the reshard the cooldown is over
    assert sizes[75] == 3 and causes[75] == "stabilized"
    # The last recommendation of 3 was made at t=60 (at max, wanting more); down is allowed once
    # it leaves the 60 s window, i.e. at t=120 (entries strictly newer than now - window count).
    assert sizes[105] == 3 and sizes[120] == 1 and causes[120] == "scale"
    assert causes[135] == "cooldown"
    assert all(150 - h.time < a.window for h in a.history)


def test_history_round_trips() -> None:
    r = Recommendation(12.5, 3)
    assert Recommendation.from_dict(json.loads(json.dumps(r.to_dict()))) == r


def test_autoscaler_from_spec() -> None:
    from rlhf_api.roles import AutoscalingSpec, RolloutRoleSpec

    a = Autoscaler.from_spec(
        AutoscalingSpec(metric="queue_depth", target=4), RolloutRoleSpec(min_replicas=1, max_replicas=3)
    )
    assert (a.metric, a.target, a.max_replicas, a.window, a.cooldown) == ("queue_depth", 4, 3, 60, 30)


def test_import_without_torch_or_kubernetes() -> None:
    code = (
        "import sys; import rlhf_api.autoscale; "
        "bad = [m for m in ('torch', 'kubernetes', 'kopf', 'ray') if m in sys.modules]; "
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


# --- metric parsing and sources ---------------------------------------------------------------

EXPOSITION = """\
# HELP rlhf_rollout_wait_fraction Fraction of step time waiting for rollouts.
# TYPE rlhf_rollout_wait_fraction gauge
rlhf_rollout_wait_fraction 0.35
# HELP rlhf_tokens_per_second Generated tokens per second.
# TYPE rlhf_tokens_per_second gauge
rlhf_tokens_per_second{replica="0"} 100.0
rlhf_tokens_per_second{replica="1"} 250.0
# HELP rlhf_queue_depth Prompts queued.
# TYPE rlhf_queue_depth gauge
rlhf_queue_depth NaN
"""


def test_parse_exposition() -> None:
    assert parse_exposition(EXPOSITION, "rlhf_rollout_wait_fraction") == 0.35
    assert parse_exposition(EXPOSITION, "rlhf_tokens_per_second", "sum") == 350.0
    assert parse_exposition(EXPOSITION, "rlhf_tokens_per_second", "max") == 250.0
    assert parse_exposition(EXPOSITION, "rlhf_tokens_per_second", labels={"replica": "0"}) == 100.0
    assert parse_exposition(EXPOSITION, "rlhf_queue_depth") is None  # NaN is no data
    assert parse_exposition(EXPOSITION, "rlhf_kl") is None


def test_parse_query_response() -> None:
    vec = {
        "status": "success",
        "data": {"resultType": "vector", "result": [{"metric": {}, "value": [1, "0.5"]}]},
    }
    assert parse_query_response(vec) == 0.5
    assert parse_query_response({"status": "success", "data": {"resultType": "vector", "result": []}}) is None
    assert (
        parse_query_response({"status": "success", "data": {"resultType": "scalar", "result": [1, "2"]}})
        == 2.0
    )
    two = {"status": "success", "data": {"resultType": "vector", "result": [vec["data"]["result"][0]] * 2}}  # type: ignore[index]
    with pytest.raises(MetricError, match="aggregate"):
        parse_query_response(two, "q")
    with pytest.raises(MetricError, match="failed"):
        parse_query_response({"status": "error", "error": "parse error"}, "q")


def test_default_queries_substitute_job() -> None:
    for name in METRICS:
        q = default_query(name, "my-job", "team-a")
        assert 'rlhf_job="my-job"' in q and 'namespace="team-a"' in q and "{job}" not in q, q


@pytest.fixture
def http_server() -> Iterator[tuple[str, list[str]]]:
    paths: list[str] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802
            paths.append(self.path)
            if self.path.startswith("/api/v1/query"):
                body = json.dumps(
                    {
                        "status": "success",
                        "data": {"resultType": "vector", "result": [{"metric": {}, "value": [0, "0.42"]}]},
                    }
                ).encode()
            else:
                body = EXPOSITION.encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *a: object) -> None:
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{srv.server_address[1]}", paths
    srv.shutdown()


def test_sources_over_http(http_server: tuple[str, list[str]]) -> None:
    url, paths = http_server
    src = PrometheusSource.for_job(url, "rollout_wait_fraction", "j", "ns")
    assert src.read() == 0.42
    assert "rlhf_job%3D%22j%22" in paths[-1]
    assert (
        PrometheusSource.for_job(url, "queue_depth", "j", "ns", query='sum(q{rlhf_job="{job}"})').query
        == 'sum(q{rlhf_job="j"})'
    )
    assert ScrapeSource.for_metric(url + "/metrics", "tokens_per_second").read() == 350.0
    with pytest.raises(MetricError, match="failed"):
        ScrapeSource("http://127.0.0.1:1/metrics", "x", timeout=1).read()
