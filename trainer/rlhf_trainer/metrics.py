"""Step metrics: Prometheus series, the `/metrics` + `/healthz` endpoint, and the JSONL log.

The controller produces one flat dict per step (`"reward/mean"`, `"actor/pg_clipfrac"`,
`"timing/rollout"`, ...). `StepMetrics.record(step, metrics)` maps it onto `rlhf_*` series in a
private `CollectorRegistry` (see `SERIES` for which keys feed which series); every other numeric
key is exported as `rlhf_metric{key="..."}` so nothing is lost. `JsonlLogger` appends the same
dict to `<run_dir>/metrics.jsonl`, which `rlhf_trainer.report` turns into plots.
"""

from __future__ import annotations

import json
import math
import threading
import time
from collections.abc import Callable, Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, TextIO

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

from rlhf_api import contract

PREFIX = "rlhf_"

#: Gauge name (without prefix) -> (help, flat metric keys that set it, first present wins).
SERIES: dict[str, tuple[str, tuple[str, ...]]] = {
    "reward_mean": ("Mean reward of the step's valid samples.", ("reward/mean",)),
    "reward_std": ("Standard deviation of the step's rewards.", ("reward/std",)),
    "kl": ("KL divergence of the policy from the reference.", ("actor/kl", "kl/mean", "kl/value", "kl")),
    "entropy": ("Mean token entropy of the policy.", ("actor/entropy",)),
    "clip_fraction": (
        "Fraction of tokens whose ratio was clipped.",
        ("actor/pg_clipfrac", "actor/clipfrac", "actor/clip_fraction"),
    ),
    "actor_loss": ("Policy loss of the last update.", ("actor/pg_loss", "actor/loss")),
    "critic_loss": ("Value loss of the last update.", ("critic/vf_loss", "critic/loss")),
    "rollout_wait_seconds": (
        "Seconds the step waited for rollouts.",
        ("rollout/wait_seconds", "timing/rollout_wait"),
    ),
    "rollout_wait_fraction": (
        "Fraction of step time spent waiting for rollouts (the default autoscaling signal).",
        ("rollout/wait_fraction",),
    ),
    "tokens_per_second": ("Generated tokens per second over the step.", ("perf/tokens_per_second",)),
    "samples_per_second": ("Responses per second over the step.", ("perf/samples_per_second",)),
    "policy_version": (
        "Version of the policy weights (bumped by each update).",
        ("policy_version", "actor/policy_version"),
    ),
    "total_steps": ("Steps this run will train.", ("total_steps",)),
    "eval_reward_mean": (
        "Mean reward of the last evaluation (spec.eval): its greedy responses, else its sampled ones.",
        ("eval/reward_mean",),
    ),
    "eval_step": ("Training steps done when the last evaluation ran.", ("eval/step",)),
    "rollout_staleness": (
        "Mean policy versions a trained sample's generating policy is behind the trained one "
        "(asynchronous rollouts, spec.rollout.maxStaleness; 0 when synchronous).",
        ("offpolicy/staleness_mean",),
    ),
    "rollout_replicas": ("Rollout engines currently serving.", ("rollout/replicas",)),
    "queue_depth": ("Prompts queued for rollout.", ("rollout/queue_depth",)),
    "weight_sync_seconds": (
        "Seconds of the last weight sync to the rollout engines.",
        ("timing/weight_sync", "sync/seconds"),
    ),
}
#: Flat key holding the cumulative prompts consumed (the counter follows it).
PROMPTS_CONSUMED_KEY = "data/prompts_consumed"
#: Flat key holding the number of reward errors in this step (added to the counter).
REWARD_ERRORS_KEY = "reward/errors"
#: Keys `timing/<phase>` feed `rlhf_step_seconds{phase="<phase>"}`.
TIMING_PREFIX = "timing/"
#: Timings that are not part of the training throughput (`step_rates`).
UNRATED_TIMINGS = ("timing/step", "timing/eval")
STEP_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)


