"""Off-policy correction of asynchronous rollouts (`algorithms.off_policy`): the truncated
importance weight against the behaviour policy, the decoupled PPO loss it makes, and the
staleness rule (`phases.drop_stale`)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from rlhf_trainer.algorithms.off_policy import (
    stale_rows,
    staleness,
    truncated_importance_weights,
    weighted_advantages,
)
from rlhf_trainer.algorithms.policy_loss import ppo_clip_loss


def test_weights_are_prox_over_behaviour_truncated_at_the_cap():
    # Known ratios pi_prox / pi_behav: 0.5, 1, 1.5, 3 (truncated to 2), and a padding token.
    behaviour = torch.log(torch.tensor([[0.4, 0.2, 0.2, 0.1, 0.3]], dtype=torch.float64))
    prox = torch.log(torch.tensor([[0.2, 0.2, 0.3, 0.3, 0.9]], dtype=torch.float64))
    mask = torch.tensor([[1.0, 1.0, 1.0, 1.0, 0.0]], dtype=torch.float64)
    w, m = truncated_importance_weights(prox, behaviour, mask, cap=2.0)
    assert torch.allclose(w, torch.tensor([[0.5, 1.0, 1.5, 2.0, 0.0]], dtype=torch.float64))
    assert m["offpolicy/is_weight_mean"] == pytest.approx((0.5 + 1 + 1.5 + 2) / 4)
    assert m["offpolicy/is_truncated_fraction"] == pytest.approx(0.25)
    kl = -(math.log(0.5) + 0 + math.log(1.5) + math.log(3.0)) / 4  # E[log behav - log prox]
    assert m["offpolicy/mismatch_kl"] == pytest.approx(kl)
    assert not w.requires_grad


def test_cap_below_one_is_refused_naming_the_field():
    z = torch.zeros(1, 2)
    with pytest.raises(ValueError, match="importanceWeightCap"):
        truncated_importance_weights(z, z, torch.ones(1, 2), cap=0.9)


def _inputs(seed: int, b: int = 4, t: int = 6):
    g = torch.Generator().manual_seed(seed)
    log_probs = (-torch.rand(b, t, generator=g, dtype=torch.float64) * 2 - 0.1).requires_grad_()
    prox = log_probs.detach() + torch.randn(b, t, generator=g, dtype=torch.float64) * 0.3
    behaviour = prox + torch.randn(b, t, generator=g, dtype=torch.float64) * 0.3
    adv = torch.randn(b, t, generator=g, dtype=torch.float64)
    mask = (torch.rand(b, t, generator=g) > 0.2).double()
    mask[:, 0] = 1.0
    return log_probs, prox, behaviour, adv, mask


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("old", ["recomputed", "skipped"])
def test_untruncated_unclipped_decoupled_gradient_is_the_behaviour_ratio_gradient(seed, old):
    """w * pi_theta / pi_prox = pi_theta / pi_behav: with no clip active and no truncation, the
    decoupled loss (old = prox, advantages * w) has the gradient of the plain importance-sampled
    surrogate -A * pi_theta / pi_behav — the ratio is against the behaviour policy. `skipped`:
    the proximal log-probs are the update's own, detached (issue 14's skipped pass, as the actor
    takes them when the batch is trained in one optimizer step): still pi_theta / pi_behav."""
    log_probs, prox, behaviour, adv, mask = _inputs(seed)
    if old == "skipped":
        prox = log_probs.detach()
    wide = {"clip_ratio_low": 0.999, "clip_ratio_high": 1e6, "clip_ratio_c": None}
    w, _ = truncated_importance_weights(prox, behaviour, mask, cap=1e6)
    loss, _ = ppo_clip_loss(log_probs, prox, weighted_advantages(adv, w), mask, **wide)
    (grad,) = torch.autograd.grad(loss, log_probs)
    # Reference: d/d lp of mean_t(-A * exp(lp - behav)) over valid tokens.
    ratio = torch.exp(log_probs.detach() - behaviour)
    expected = -adv * ratio * mask / mask.sum()
    assert torch.allclose(grad, expected, atol=1e-12)
    # ... and it is not the on-policy gradient (ratio against the proximal policy alone).
    on_policy, _ = ppo_clip_loss(log_probs, prox, adv, mask, **wide)
    (grad_prox,) = torch.autograd.grad(on_policy, log_probs)
    assert not torch.allclose(grad, grad_prox, atol=1e-6)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_weighting_the_advantages_weights_each_token_of_the_clipped_loss(seed):
    """PPO-clip(r, w*A) = w * PPO-clip(r, A) token by token (w > 0), dual clip included: so the
    actor may apply the weight to the advantages."""
    log_probs, prox, behaviour, adv, mask = _inputs(seed)
    w, _ = truncated_importance_weights(prox, behaviour, mask, cap=1.5)
    loss, _ = ppo_clip_loss(log_probs, prox, weighted_advantages(adv, w), mask, loss_agg_mode="token-sum")
    ratio = torch.exp(log_probs.detach() - prox)
    plain = torch.maximum(-adv * ratio, -adv * ratio.clamp(0.8, 1.2))
    plain = torch.where(adv < 0, torch.minimum(plain, -adv * 3.0), plain)  # dual clip, c = 3
    assert float(loss.detach()) == pytest.approx(float((w * plain * mask).sum()), rel=1e-12)


def test_staleness_and_rows_older_than_the_bound():
    versions = torch.tensor([5, 4, 3, 5])
    assert staleness(versions, 5).tolist() == [0, 1, 2, 0]
    assert stale_rows(versions, 5, 1).tolist() == [False, False, True, False]
    assert not stale_rows(versions, 5, 2).any()


def _ctx(max_staleness: int, version: int):
    from rlhf_api.loader import parse_job
    from rlhf_trainer.dataflow.context import TrainerContext

    job = parse_job(
        {
            "apiVersion": "rlhf.dev/v1alpha1",
            "kind": "RLTrainingJob",
            "metadata": {"name": "t"},
            "spec": {
                "model": {"path": "m"},
                "data": {"path": "d.jsonl"},
                "reward": {"functions": [{"path": "a:b"}]},
                "roles": {"placement": "disaggregated"},
                "rollout": {"maxStaleness": max_staleness},
            },
        }
    )
    ctx = TrainerContext(
        spec=job.spec, job_name="t", run_dir=Path("."), tokenizer=None, dataset=None, algorithm=None
    )  # type: ignore[arg-type]
    ctx.policy_version = version
    return ctx


def _batch(versions: list[int]):
    from rlhf_trainer.dataflow.batch import StepBatch

    b = len(versions)
    return StepBatch(
        tensors={
            "policy_version": torch.tensor(versions),
            "response_mask": torch.ones(b, 3),
            "group_index": torch.arange(b),
        },
        prompts=[f"p{i}" for i in range(b)],
        responses=[f"r{i}" for i in range(b)],
    )


def test_drop_stale_removes_and_counts_samples_older_than_max_staleness():
    from rlhf_trainer.dataflow.phases import drop_stale, is_stale

    ctx = _ctx(max_staleness=1, version=7)
    out = drop_stale(ctx, _batch([6, 7, 5, 6, 4]))
    assert out["policy_version"].tolist() == [6, 7, 6]
    assert out.prompts == ["p0", "p1", "p3"]
    assert out.metrics["offpolicy/dropped"] == 2.0
    assert out.metrics["offpolicy/staleness_max"] == 1.0
    assert out.metrics["offpolicy/staleness_mean"] == pytest.approx(2 / 3)
    assert is_stale(ctx, out)
    fresh = drop_stale(ctx, _batch([7, 7]))
    assert fresh.metrics["offpolicy/dropped"] == 0.0 and fresh.metrics["offpolicy/staleness_max"] == 0.0
    assert not is_stale(ctx, fresh)
