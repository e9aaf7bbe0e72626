"""The evaluation phase's pure parts (`dataflow.phases`): its modes, its reward statistics
(against a plain loop), the rows of the sample log; and when the controller evaluates."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from rlhf_api.sections import EvalSpec
from rlhf_trainer.controller import due
from rlhf_trainer.dataflow import StepBatch
from rlhf_trainer.dataflow.phases import eval_modes, eval_summary, sample_rows, spread_rows
from rlhf_trainer.metrics import JsonlLogger, read_jsonl
from rlhf_trainer.startup import truncate_logs


def _reference(scores: list[float], valid: list[bool], group: list[int]) -> tuple[float, float]:
    """Mean over valid samples; mean over prompts of each prompt's best valid sample."""
    ok = [s for s, v in zip(scores, valid) if v]
    best: dict[int, float] = {}
    for s, v, g in zip(scores, valid, group):
        if v:
            best[g] = max(best.get(g, -math.inf), s)
    return sum(ok) / len(ok), sum(best.values()) / len(best)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("prompts,n", [(1, 1), (5, 1), (4, 3), (7, 8)])
def test_eval_summary_matches_a_plain_loop(seed: int, prompts: int, n: int) -> None:
    g = torch.Generator().manual_seed(seed)
    group = torch.arange(prompts).repeat_interleave(n)  # (B,)
    group = group[torch.randperm(len(group), generator=g)]  # any order
    scores = torch.randn(len(group), generator=g)
    valid = torch.rand(len(group), generator=g) > 0.2
    valid[0] = True
    lengths = torch.randint(1, 9, (len(group),), generator=g)
    got = eval_summary(scores, valid, group, lengths)
    mean, best = _reference(scores.tolist(), valid.tolist(), group.tolist())
    assert got["reward_mean"] == pytest.approx(mean, abs=1e-6)
    assert got["best_of_n"] == pytest.approx(best, abs=1e-6)
    assert got["reward_invalid"] == float((~valid).sum())
    assert got["reward_max"] == pytest.approx(float(scores[valid].max()))
    assert got["response_length"] == pytest.approx(float(lengths.float().mean()))
    assert got["samples"] == float(len(group))
    if n == 1:  # one sample per prompt: the best is the sample
        assert got["best_of_n"] == pytest.approx(got["reward_mean"], abs=1e-6)


def test_eval_summary_without_a_valid_sample_is_nan_not_zero() -> None:
    got = eval_summary(torch.zeros(3), torch.zeros(3, dtype=torch.bool), torch.arange(3), torch.ones(3))
    assert math.isnan(got["reward_mean"]) and math.isnan(got["best_of_n"])
    assert got["reward_invalid"] == 3.0


def test_eval_modes_headline_first() -> None:
    assert eval_modes(EvalSpec(path="e")) == [("greedy", 1, True)]
    assert eval_modes(EvalSpec(path="e", samples=4)) == [("greedy", 1, True), ("sampled", 4, False)]
    assert eval_modes(EvalSpec(path="e", greedy=False, samples=2)) == [("sampled", 2, False)]


def test_spread_rows() -> None:
    assert spread_rows(10, 0) == [] and spread_rows(0, 4) == []
    assert spread_rows(3, 5) == [0, 1, 2]
    assert spread_rows(10, 1) == [0]
    assert spread_rows(10, 4) == [0, 3, 6, 9]
    assert spread_rows(16, 4) == [0, 5, 10, 15]


def test_sample_rows_hold_prompt_response_and_reward() -> None:
    batch = StepBatch(
        tensors={
            "response_mask": torch.ones(4, 2),
            "scores": torch.tensor([0.0, 1.0, 0.0, 0.5]),
            "reward_valid": torch.tensor([True, True, False, True]),
        },
        prompts=["p0", "p1", "p2", "p3"],
        responses=["r0", "r1", "r2", "r3"],
    )
    rows = sample_rows(batch, 4, 7, "train")
    assert [(r["prompt"], r["response"], r["reward"]) for r in rows] == [
        ("p0", "r0", 0.0),
        ("p1", "r1", 1.0),
        ("p2", "r2", None),  # its reward failed: no number
        ("p3", "r3", 0.5),
    ]
    assert {(r["step"], r["split"]) for r in rows} == {(7, "train")}
    assert [r["prompt"] for r in sample_rows(batch, 2, 7, "train")] == ["p0", "p3"]
    assert sample_rows(batch, 0, 7, "train") == [] and sample_rows(None, 4, 7, "train") == []


@pytest.mark.parametrize(
    "every,total,expected",
    [(0, 5, [5]), (2, 5, [2, 4, 5]), (1, 3, [1, 2, 3]), (10, 4, [4])],
)
def test_due_every_n_steps_and_at_the_last(every: int, total: int, expected: list[int]) -> None:
    assert [d for d in range(1, total + 1) if due(d, every, total)] == expected


def test_resume_cuts_the_sample_log_back_with_the_metrics_log(tmp_path: Path) -> None:
    for name in ("metrics.jsonl", "samples.jsonl"):
        with JsonlLogger(tmp_path / name) as log:
            for step in range(4):
                log.log({"x": step}, step=step)
    truncate_logs(tmp_path, 2)
    for name in ("metrics.jsonl", "samples.jsonl"):
        assert [r["step"] for r in read_jsonl(tmp_path / name)] == [0, 1]