def step_rates(metrics: Mapping[str, float]) -> dict[str, float]:
    """Rates of a step from its `timing/*` phases recorded so far (`timing/step` and the
    evaluation's `timing/eval` excluded: they measure training): samples/s, tokens/s and the
    fraction of time spent waiting for rollouts. The controller logs them over the whole step;
    the local autoscaler reads them at the step boundary, before the weight sync is timed. Empty
    while nothing is timed."""
    seconds = sum(v for k, v in metrics.items() if k.startswith("timing/") and k not in UNRATED_TIMINGS)
    if seconds <= 0:
        return {}
    return {
        "perf/samples_per_second": metrics.get("rollout/samples", 0.0) / seconds,
        "perf/tokens_per_second": metrics.get("rollout/tokens", 0.0) / seconds,
        "rollout/wait_fraction": metrics.get("timing/rollout", 0.0) / seconds,
    }


def _number(value: Any) -> float | None:
    """A finite float for numbers and 0-d tensors/arrays; None for anything else."""
    if isinstance(value, bool):
        return float(value)
    if hasattr(value, "item") and getattr(value, "ndim", 0) == 0:
        value = value.item()
    if isinstance(value, (int, float)):
        f = float(value)
        return f if math.isfinite(f) else None
    return None


class StepMetrics:
    """The trainer's Prometheus series in a private registry (several runs in one process don't clash)."""

    def __init__(self, job: str | None = None):
        self.registry = CollectorRegistry(auto_describe=True)
        self.gauges: dict[str, Gauge] = {
            name: Gauge(PREFIX + name, doc, registry=self.registry) for name, (doc, _) in SERIES.items()
        }
        self.step = Gauge(PREFIX + "step", "Last completed training step.", registry=self.registry)
        self.step_seconds = Histogram(
            PREFIX + "step_seconds",
            "Seconds per step phase (rollout, reward, reference, critic, advantage, update, weight_sync, eval, step).",
            ["phase"],
            buckets=STEP_BUCKETS,
            registry=self.registry,
        )
        self.last_phase_seconds = Gauge(
            PREFIX + "last_step_phase_seconds",
            "Seconds of each phase in the last step.",
            ["phase"],
            registry=self.registry,
        )
        self.prompts_consumed = Counter(
            PREFIX + "prompts_consumed", "Prompts taken from the dataset.", registry=self.registry
        )
        self.reward_errors = Counter(
            PREFIX + "reward_errors",
            "Samples a reward failed on (raised, NaN or inf).",
            registry=self.registry,
        )
        self.other = Gauge(
            PREFIX + "metric", "Any other numeric step metric, by its key.", ["key"], registry=self.registry
        )
        self._consumed_seen = 0.0
        if job:
            Gauge(
                PREFIX + "job_info", "The job this controller runs.", ["job"], registry=self.registry
            ).labels(job).set(1)

    def record(self, step: int, metrics: Mapping[str, Any]) -> None:
        """Map one step's flat metric dict onto the series (non-numeric values are ignored)."""
        self.step.set(step)
        used: set[str] = set()
        for name, (_, keys) in SERIES.items():
            for key in keys:
                if key in metrics and (v := _number(metrics[key])) is not None:
                    self.gauges[name].set(v)
                    used.update(keys)
                    break
        for key, value in metrics.items():
            v = _number(value)
            if v is None:
                continue
            if key.startswith(TIMING_PREFIX):
                phase = key[len(TIMING_PREFIX) :]
                self.step_seconds.labels(phase).observe(v)
                self.last_phase_seconds.labels(phase).set(v)
            elif key == PROMPTS_CONSUMED_KEY:
                if v > self._consumed_seen:
                    self.prompts_consumed.inc(v - self._consumed_seen)
                    self._consumed_seen = v
            elif key == REWARD_ERRORS_KEY:
                if v > 0:
                    self.reward_errors.inc(v)
            elif key not in used and key != "step":
                self.other.labels(key).set(v)

    def set(self, name: str, value: float) -> None:
        """Set one gauge of `SERIES` directly (e.g. `rollout_replicas` after a reshard)."""
        if name not in self.gauges:
            raise KeyError(f"unknown series {name!r}; valid: {', '.join(sorted(self.gauges))}")
        self.gauges[name].set(value)

    def exposition(self) -> bytes:
        """The Prometheus text format of every series."""
        return generate_latest(self.registry)


