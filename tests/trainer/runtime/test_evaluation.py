"""Evaluation (`spec.eval`), the sample log and the trackers on the tiny model.

In-process (real actor and reward workers, no Ray): the evaluation phase answers every prompt
greedily as an independent greedy decode does, scores with the evaluation's own rewards, and
groups the sampled answers by prompt across its chunks. End to end (Ray, slow): the numbers
reach the metrics log, the sample log, /metrics, status.progress, the report and TensorBoard.
"""

from __future__ import annotations

import json
import math
import urllib.request
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest
import torch

from .conftest import PROMPTS, make_job, read_metrics
from .test_remax_baseline import InProcessGroup

LENGTH_REWARD = "rlhf_trainer.rewards.builtin:response_length"


def _distinct_prompts(path: Path, n: int) -> Path:
    """The first `n` rows of the session's prompt file with distinct prompts (the sample log
    groups answers by prompt text)."""
    rows: dict[str, dict[str, Any]] = {}
    for line in PROMPTS.read_text().splitlines():
        row = json.loads(line)
        rows.setdefault(row["prompt"], row)
        if len(rows) == n:
            break
    path.write_text("".join(json.dumps(r) + "\n" for r in rows.values()))
    return path


def test_evaluation_phase_with_its_own_rewards(tiny_model: Path, tmp_path: Path) -> None:
    from rlhf_trainer.algorithms import build_algorithm
    from rlhf_trainer.dataflow import TrainerContext, phases
    from rlhf_trainer.rewards.builtin import response_length
    from rlhf_trainer.rollout import decode_responses
    from rlhf_trainer.rollout.hf import HFRolloutEngine
    from rlhf_trainer.startup import load_eval_prompts, load_prompts, load_tokenizer
    from rlhf_trainer.workers import ActorWorker, RewardWorker

    eval_file = _distinct_prompts(tmp_path / "eval.jsonl", 12)
    job = make_job(
        "eval-phase",
        eval={"path": str(eval_file), "maxPrompts": 10, "samples": 3, "rewards": [{"path": LENGTH_REWARD}]},
        rollout={"samplesPerPrompt": 2, "maxNewTokens": 4},
        training={"steps": 1, "promptsPerStep": 3},  # 6 responses per step: greedy in 2 chunks, sampled in 5
    )
    spec = job.spec
    tokenizer = load_tokenizer(spec)
    ctx = TrainerContext(
        spec, "eval-phase", tmp_path, tokenizer, load_prompts(spec, tokenizer), build_algorithm("grpo")
    )
    ctx.eval_prompts = load_eval_prompts(spec, tokenizer)
    file_rows = [json.loads(line) for line in eval_file.read_text().splitlines()]
    assert [p.text for p in ctx.eval_prompts] == [r["prompt"] for r in file_rows[:10]]  # file order
    actor, reward = ActorWorker(spec, colocated=True), RewardWorker(spec)
    actor.setup()
    reward.setup()
    ctx.actor, ctx.reward = InProcessGroup([actor]), InProcessGroup([reward])  # type: ignore[assignment]

    metrics, batches = phases.evaluate(ctx, ctx.eval_prompts)

    # greedy: the independent greedy decode of each chunk, scored by the evaluation's reward
    engine = HFRolloutEngine(actor.model, tokenizer, max_new_tokens=4, temperature=0.0)
    texts = []
    for chunk in (ctx.eval_prompts[:6], ctx.eval_prompts[6:]):
        texts += decode_responses(engine.generate([p.ids for p in chunk], n=1), tokenizer)
    greedy = batches["greedy"]
    assert greedy.responses == texts
    expected = response_length([p.text for p in ctx.eval_prompts], texts)
    assert metrics["eval/greedy/reward_mean"] == pytest.approx(sum(expected) / 10, abs=1e-5)
    assert metrics["eval/reward_mean"] == metrics["eval/greedy/reward_mean"]
    assert metrics["eval/greedy/samples"] == 10.0 and metrics["eval/prompts"] == 10.0

    # sampled: 3 answers per prompt, grouped by prompt across the chunks
    sampled = batches["sampled"]
    assert torch.bincount(sampled["group_index"]).tolist() == [3] * 10
    for g, prompt in enumerate(ctx.eval_prompts):
        rows = (sampled["group_index"] == g).nonzero().squeeze(-1).tolist()
        assert {sampled.prompts[i] for i in rows} == {prompt.text}
    best: dict[int, float] = {}
    for g, s in zip(sampled["group_index"].tolist(), sampled["scores"].tolist()):
        best[g] = max(best.get(g, -math.inf), s)
    assert metrics["eval/sampled/best_of_n"] == pytest.approx(sum(best.values()) / 10, abs=1e-5)
    assert metrics["eval/sampled/best_of_n"] >= metrics["eval/sampled/reward_mean"]
    assert ctx.dataset.consumed == 0  # the training prompts' position is untouched

    with pytest.raises(ValueError, match="unknown reward set 'nope'; valid: job, eval"):
        reward.score(["p"], ["r"], [{}], None, "nope")


