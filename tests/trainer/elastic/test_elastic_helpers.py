"""The controller-side pieces of the elastic fleet that need no Ray: the built-in signal from a
step's metrics, and reassembling the replicas' outputs in prompt order."""

from __future__ import annotations

import pytest
import torch

from rlhf_trainer.fleet.leasing import keep_prompts, rollout_tensors
from rlhf_trainer.fleet.membership import step_signal


def test_step_signal_from_the_steps_timings():
    m = {"timing/rollout": 3.0, "timing/reward": 1.0, "timing/update": 6.0, "timing/step": 99.0}
    assert step_signal("rollout_wait_fraction", m) == pytest.approx(0.3)
    assert step_signal("tokens_per_second", {**m, "rollout/tokens": 50.0}) == pytest.approx(5.0)
    assert step_signal("tokens_per_second", {**m, "perf/tokens_per_second": 7.0}) == 7.0
    assert step_signal("queue_depth", {"rollout/queue_depth": 12.0}) == 12.0
    assert step_signal("rollout_wait_fraction", {}) is None
    assert step_signal("queue_depth", {}) is None


def _output(prompt_tokens: list[int], n: int, version: int) -> dict:
    """What `RolloutWorker.generate` returns for prompts of one token each, `n` samples per prompt."""
    rows = [t for t in prompt_tokens for _ in range(n)]
    b = len(rows)
    return {
        "prompt_ids": torch.tensor(rows).unsqueeze(1),
        "prompt_mask": torch.ones(b, 1, dtype=torch.long),
        "response_ids": torch.tensor(rows).unsqueeze(1) * 10,
        "response_mask": torch.ones(b, 1),
        "log_probs": torch.zeros(b, 1),
        "prompt_index": [i for i in range(len(prompt_tokens)) for _ in range(n)],
        "pad_token_id": 0,
        "finished": None,
        "policy_version": torch.full((b,), version),
    }


def test_rollout_tensors_restores_prompt_order():
    # prompts 0..4 (token = position + 100); replica A generated [3, 4], replica B [0, 1, 2]
    # (e.g. after a requeue), in that order of completion
    outputs = [_output([103, 104], 2, version=7), _output([100, 101, 102], 2, version=6)]
    batch, version = rollout_tensors(outputs, [[3, 4], [0, 1, 2]])
    assert batch.prompt_index == [0, 0, 1, 1, 2, 2, 3, 3, 4, 4]
    assert batch.prompt_ids.squeeze(1).tolist() == [100, 100, 101, 101, 102, 102, 103, 103, 104, 104]
    assert batch.response_ids.squeeze(1).tolist() == [t * 10 for t in batch.prompt_ids.squeeze(1).tolist()]
    assert version.tolist() == [6] * 6 + [7] * 4


def test_keep_prompts_drops_the_rows_of_refused_leases():
    out = keep_prompts(_output([100, 101, 102], 2, version=3), keep=[0, 2])
    assert out["prompt_index"] == [0, 0, 2, 2]
    assert out["prompt_ids"].squeeze(1).tolist() == [100, 100, 102, 102]
    assert out["policy_version"].tolist() == [3, 3, 3, 3]
    batch, _ = rollout_tensors([out], [[7, 8, 9]])
    assert batch.prompt_index == [7, 7, 9, 9]


def test_the_policy_and_the_log_use_one_rate_formula():
    from rlhf_trainer.metrics import step_rates

    m = {"timing/rollout": 3.0, "timing/update": 7.0, "rollout/samples": 20.0, "rollout/tokens": 40.0}
    rates = step_rates(m)
    assert rates == {
        "perf/samples_per_second": 2.0,
        "perf/tokens_per_second": 4.0,
        "rollout/wait_fraction": 0.3,
    }
    assert step_signal("rollout_wait_fraction", m) == rates["rollout/wait_fraction"]
    assert step_rates({**m, "timing/step": 10.0}) == rates  # the step total is not a phase
    assert step_rates({**m, "timing/eval": 5.0}) == rates  # nor the evaluation: not training throughput
    assert step_rates({}) == {}
