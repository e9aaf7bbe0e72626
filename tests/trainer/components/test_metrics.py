"""StepMetrics -> Prometheus series, the /metrics and /healthz endpoint over real HTTP, JsonlLogger."""

from __future__ import annotations

import json
import math
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch

from rlhf_trainer.metrics import JsonlLogger, MetricsServer, StepMetrics, read_jsonl

STEP = {
    "reward/mean": 0.25,
    "reward/std": 0.5,
    "actor/kl": 0.01,
    "actor/entropy": torch.tensor(2.5),
    "actor/pg_clipfrac": 0.1,
    "actor/pg_loss": -0.3,
    "critic/vf_loss": 1.5,
    "timing/rollout": 1.2,
    "timing/update": 0.4,
    "timing/step": 2.0,
    "rollout/wait_seconds": 1.1,
    "rollout/wait_fraction": 0.55,
    "perf/tokens_per_second": 300.0,
    "perf/samples_per_second": 64.0,
    "policy_version": 3,
    "total_steps": 60,
    "data/prompts_consumed": 16,
    "reward/errors": 2,
    "rollout/replicas": 2,
    "rollout/queue_depth": 5,
    "timing/weight_sync": 0.05,
    "actor/grad_norm": 0.7,
    "reward/scores": [0.0, 1.0],
}


def _value(text: str, series: str) -> float:
    for line in text.splitlines():
        if line.startswith(series + " "):
            return float(line.split()[-1])
    raise AssertionError(f"{series} not in the exposition:\n{text}")


def test_record_maps_flat_keys_to_series() -> None:
    m = StepMetrics(job="quickstart")
    m.record(3, STEP)
    m.record(4, {**STEP, "data/prompts_consumed": 32, "reward/errors": 1})
    text = m.exposition().decode()
    expected = {
        "rlhf_step": 4,
        "rlhf_reward_mean": 0.25,
        "rlhf_reward_std": 0.5,
        "rlhf_kl": 0.01,
        "rlhf_entropy": 2.5,
        "rlhf_clip_fraction": 0.1,
        "rlhf_actor_loss": -0.3,
        "rlhf_critic_loss": 1.5,
        "rlhf_rollout_wait_seconds": 1.1,
        "rlhf_rollout_wait_fraction": 0.55,
        "rlhf_tokens_per_second": 300,
        "rlhf_samples_per_second": 64,
        "rlhf_policy_version": 3,
        "rlhf_total_steps": 60,
        "rlhf_rollout_replicas": 2,
        "rlhf_queue_depth": 5,
        "rlhf_weight_sync_seconds": 0.05,
        "rlhf_prompts_consumed_total": 32,  # follows the cumulative key
        "rlhf_reward_errors_total": 3,  # adds each step's count
        'rlhf_step_seconds_count{phase="rollout"}': 2,
        'rlhf_step_seconds_sum{phase="rollout"}': 2.4,
        'rlhf_last_step_phase_seconds{phase="update"}': 0.4,
        'rlhf_metric{key="actor/grad_norm"}': 0.7,
        'rlhf_job_info{job="quickstart"}': 1,
    }
    for series, value in expected.items():
        assert _value(text, series) == pytest.approx(value), series
    assert "reward/scores" not in text  # lists are not series


def test_staleness_of_asynchronous_rollouts_has_its_gauge() -> None:
    m = StepMetrics(job="quickstart")
    m.record(5, {**STEP, "offpolicy/staleness_mean": 1.0, "offpolicy/dropped": 2.0})
    text = m.exposition().decode()
    assert _value(text, "rlhf_rollout_staleness") == 1.0
    assert _value(text, 'rlhf_metric{key="offpolicy/dropped"}') == 2.0


def test_the_last_evaluation_stays_on_the_gauge_between_evaluations() -> None:
    m = StepMetrics(job="quickstart")
    m.record(9, {**STEP, "eval/reward_mean": 0.625, "eval/step": 10.0, "eval/greedy/reward_mean": 0.625})
    m.record(10, STEP)  # a step without an evaluation
    text = m.exposition().decode()
    assert _value(text, "rlhf_eval_reward_mean") == 0.625
    assert _value(text, "rlhf_eval_step") == 10.0
    assert _value(text, 'rlhf_metric{key="eval/greedy/reward_mean"}') == 0.625


def test_non_finite_values_leave_the_gauge_alone() -> None:
    m = StepMetrics()
    m.record(1, {"reward/mean": 0.5})
    m.record(2, {"reward/mean": math.nan})
    assert _value(m.exposition().decode(), "rlhf_reward_mean") == 0.5
    m.set("rollout_replicas", 4)
    assert _value(m.exposition().decode(), "rlhf_rollout_replicas") == 4
    with pytest.raises(KeyError, match="valid:"):
        m.set("nope", 1)


def test_two_registries_do_not_clash() -> None:
    a, b = StepMetrics(), StepMetrics()
    a.record(1, {"reward/mean": 1.0})
    assert _value(b.exposition().decode(), "rlhf_reward_mean") == 0.0


def test_server_scrape_and_healthz_over_http() -> None:
    metrics = StepMetrics()
    metrics.record(7, STEP)
    healthy = [True]
    with MetricsServer(port=0, metrics=metrics, health=lambda: healthy[0]) as server:
        assert server.port > 0 and server.start() == server.port
        with urllib.request.urlopen(f"{server.url}/metrics", timeout=5) as resp:
            body = resp.read().decode()
            assert resp.status == 200 and resp.headers["Content-Type"].startswith("text/plain")
        assert _value(body, "rlhf_step") == 7 and _value(body, "rlhf_reward_mean") == 0.25
        with urllib.request.urlopen(f"{server.url}/healthz", timeout=5) as resp:
            assert resp.status == 200 and resp.read() == b"ok\n"
        healthy[0] = False
        with pytest.raises(urllib.error.HTTPError) as exc:
            urllib.request.urlopen(f"{server.url}/healthz", timeout=5)
        assert exc.value.code == 503
        with pytest.raises(urllib.error.HTTPError) as exc:
            urllib.request.urlopen(f"{server.url}/other", timeout=5)
        assert exc.value.code == 404


def test_server_binds_all_interfaces_when_asked() -> None:
    server = MetricsServer(port=0, host="0.0.0.0")
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/healthz", timeout=5) as resp:
            assert resp.status == 200
    finally:
        server.stop()


def test_jsonl_logger_appends_one_flushed_line_per_step(tmp_path: Path) -> None:
    path = tmp_path / "run" / "metrics.jsonl"
    log = JsonlLogger(path)
    log.log(
        {"reward/mean": torch.tensor(0.5), "reward/scores": torch.tensor([1.0, 0.0]), "kl": math.nan}, step=1
    )
    # flushed: readable before close
    (first,) = [json.loads(line) for line in path.read_text().splitlines()]
    assert first["step"] == 1 and first["reward/mean"] == 0.5 and first["reward/scores"] == [1.0, 0.0]
    assert first["kl"] is None and "time" in first
    log.log({"reward/mean": 0.75}, step=2)
    log.close()
    with path.open("a") as fh:
        fh.write('{"step": 3, "reward/me')  # a line cut by a crash
    assert [r["step"] for r in read_jsonl(path)] == [1, 2]
    with JsonlLogger(path) as again:  # appends, never truncates
        again.log({"step": 4})
    assert [r["step"] for r in read_jsonl(path)] == [1, 2, 4]
    with pytest.raises(ValueError, match="closed"):
        log.log({})