def _scrape(run_dir: Path) -> dict[str, float]:
    port = int((run_dir / "metrics_port").read_text())
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return {
        line.split()[0]: float(line.split()[-1])
        for line in text.splitlines()
        if line.startswith("rlhf_eval") or line.startswith('rlhf_metric{key="eval/')
    }


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_evaluation_reaches_the_log_metrics_status_report_and_tensorboard(
    tiny_model: Path, ray_session: None, tmp_path: Path
) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from rlhf_trainer.controller import run
    from rlhf_trainer.metrics import read_jsonl
    from rlhf_trainer.run_cli import StatusReporter

    eval_file = _distinct_prompts(tmp_path / "eval.jsonl", 6)
    job = make_job(
        "eval-e2e",
        eval={"path": str(eval_file), "every": 2, "samples": 2},
        training={"steps": 3, "promptsPerStep": 4, "microBatchSize": 16, "learningRate": 1e-3},
        output={"progress": False, "report": True, "samplesPerStep": 50, "trackers": {"tensorboard": True}},
    )
    run_dir = tmp_path / "run"
    scraped: dict[int, dict[str, float]] = {}
    patches: dict[int, dict[str, Any]] = {}
    reporter = StatusReporter(api=None, name="eval-e2e", namespace="default")

    def on_status(done: int, total: int, metrics: dict[str, float], checkpoint_step: int | None) -> None:
        scraped[done] = _scrape(run_dir)
        patches[done] = reporter.progress(done, total, metrics, checkpoint_step)["status"]["progress"]

    run(job, run_dir=run_dir, on_status=on_status)

    # the metrics log: evaluations after steps 2 (every: 2) and 3 (the last), none after step 1
    records = read_metrics(run_dir)
    assert [r["step"] for r in records] == [0, 1, 2]
    assert "eval/reward_mean" not in records[0]
    evaluated = records[1:]
    for done, r in zip((2, 3), evaluated):
        assert r["eval/step"] == done and r["timing/eval"] > 0
        assert r["eval/greedy/samples"] == 6 and r["eval/sampled/samples"] == 12
        assert r["eval/reward_mean"] == r["eval/greedy/reward_mean"]
        assert 0.0 <= r["eval/sampled/reward_mean"] <= r["eval/sampled/best_of_n"] <= 1.0

    # the sample log: train rows every step; every eval row (samplesPerStep 50 > 12)
    samples = read_jsonl(run_dir / "samples.jsonl")
    by_split: dict[tuple[int, str], list[dict[str, Any]]] = defaultdict(list)
    for row in samples:
        by_split[(row["step"], row["split"])].append(row)
    assert sorted(by_split) == [
        (0, "train"),
        (1, "eval/greedy"),
        (1, "eval/sampled"),
        (1, "train"),
        (2, "eval/greedy"),
        (2, "eval/sampled"),
        (2, "train"),
    ]
    assert all(len(by_split[(s, "train")]) == 16 for s in (0, 1, 2))
    for step, r in zip((1, 2), evaluated):
        greedy = by_split[(step, "eval/greedy")]
        assert len(greedy) == 6
        assert sum(x["reward"] for x in greedy) / 6 == pytest.approx(r["eval/greedy/reward_mean"], abs=1e-6)
        best: dict[str, float] = {}
        for x in by_split[(step, "eval/sampled")]:
            best[x["prompt"]] = max(best.get(x["prompt"], -math.inf), x["reward"])
        assert len(best) == 6
        assert sum(best.values()) / 6 == pytest.approx(r["eval/sampled/best_of_n"], abs=1e-6)

    # /metrics while the run was on: the gauge holds the last evaluation between evaluations
    assert scraped[1]["rlhf_eval_step"] == 0.0  # no evaluation yet
    assert scraped[2]["rlhf_eval_reward_mean"] == pytest.approx(evaluated[0]["eval/reward_mean"])
    assert scraped[3]["rlhf_eval_reward_mean"] == pytest.approx(evaluated[1]["eval/reward_mean"])
    assert scraped[3]["rlhf_eval_step"] == 3.0
    assert scraped[3]['rlhf_metric{key="eval/sampled/best_of_n"}'] == pytest.approx(
        evaluated[1]["eval/sampled/best_of_n"]
    )

    # status.progress: written by the steps that evaluated
    assert "evalReward" not in patches[1]
    assert patches[2]["evalReward"] == pytest.approx(evaluated[0]["eval/reward_mean"])
    assert patches[3]["evalStep"] == 3
    assert patches[3]["metrics"]["eval_reward_mean"] == f"{evaluated[1]['eval/reward_mean']:.6g}"

    # the report
    page = (run_dir / "report.html").read_text()
    assert (run_dir / "eval.png").is_file() and "Evaluation reward" in page
    assert f"<th>last eval reward (step 2)</th><td>{evaluated[1]['eval/reward_mean']:.4g}</td>" in page
    assert "eval/greedy samples, step 2" in page and "train samples, step 2" in page

    # TensorBoard, read back with tensorboard's own reader
    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"reward/mean", "eval/reward_mean", "eval/sampled/best_of_n"} <= tags
    assert [e.step for e in events.Scalars("reward/mean")] == [0, 1, 2]
    assert [round(e.value, 5) for e in events.Scalars("reward/mean")] == [
        round(r["reward/mean"], 5) for r in records
    ]
    assert [(e.step, round(e.value, 5)) for e in events.Scalars("eval/reward_mean")] == [
        (s, round(r["eval/reward_mean"], 5)) for s, r in zip((1, 2), evaluated)
    ]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_evaluation_on_a_disaggregated_rollout_fleet(
    tiny_model: Path, ray_session: None, tmp_path: Path
) -> None:
    """The evaluation's prompts go through the fleet's queue like a step's; its own reward
    functions score them on the reward workers."""
    from rlhf_trainer.controller import run
    from rlhf_trainer.metrics import read_jsonl

    eval_file = _distinct_prompts(tmp_path / "eval.jsonl", 5)
    job = make_job(
        "eval-fleet",
        eval={"path": str(eval_file), "every": 0, "rewards": [{"path": LENGTH_REWARD}]},
        roles={"placement": "disaggregated", "rollout": {"replicas": 2, "maxReplicas": 2}},
        training={"steps": 1, "promptsPerStep": 4, "microBatchSize": 16},
    )
    run(job, run_dir=tmp_path / "run")
    (record,) = read_metrics(tmp_path / "run")
    assert record["eval/step"] == 1 and record["eval/greedy/samples"] == 5
    greedy = [r for r in read_jsonl(tmp_path / "run" / "samples.jsonl") if r["split"] == "eval/greedy"]
    assert len(greedy) == 4  # samplesPerStep's default, spread over the 5 answers
    for row in greedy:  # scored by response_length, not by the job's arithmetic reward
        assert row["reward"] == float(len(row["response"]))
    assert record["eval/reward_mean"] >= 0.0


