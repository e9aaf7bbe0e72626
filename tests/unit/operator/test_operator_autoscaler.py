"""The operator's autoscaler: the pure evaluation (`rlhf_operator.autoscaler`) table-driven, and its
I/O in the executor against an in-memory API (no cluster, no network)."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from operator_helpers import BASE_SPEC, at, job, merge_patch

from rlhf_api.autoscale import PrometheusSource, Recommendation, ScrapeSource
from rlhf_api.loader import parse_job
from rlhf_operator import autoscaler, kube, metrics
from rlhf_operator.executor import Executor
from rlhf_operator.status import get_condition

AUTO = {
    "enabled": True,
    "target": 0.2,
    "tolerance": 0.1,
    "periodSeconds": 5,
    "stabilizationWindowSeconds": 30,
    "cooldownSeconds": 10,
}


def spec(replicas: int = 2, **auto: Any) -> dict[str, Any]:
    s = copy.deepcopy(BASE_SPEC)
    s["roles"]["rollout"]["replicas"] = replicas
    s["autoscaling"] = {**AUTO, **auto}
    return s


def parsed(replicas: int = 2, **auto: Any) -> Any:
    body = job(spec=spec(replicas, **auto))
    return parse_job(body)


# -- pure ---------------------------------------------------------------------------------------


def test_enabled_only_for_running_jobs_with_autoscaling_on() -> None:
    assert autoscaler.enabled(parsed(), "Running")
    assert not autoscaler.enabled(parsed(), "Scheduling")
    assert not autoscaler.enabled(parsed(enabled=False), "Running")
    assert not autoscaler.enabled(None, "Running")


def test_metric_source_prometheus_when_configured_else_controller_scrape() -> None:
    src = autoscaler.metric_source(parsed(), "http://127.0.0.1:9/{namespace}/{job}/metrics")
    assert isinstance(src, ScrapeSource)
    assert (src.url, src.series) == ("http://127.0.0.1:9/ns/j/metrics", "rlhf_rollout_wait_fraction")
    default = autoscaler.metric_source(parsed())
    assert isinstance(default, ScrapeSource) and default.url == "http://j-controller.j.ns.svc:8080/metrics"
    prom = autoscaler.metric_source(
        parsed(prometheus={"url": "http://prom:9090"}), prometheus_prefixes=["http://prom:9090"]
    )
    assert isinstance(prom, PrometheusSource)
    assert prom.url == "http://prom:9090" and 'rlhf_job="j",namespace="ns"' in prom.query
    # A URL the operator does not allow: the job's own controller is scraped instead.
    refused = autoscaler.metric_source(parsed(prometheus={"url": "http://prom:9090"}))
    assert isinstance(refused, ScrapeSource) and refused.url == "http://j-controller.j.ns.svc:8080/metrics"


# (case, url, allowed prefixes) -> allowed
URLS = [
    ("no allow-list", "http://prom:9090", [], False),
    ("exact", "http://prom:9090", ["http://prom:9090"], True),
    ("a path below", "http://prom:9090/prometheus", ["http://prom:9090"], True),
    ("trailing slash on the prefix", "http://prom:9090/api", ["http://prom:9090/"], True),
    ("host case, default port", "http://PROM.monitoring", ["http://prom.monitoring:80"], True),
    ("https default port", "https://prom:443/x", ["https://prom"], True),
    ("another scheme", "https://prom:9090", ["http://prom:9090"], False),
    ("a longer host", "http://prom:9090.evil.example", ["http://prom:9090"], False),
    ("a host suffix", "http://prometheus.evil", ["http://prom"], False),
    ("another port", "http://prom:90901", ["http://prom:9090"], False),
    ("user info pointing elsewhere", "http://prom:9090@evil.example/", ["http://prom:9090"], False),
    ("a sibling path", "http://gw/prometheus-admin", ["http://gw/prometheus"], False),
    ("below the prefix path", "http://gw/prometheus/x", ["http://gw/prometheus"], True),
    ("climbing out", "http://gw/prometheus/../admin", ["http://gw/prometheus"], False),
    ("climbing out, encoded", "http://gw/prometheus/%2e%2e/admin", ["http://gw/prometheus"], False),
    ("not http", "file:///etc/passwd", ["file:///"], False),
    ("a bad port", "http://prom:99999", ["http://prom:9090"], False),
    ("second prefix", "http://b:1", ["http://a:1", "http://b:1"], True),
]


@pytest.mark.parametrize("url,prefixes,allowed", [c[1:] for c in URLS], ids=[c[0] for c in URLS])
def test_prometheus_url_allowed(url: str, prefixes: list[str], allowed: bool) -> None:
    assert autoscaler.prometheus_url_allowed(url, prefixes) is allowed


def test_prefixes_from_the_operators_environment() -> None:
    env = {autoscaler.PROMETHEUS_URL_PREFIXES_ENV: " http://a:9090 ,,http://b/prom"}
    assert autoscaler.prometheus_url_prefixes(env) == ("http://a:9090", "http://b/prom")
    assert autoscaler.prometheus_url_prefixes({}) == ()


def test_refusal_names_the_url_and_what_is_allowed() -> None:
    job_ = parsed(prometheus={"url": "http://169.254.169.254/latest"})
    message = autoscaler.refusal(job_, ["http://prom:9090"])
    assert message is not None
    assert "spec.autoscaling.prometheus.url 'http://169.254.169.254/latest' is not allowed" in message
    assert (
        "allowed URL prefixes: http://prom:9090" in message and "autoscaler.prometheusUrlPrefixes" in message
    )
    assert "controller pod" in message
    assert "allowed URL prefixes: none" in (autoscaler.refusal(job_, []) or "")
    assert autoscaler.refusal(parsed(), []) is None  # no URL: nothing refused
    assert autoscaler.refusal(job_, ["http://169.254.169.254"]) is None


REFUSED = {"type": "PrometheusRefused", "status": "True", "reason": "URLNotAllowed", "message": "m"}

# (case, conditions, refusal) -> (status, reason) written, or None: unchanged
CONDITIONS = [
    ("first refusal", [], "m", ("True", "URLNotAllowed")),
    ("still refused, same words", [REFUSED], "m", None),
    ("refused for another URL", [REFUSED], "m2", ("True", "URLNotAllowed")),
    ("allowed since", [REFUSED], None, ("False", "URLAllowed")),
    ("never refused", [], None, None),
]


@pytest.mark.parametrize("conds,refused,want", [c[1:] for c in CONDITIONS], ids=[c[0] for c in CONDITIONS])
def test_refusal_conditions(
    conds: list[dict[str, Any]], refused: str | None, want: tuple[str, str] | None
) -> None:
    out = autoscaler.refusal_conditions(conds, refused, at(0))
    got = next(((c["status"], c["reason"]) for c in out or [] if c["type"] == "PrometheusRefused"), None)
    assert got == want


@pytest.mark.parametrize(
    ("rollout", "seen", "stamped"),
    [
        ({"generation": 2, "syncedGeneration": 1}, 1, False),  # in flight
        ({"generation": 2, "syncedGeneration": 2}, 1, True),  # caught up: stamp now
        ({"generation": 2, "syncedGeneration": 2}, 2, False),  # already stamped
        ({"generation": 0, "syncedGeneration": 0}, 0, False),
    ],
)
def test_observe_reshard_stamps_once_when_synced_catches_up(
    rollout: dict[str, int], seen: int, stamped: bool
) -> None:
    out = autoscaler.observe_reshard({"reshardedGeneration": seen}, rollout, at(7))
    if stamped:
        assert out == {
            "reshardedGeneration": rollout["generation"],
            "lastReshardTime": "2025-01-01T12:00:07.000000Z",
        }
    else:
        assert out is None


def test_due_in_counts_from_the_last_evaluation() -> None:
    assert autoscaler.due_in({}, 5, at(0)) == 0
    auto = {"lastEvaluationTime": "2025-01-01T12:00:00Z"}
    assert autoscaler.due_in(auto, 5, at(3)) == pytest.approx(2)
    assert autoscaler.due_in(auto, 5, at(5)) <= 0


def test_stamps_keep_sub_second_precision_and_read_whole_seconds() -> None:
    t = at(1.25)
    assert autoscaler.parse_stamp(autoscaler.stamp(t)) == t
    assert autoscaler.parse_stamp("2025-01-01T12:00:01Z") == at(1)
    assert autoscaler.due_in({"lastEvaluationTime": autoscaler.stamp(at(0.5))}, 1, at(1.25)) == pytest.approx(
        0.25
    )


def test_cli_takes_the_controller_metrics_url_from_flag_or_env(monkeypatch: pytest.MonkeyPatch) -> None:
    import argparse

    from rlhf_operator import cli

    def parse(*argv: str) -> argparse.Namespace:
        parser = argparse.ArgumentParser()
        cli.add_subcommands(parser.add_subparsers())
        return parser.parse_args(["operator", *argv])

    monkeypatch.delenv("RLHF_OPERATOR_CONTROLLER_METRICS_URL", raising=False)
    assert parse().controller_metrics_url == autoscaler.DEFAULT_CONTROLLER_METRICS_URL  # cli's copy agrees
    assert parse("--controller-metrics-url", "http://x/{job}").controller_metrics_url == "http://x/{job}"
    monkeypatch.setenv("RLHF_OPERATOR_CONTROLLER_METRICS_URL", "http://env/{namespace}")
    assert parse().controller_metrics_url == "http://env/{namespace}"


def test_compact_keeps_every_possible_window_maximum() -> None:
    hist = [Recommendation(t, r) for t, r in [(0, 3), (1, 4), (2, 2), (3, 3), (4, 1)]]
    kept = autoscaler.compact(hist)
    assert kept == [Recommendation(1, 4), Recommendation(3, 3), Recommendation(4, 1)]
    for start in range(5):  # the max over any suffix window is unchanged
        assert max(h.replicas for h in hist if h.time >= start) == max(
            h.replicas for h in kept if h.time >= start
        )
    assert len(autoscaler.compact([Recommendation(t, 100 - t) for t in range(100)], limit=64)) == 64


@pytest.mark.parametrize(
    ("case", "replicas", "signal", "auto", "rollout", "want", "cause"),
    [
        ("high wait scales up at once", 2, 0.4, {}, {"generation": 1, "syncedGeneration": 1}, 4, "scale"),
        ("within tolerance holds", 2, 0.21, {}, {"generation": 1, "syncedGeneration": 1}, None, "tolerance"),
        ("no data holds", 2, None, {}, {"generation": 1}, None, "no_data"),
        (
            "reshard in flight holds",
            2,
            0.9,
            {},
            {"generation": 3, "syncedGeneration": 2},
            None,
            "resharding",
        ),
        (
            "cooldown after a reshard holds",
            2,
            0.9,
            {"lastReshardTime": "2025-01-01T12:00:55Z"},
            {"generation": 2, "syncedGeneration": 2},
            None,
            "cooldown",
        ),
        (
            "scale-down waits for the window",
            4,
            0.05,
            {"recommendations": [{"time": at(40).timestamp(), "replicas": 4}]},
            {"generation": 2, "syncedGeneration": 2},
            None,
            "stabilized",
        ),
        (
            "scale-down after the window",
            4,
            0.05,
            {"recommendations": [{"time": at(20).timestamp(), "replicas": 4}]},
            {"generation": 2, "syncedGeneration": 2},
            1,
            "scale",
        ),
        ("at max holds", 4, 0.9, {}, {"generation": 1, "syncedGeneration": 1}, None, "limit"),
    ],
)
def test_evaluate(
    case: str,
    replicas: int,
    signal: float | None,
    auto: dict[str, Any],
    rollout: dict[str, int],
    want: int | None,
    cause: str,
) -> None:
    ev = autoscaler.evaluate(parsed(replicas), auto, rollout, signal, at(60), read_error="refused")
    assert ev.decision.cause == cause, (case, ev.message)
    assert ev.replicas == want, case
    assert ev.status["lastEvaluationTime"] == "2025-01-01T12:01:00.000000Z"
    assert ev.status["desiredReplicas"] == (want if want is not None else replicas)
    assert ev.status["recommendations"][-1] == {
        "time": at(60).timestamp(),
        "replicas": ev.decision.recommendation,
    }
    if want is None:
        assert ev.event_reason is None
    else:
        assert ev.event_reason == ("AutoscaledUp" if want > replicas else "AutoscaledDown")
        assert f"{replicas} -> {want}" in ev.message
    if cause == "no_data":
        assert "refused" in ev.status["reason"] and ev.status["signal"] is None


def test_history_in_status_drops_entries_outside_the_window() -> None:
    old = {
        "recommendations": [
            {"time": at(0).timestamp(), "replicas": 4},
            {"time": at(45).timestamp(), "replicas": 3},
        ]
    }
    ev = autoscaler.evaluate(parsed(3), old, {"generation": 1, "syncedGeneration": 1}, 0.2, at(60))
    # at(0) left the 30 s window; at(45) is dominated by the equal, newer at(60).
    assert ev.status["recommendations"] == [{"time": at(60).timestamp(), "replicas": 3}]


# -- the executor's I/O ---------------------------------------------------------------------------


class ScaleKube:
    """A Running job and its pods in memory; records status writes, /scale writes and Events."""

    def __init__(self, body: dict[str, Any]) -> None:
        self.job = copy.deepcopy(body)
        self.log: list[str] = []

    def _bump(self) -> None:
        self.job["metadata"]["resourceVersion"] = str(int(self.job["metadata"]["resourceVersion"]) + 1)

    def get_job(self, namespace: str, name: str) -> dict[str, Any]:
        return copy.deepcopy(self.job)

    def list_pods(self, namespace: str, job: str) -> list[dict[str, Any]]:
        return []

    def create(self, obj: dict[str, Any]) -> bool:
        return True

    def merge_patch(self, obj: dict[str, Any], patch: dict[str, Any]) -> None:
        pass

    def delete(self, obj: dict[str, Any]) -> None:
        pass

    def patch_status(self, body: dict[str, Any], status: dict[str, Any]) -> dict[str, Any]:
        if body["metadata"]["resourceVersion"] != self.job["metadata"]["resourceVersion"]:
            raise kube.Conflict("stale")
        self.job["status"] = merge_patch(self.job.get("status") or {}, status)
        self._bump()
        self.log.append("status " + ",".join(sorted(status)))
        return copy.deepcopy(self.job)

    def patch_job_annotations(self, body: dict[str, Any], annotations: dict[str, str]) -> dict[str, Any]:
        if body["metadata"]["resourceVersion"] != self.job["metadata"]["resourceVersion"]:
            raise kube.Conflict("stale")
        self.job["metadata"] = merge_patch(self.job["metadata"], {"annotations": annotations})
        self._bump()
        return copy.deepcopy(self.job)

    def scale(self, body: dict[str, Any], replicas: int) -> dict[str, Any]:
        if body["metadata"]["resourceVersion"] != self.job["metadata"]["resourceVersion"]:
            raise kube.Conflict("stale")
        self.job["spec"]["roles"]["rollout"]["replicas"] = replicas
        self._bump()
        self.log.append(f"scale {replicas}")
        return {"spec": {"replicas": replicas}}

    def event(self, body: dict[str, Any], type_: str, reason: str, message: str, now: str) -> None:
        self.log.append(f"event {reason}")


def running(replicas: int = 2, **auto: Any) -> dict[str, Any]:
    status = {
        "phase": "Running",
        "rollout": {"desired": replicas, "generation": 1, "syncedGeneration": 1},
        "autoscaling": {"reshardedGeneration": 1},  # the first sync was seen long ago
    }
    return job(spec=spec(replicas, **auto), status=status)


def test_executor_writes_status_then_scale_then_event_and_counts() -> None:
    fake = ScaleKube(running(2))
    reads: list[str] = []

    def read(src: Any) -> tuple[float | None, str | None]:
        reads.append(src.url)
        return 0.4, None

    ex = Executor(fake, controller_metrics_url="http://127.0.0.1:1/{job}", read=read)  # type: ignore[arg-type]
    before = metrics.AUTOSCALE_DECISIONS.labels("up")._value.get()
    out = ex.reconcile("ns", "j", now=at(0))
    assert reads == ["http://127.0.0.1:1/j"]
    assert fake.log == ["status autoscaling", "scale 4", "event AutoscaledUp"]
    assert out.requeue_after == 0.0
    assert metrics.AUTOSCALE_DECISIONS.labels("up")._value.get() == before + 1
    auto = fake.job["status"]["autoscaling"]
    assert auto["desiredReplicas"] == 4 and auto["signal"] == 0.4

    # Not due again before periodSeconds: no read, and the pass asks to be woken when it is.
    fake.log.clear()
    out = ex.reconcile("ns", "j", now=at(2))
    assert reads == ["http://127.0.0.1:1/j"] and "scale" not in " ".join(fake.log)
    assert out.requeue_after is not None and out.requeue_after <= 3


def test_executor_stamps_the_reshard_between_evaluations() -> None:
    body = running(4)
    body["status"]["rollout"].update(generation=2, syncedGeneration=2)
    body["status"]["autoscaling"] = {"lastEvaluationTime": "2025-01-01T12:00:00Z", "reshardedGeneration": 1}
    fake = ScaleKube(body)
    ex = Executor(fake, read=lambda src: pytest.fail("not due"))  # type: ignore[arg-type]
    ex.reconcile("ns", "j", now=at(1))
    auto = fake.job["status"]["autoscaling"]
    assert auto["lastReshardTime"] == "2025-01-01T12:00:01.000000Z" and auto["reshardedGeneration"] == 2


def test_executor_leaves_disabled_jobs_alone() -> None:
    fake = ScaleKube(running(2, enabled=False))
    ex = Executor(fake, read=lambda src: pytest.fail("autoscaling is off"))  # type: ignore[arg-type]
    ex.reconcile("ns", "j", now=at(0))
    assert fake.job["status"]["autoscaling"] == {"reshardedGeneration": 1} and not any(
        e.startswith("scale") for e in fake.log
    )


def test_executor_refuses_a_prometheus_url_outside_the_allow_list() -> None:
    """The operator never queries a URL it was not allowed: the job's controller is scraped, the
    job says why (condition and one Event), and allowing the URL later lifts the refusal."""
    fake = ScaleKube(running(2, prometheus={"url": "http://10.0.0.1:9090"}))
    reads: list[Any] = []

    def read(src: Any) -> tuple[float | None, str | None]:
        reads.append(src)
        return 0.2, None

    ex = Executor(fake, read=read, prometheus_url_prefixes=["http://prom.monitoring:9090"])  # type: ignore[arg-type]
    ex.reconcile("ns", "j", now=at(0))
    assert [type(r).__name__ for r in reads] == ["ScrapeSource"]
    assert reads[0].url == "http://j-controller.j.ns.svc:8080/metrics"
    c = get_condition(fake.job["status"], "PrometheusRefused")
    assert c is not None and (c["status"], c["reason"]) == ("True", "URLNotAllowed")
    assert "'http://10.0.0.1:9090' is not allowed" in c["message"]
    assert fake.log.count("event PrometheusRefused") == 1

    # The next evaluation (the fake has no pods, so each pass also restarts the gang: put the job
    # back to Running, where the autoscaler runs): still refused, no second Event, the same condition.
    fake.job["status"]["phase"] = "Running"
    ex.reconcile("ns", "j", now=at(10))
    assert len(reads) == 2
    assert fake.log.count("event PrometheusRefused") == 1
    assert get_condition(fake.job["status"], "PrometheusRefused") == c

    # The operator now allows it: queried, and the condition turns False.
    ex.prometheus_url_prefixes = ("http://10.0.0.1:9090",)
    fake.job["status"]["phase"] = "Running"
    ex.reconcile("ns", "j", now=at(20))
    assert type(reads[-1]).__name__ == "PrometheusSource" and reads[-1].url == "http://10.0.0.1:9090"
    c = get_condition(fake.job["status"], "PrometheusRefused")
    assert c is not None and (c["status"], c["reason"]) == ("False", "URLAllowed")


def test_executor_writes_a_hold_decision_with_the_pass_in_one_status_write() -> None:
    """No /scale and no condition: the autoscaler's status rides on the pass's own write."""
    fake = ScaleKube(running(2))
    ex = Executor(fake, read=lambda src: (AUTO["target"], None))  # type: ignore[arg-type]
    ex.reconcile("ns", "j", now=at(0))
    writes = [e for e in fake.log if e.startswith("status")]
    assert len(writes) == 1 and "autoscaling" in writes[0] and "phase" in writes[0], fake.log
    auto = fake.job["status"]["autoscaling"]
    assert auto["lastEvaluationTime"] == "2025-01-01T12:00:00.000000Z" and "desiredReplicas" in auto
    assert not any(e.startswith("scale") for e in fake.log)