class MetricsServer:
    """Serves `/metrics` (Prometheus text format) and `/healthz` on a background thread.

    The socket is bound in the constructor; `port` is the bound port (useful with `port=0`).
    `host` is `127.0.0.1` locally and `0.0.0.0` in a pod. `health` may return False (or raise) to
    make `/healthz` answer 503.
    """

    def __init__(
        self,
        port: int = 0,
        host: str = "127.0.0.1",
        metrics: StepMetrics | CollectorRegistry | None = None,
        health: Callable[[], bool] | None = None,
    ):
        if metrics is None:
            metrics = StepMetrics()
        self.metrics = metrics
        registry = metrics.registry if isinstance(metrics, StepMetrics) else metrics
        check = health or (lambda: True)

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server's naming
                path = self.path.split("?", 1)[0]
                if path == contract.METRICS_PATH:
                    self._send(200, generate_latest(registry), CONTENT_TYPE_LATEST)
                elif path == contract.HEALTHZ_PATH:
                    try:
                        ok = bool(check())
                    except Exception:  # noqa: BLE001 - a failing check is an unhealthy answer
                        ok = False
                    self._send(200 if ok else 503, b"ok\n" if ok else b"unhealthy\n", "text/plain")
                else:
                    self._send(404, b"not found; try /metrics or /healthz\n", "text/plain")

            def _send(self, code: int, body: bytes, ctype: str) -> None:
                self.send_response(code)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - silence per-request logs
                pass

        self._server = ThreadingHTTPServer((host, port), Handler)
        self._server.daemon_threads = True
        self.host = host
        self.port: int = int(self._server.server_address[1])
        self._thread = threading.Thread(target=self._server.serve_forever, name="rlhf-metrics", daemon=True)
        self._thread.start()

    def start(self) -> int:
        """Already serving since construction; returns the bound port."""
        return self.port

    @property
    def url(self) -> str:
        host = "127.0.0.1" if self.host in ("0.0.0.0", "") else self.host
        return f"http://{host}:{self.port}"

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)

    def __enter__(self) -> MetricsServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def to_jsonable(value: Any) -> Any:
    """Tensors, numpy values and non-finite floats made JSON-safe (NaN and inf become null)."""
    if hasattr(value, "tolist") and not isinstance(value, (str, bytes)):
        value = value.tolist()
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, Mapping):
        return {str(k): to_jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_jsonable(v) for v in value]
    return value


#: Marks the metrics log's record of the evaluation before the first step (`eval.beforeTraining`):
#: written at step 0 with `eval/step` 0 and the `eval/*` keys; every record without it is a step's.
BEFORE_TRAINING = "before_training"


def step_records(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The records of training steps in a metrics log (the before-training evaluation's left out)."""
    return [r for r in records if not r.get(BEFORE_TRAINING)]


class JsonlLogger:
    """Appends one JSON object per step to a file, flushed line by line (a crash loses at most one;
    `read_jsonl` skips a line cut short)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fh: TextIO | None = self.path.open("a", encoding="utf-8")
        if _last_byte(self.path) not in (b"", b"\n"):
            # A previous process died mid-line: end that line so the next record stays parseable.
            self._fh.write("\n")
            self._fh.flush()

    def log(self, metrics: Mapping[str, Any], step: int | None = None) -> None:
        record: dict[str, Any] = {}
        if step is not None:
            record["step"] = step
        record.update(to_jsonable(dict(metrics)))
        record.setdefault("time", time.time())
        if self._fh is None:
            raise ValueError(f"JsonlLogger({str(self.path)!r}) is closed")
        self._fh.write(json.dumps(record) + "\n")
        self._fh.flush()

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None

    def __enter__(self) -> JsonlLogger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _last_byte(path: Path) -> bytes:
    with path.open("rb") as fh:
        if fh.seek(0, 2) == 0:
            return b""
        fh.seek(-1, 2)
        return fh.read(1)


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    """Records of a metrics.jsonl; a truncated last line (killed mid-write) is ignored."""
    out = []
    with Path(path).open(encoding="utf-8") as fh:
        for line in fh:
            line = line.strip()
            if not line:
                continue
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return out
