"""DAPO's recipe (overlong soft penalty, truncation masking, dynamic sampling's group filter) and
the rollout correction's importance weights, against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from rlhf_api.algorithm_params import GRPOParams
from rlhf_trainer.algorithms import build_algorithm
from rlhf_trainer.algorithms.dapo import groups_with_variance, overlong_penalty
from rlhf_trainer.algorithms.off_policy import rollout_importance_weights


def _mask(lengths: list[int], width: int) -> torch.Tensor:
    return (torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]).float()  # (B, T)


def test_overlong_penalty_is_linear_from_the_buffer_start_to_minus_the_factor():
    # max 16, buffer 4: 0 up to 12 tokens, -1/4 per token after, -factor at 16.
    lengths = torch.tensor([3, 12, 13, 14, 15, 16])
    assert overlong_penalty(lengths, 16, 4, 1.0).tolist() == [0.0, 0.0, -0.25, -0.5, -0.75, -1.0]
    assert overlong_penalty(lengths, 16, 4, 0.5).tolist() == [0.0, 0.0, -0.125, -0.25, -0.375, -0.5]
    with pytest.raises(ValueError, match="buffer_length 16 must be < max_length 16"):
        overlong_penalty(lengths, 16, 16, 1.0)


def test_grpo_with_the_overlong_penalty_normalises_the_penalised_scores():
    mask = _mask([2, 8, 4, 4], 8)  # max 8, buffer 4: the 8-token response loses 1.0
    batch = {
        "response_mask": mask,
        "scores": torch.tensor([1.0, 1.0, 0.0, 1.0]),
        "group_index": torch.tensor([0, 0, 1, 1]),
    }
    algo = build_algorithm("grpo", {"klCoef": 0.0, "overlongBufferLength": 4, "overlongMaxLength": 8})
    out = algo.compute_advantages(batch)
    # group 0: scores 1 and 1 - 1 = 0 -> mean 0.5, std sqrt(0.5): +-0.5/0.7071 = +-0.7071
    first = out["advantages"][:, 0]
    assert torch.allclose(first, torch.tensor([0.70710, -0.70710, -0.70710, 0.70710]), atol=1e-4)
    assert out["dapo/overlong_penalized"] == 1.0 and out["dapo/overlong_penalty_mean"] == -0.25
    assert torch.equal(batch["scores"], torch.tensor([1.0, 1.0, 0.0, 1.0]))  # the input is left alone
    plain = build_algorithm("grpo", {"klCoef": 0.0}).compute_advantages(batch)
    assert plain["advantages"][0, 0] == 0.0 and "dapo/overlong_penalized" not in plain  # off by default


def test_the_overlong_penalty_needs_its_max_length_and_a_shorter_buffer():
    batch = {"response_mask": _mask([2], 4), "scores": torch.tensor([1.0]), "group_index": torch.tensor([0])}
    with pytest.raises(ValueError, match="needs overlong_max_length"):
        build_algorithm("grpo", {"overlongBufferLength": 4}).compute_advantages(batch)
    with pytest.raises(
        ValueError,
        match="overlongBufferLength must be < overlongMaxLength .*; got overlongBufferLength 8, overlongMaxLength 8",
    ):
        GRPOParams(overlong_buffer_length=8, overlong_max_length=8)


def test_the_job_gives_the_overlong_max_length_its_generation_budget():
    from types import SimpleNamespace

    job = SimpleNamespace(rollout=SimpleNamespace(max_new_tokens=24))  # what build_algorithm reads
    assert build_algorithm("grpo", {"overlongBufferLength": 4}, job=job).params.overlong_max_length == 24
    assert build_algorithm("grpo", {"overlongMaxLength": 9}, job=job).params.overlong_max_length == 9


def test_mask_truncated_leaves_truncated_responses_out_of_the_update_only():
    from rlhf_trainer.dataflow import StepBatch, phases

    scores = torch.tensor([1.0, 0.0, 0.0, 1.0])
    truncated = torch.tensor([False, True, False, False])
    batch = StepBatch(
        tensors={
            "response_mask": _mask([2, 4, 3, 1], 4),
            "scores": scores,
            "group_index": torch.tensor([0, 0, 1, 1]),
            "truncated": truncated,
        },
        prompts=["a", "a", "b", "b"],
    )
    algo = build_algorithm("grpo", {"klCoef": 0.0, "maskTruncated": True})
    out = phases.compute_advantages(None, batch, algo)  # type: ignore[arg-type]
    assert out.prompts == ["a", "b", "b"] and out.metrics["dapo/truncated_masked"] == 1.0
    assert out.metrics["update/untrained_samples"] == 1.0
    # the truncated sample still counted in its group: the kept sample of group 0 has +0.7071
    assert math.isclose(float(out["advantages"][0, 0]), 0.70710, abs_tol=1e-4)
    with pytest.raises(ValueError, match="needs batch key 'truncated'"):
        algo.compute_advantages({k: v for k, v in batch.tensors.items() if k != "truncated"})


def test_dynamic_sampling_keeps_only_groups_with_reward_variance():
    scores = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.5, 0.5, 2.0])
    groups = torch.tensor([7, 7, 3, 3, 9, 9, 11])  # 11: a group of one
    keep, varied = groups_with_variance(scores, groups)
    assert varied.tolist() == [True, False, False, False]  # groups in label order 3, 7, 9, 11
    assert keep.tolist() == [False, False, True, True, False, False, False]


# -- the rollout correction's weights -------------------------------------------------------------

#: A recorded batch: the engine's log-probs and the trainer's of the same 2 x 3 tokens (the second
#: row has 2 valid tokens), chosen so that each ratio is a round number.
ENGINE = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -1.2, 0.0]])
RATIOS = torch.tensor([[3.0, 0.5, 1.0], [1.5, 1.25, 1.0]])
TRAINER = ENGINE + torch.log(RATIOS)
MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])


def test_token_weights_truncated_at_the_cap():
    w, m = rollout_importance_weights(TRAINER, ENGINE, MASK, cap=2.0)
    assert torch.allclose(w, torch.tensor([[2.0, 0.5, 1.0], [1.5, 1.25, 0.0]]))
    assert math.isclose(m["rollout/is_weight_mean"], (2.0 + 0.5 + 1.0 + 1.5 + 1.25) / 5, rel_tol=1e-6)
    assert math.isclose(m["rollout/is_weight_max"], 2.0, rel_tol=1e-6)
    assert math.isclose(m["rollout/is_weight_min"], 0.5, rel_tol=1e-6)
    assert math.isclose(m["rollout/is_truncated_fraction"], 1 / 5)


def test_token_weights_masked_above_the_cap():
    w, m = rollout_importance_weights(TRAINER, ENGINE, MASK, cap=1.4, mode="mask")
    assert torch.allclose(w, torch.tensor([[0.0, 0.5, 1.0], [0.0, 1.25, 0.0]]))
    assert math.isclose(m["rollout/is_truncated_fraction"], 2 / 5)
    assert math.isclose(m["rollout/is_weight_max"], 1.25, rel_tol=1e-6)
    assert m["rollout/is_weight_min"] == 0.0  # the masked tokens


def test_sequence_weights_are_the_product_over_the_response():
    # row 0: 3 * 0.5 * 1 = 1.5; row 1: 1.5 * 1.25 = 1.875 (its padding never counts)
    w, m = rollout_importance_weights(TRAINER, ENGINE, MASK, cap=1.8, level="sequence")
    assert torch.allclose(w, torch.tensor([[1.5, 1.5, 1.5], [1.8, 1.8, 0.0]]), atol=1e-5)
    assert math.isclose(m["rollout/is_weight_mean"], (1.5 + 1.8) / 2, rel_tol=1e-5)
    assert math.isclose(m["rollout/is_weight_min"], 1.5, rel_tol=1e-5)
    assert math.isclose(m["rollout/is_truncated_fraction"], 1 / 2)
    w, _ = rollout_importance_weights(TRAINER, ENGINE, MASK, cap=1.8, level="sequence", mode="mask")
    assert torch.allclose(w, torch.tensor([[1.5, 1.5, 1.5], [0.0, 0.0, 0.0]]), atol=1e-5)


def test_the_weights_check_their_arguments():
    with pytest.raises(ValueError, match="cap .* must be >= 1"):
        rollout_importance_weights(TRAINER, ENGINE, MASK, cap=0.5)
    with pytest.raises(ValueError, match="level must be token or sequence"):
        rollout_importance_weights(TRAINER, ENGINE, MASK, cap=2.0, level="batch")


def test_the_policy_loss_applies_is_weights_to_the_advantages():
    gen = torch.Generator().manual_seed(0)
    log_probs = torch.randn(2, 3, generator=gen, requires_grad=True)
    batch = {
        "response_mask": MASK,
        "log_probs": log_probs,
        "old_log_probs": log_probs.detach() - 0.1,
        "advantages": torch.randn(2, 3, generator=gen),
    }
    weights, _ = rollout_importance_weights(TRAINER, ENGINE, MASK, cap=2.0)
    algo = build_algorithm("grpo", {"klCoef": 0.0})
    weighted = algo.compute_loss({**batch, "is_weights": weights})["loss"]
    by_hand = algo.compute_loss({**batch, "advantages": batch["advantages"] * weights})["loss"]
    assert torch.allclose(weighted, by_hand)
    assert not torch.allclose(weighted, algo.compute_loss(batch)["loss"])