@pytest.mark.parametrize(("eval_temperature", "sampled_at"), [(0.3, 0.3), (None, 1.7)])
def test_the_sampled_evaluation_samples_at_its_own_temperature(
    tiny_model: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    eval_temperature: Any,
    sampled_at: float,
) -> None:
    """`eval.temperature` reaches the hf engine's sampling (the temperature `sample_tokens` is
    called with) for the sampled responses; the greedy ones stay at 0; absent, the rollout's."""
    from rlhf_trainer.algorithms import build_algorithm
    from rlhf_trainer.dataflow import TrainerContext, phases
    from rlhf_trainer.rollout import hf
    from rlhf_trainer.startup import load_eval_prompts, load_prompts, load_tokenizer
    from rlhf_trainer.workers import ActorWorker, RewardWorker

    eval_file = _distinct_prompts(tmp_path / "eval.jsonl", 3)
    eval_spec: dict[str, Any] = {"path": str(eval_file), "samples": 2, "rewards": [{"path": LENGTH_REWARD}]}
    if eval_temperature is not None:
        eval_spec["temperature"] = eval_temperature
    job = make_job(
        "eval-temperature",
        eval=eval_spec,
        rollout={"samplesPerPrompt": 2, "maxNewTokens": 3, "temperature": 1.7},
        training={"steps": 1, "promptsPerStep": 3},
    )
    spec = job.spec
    tokenizer = load_tokenizer(spec)
    ctx = TrainerContext(
        spec, "eval-temperature", tmp_path, tokenizer, load_prompts(spec, tokenizer), build_algorithm("grpo")
    )
    ctx.eval_prompts = load_eval_prompts(spec, tokenizer)
    actor, reward = ActorWorker(spec, colocated=True), RewardWorker(spec)
    actor.setup()
    reward.setup()
    ctx.actor, ctx.reward = InProcessGroup([actor]), InProcessGroup([reward])  # type: ignore[assignment]

    seen: list[tuple[int, float]] = []  # (rows, temperature) of every sampling call of the engine
    real = hf.sample_tokens

    def spy(logits: torch.Tensor, temperature: float, *args: Any) -> Any:
        seen.append((logits.shape[0], temperature))
        return real(logits, temperature, *args)

    monkeypatch.setattr(hf, "sample_tokens", spy)
    phases.evaluate(ctx, ctx.eval_prompts)

    assert {t for rows, t in seen if rows == 3} == {0.0}  # greedy: one row per prompt
    assert {t for rows, t in seen if rows == 6} == {sampled_at}  # sampled: 2 rows per prompt
    seen.clear()
    phases.generate(ctx, ctx.eval_prompts[:1], n=2)  # a training rollout keeps the rollout's
    assert {t for _, t in seen} == {1.7}


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_evaluation_before_training_is_logged_once_and_not_again_on_resume(
    tiny_model: Path, ray_session: None, tmp_path: Path
) -> None:
    from rlhf_trainer.controller import run
    from rlhf_trainer.metrics import BEFORE_TRAINING, read_jsonl

    eval_file = _distinct_prompts(tmp_path / "eval.jsonl", 4)
    job = make_job(
        "eval-before",
        eval={"path": str(eval_file), "every": 0, "beforeTraining": True},
        training={"steps": 2, "promptsPerStep": 4, "microBatchSize": 16},
        checkpoint={"every": 1},
    )
    run_dir = tmp_path / "run"

    def before(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return [r for r in records if r.get(BEFORE_TRAINING)]

    summary = run(job, run_dir=run_dir)
    records = read_metrics(run_dir)
    (first,) = before(records)
    assert records[0] is first  # written before any step's record
    assert first["step"] == 0 and first["eval/step"] == 0.0 and first["timing/eval"] > 0
    assert first["eval/greedy/samples"] == 4.0 and "eval/reward_mean" in first
    assert "reward/mean" not in first  # no training in it
    assert [r["step"] for r in records[1:]] == [0, 1] and records[2]["eval/step"] == 2.0
    assert summary.steps == 2  # the evaluation record is not a step
    rows = [r for r in read_jsonl(run_dir / "samples.jsonl") if r["split"] == "eval/greedy"]
    assert sorted({r["step"] for r in rows}) == [0, 1]  # before training, and after the last step

    run(job, run_dir=run_dir, steps=3)  # resumes from step 2's checkpoint: no second evaluation at 0
    resumed = read_metrics(run_dir)
    assert before(resumed) == [first]
    assert [r["step"] for r in resumed if not r.get(BEFORE_TRAINING)] == [0, 1, 2]
