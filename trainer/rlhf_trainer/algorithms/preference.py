"""Pairwise preference losses for online DPO: sequence log-probs of (chosen, rejected) pairs -> loss.

Signature: ``loss_fn(chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps, *,
<hyperparameters>, global_pairs=None) -> (loss, metrics)`` with (P,) inputs, one entry per pair.
With h = (chosen - rejected) - (ref_chosen - ref_rejected), the policy's log-ratio margin over
the reference's:

* `dpo` (Rafailov et al. 2023, arXiv:2305.18290; label smoothing per Mitchell 2023, "cDPO"):
  -(1 - eps) log sigmoid(beta h) - eps log sigmoid(-beta h)
* `ipo` (Azar et al. 2023, arXiv:2310.12036, eq. 17): (h - 1 / (2 beta))^2

The loss is the sum over pairs divided by `global_pairs` (all pairs of the optimizer step,
over micro-batches and ranks) when given, else by the local number of pairs — the same rule
as `aggregation`. Metrics (`actor/` namespace), means over this call's pairs alone: `dpo_loss`, `dpo_reward_acc` (share of pairs
whose implicit reward beta * (logp - ref_logp) ranks chosen above rejected), `dpo_chosen_reward`,
`dpo_rejected_reward`, `dpo_margin`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from .masking import check_same_shape, group_ids
from .registry import PREFERENCE_LOSSES

__all__ = ["dpo_loss", "ipo_loss", "pair_up"]


def _reduce(losses: Tensor, global_pairs: float | Tensor | None) -> Tensor:
    if global_pairs is None:
        return losses.sum() / max(losses.numel(), 1)
    if float(global_pairs) < 0:
        raise ValueError(f"global_pairs must be >= 0, got {float(global_pairs)}")
    return losses.sum() / max(float(global_pairs), 1.0)


def _metrics(losses: Tensor, chosen_rewards: Tensor, rejected_rewards: Tensor) -> dict[str, float]:
    """Means over this call's pairs (independent of `global_pairs`)."""

    def mean(x: Tensor) -> float:
        return float(x.detach().mean().item()) if x.numel() else 0.0

    return {
        "actor/dpo_loss": mean(losses),
        "actor/dpo_reward_acc": mean((chosen_rewards > rejected_rewards).to(chosen_rewards.dtype)),
        "actor/dpo_chosen_reward": mean(chosen_rewards),
        "actor/dpo_rejected_reward": mean(rejected_rewards),
        "actor/dpo_margin": mean(chosen_rewards - rejected_rewards),
    }


def _margin(
    chosen_logps: Tensor, rejected_logps: Tensor, ref_chosen_logps: Tensor, ref_rejected_logps: Tensor
) -> Tensor:
    check_same_shape(
        chosen_logps=chosen_logps,
        rejected_logps=rejected_logps,
        ref_chosen_logps=ref_chosen_logps,
        ref_rejected_logps=ref_rejected_logps,
    )
    if chosen_logps.dim() != 1:
        raise ValueError(f"preference inputs must be (P,) per pair, got shape {tuple(chosen_logps.shape)}")
    return (chosen_logps - rejected_logps) - (ref_chosen_logps - ref_rejected_logps)  # (P,)


def _check_beta(beta: float) -> None:
    if beta <= 0:
        raise ValueError(f"beta must be > 0, got {beta}")


@PREFERENCE_LOSSES.register("dpo")
def dpo_loss(
    chosen_logps: Tensor,
    rejected_logps: Tensor,
    ref_chosen_logps: Tensor,
    ref_rejected_logps: Tensor,
    *,
    beta: float = 0.1,
    label_smoothing: float = 0.0,
    global_pairs: float | Tensor | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """Sigmoid DPO loss with optional label smoothing (the assumed rate of flipped labels, in [0, 0.5))."""
    _check_beta(beta)
    if not 0.0 <= label_smoothing < 0.5:
        raise ValueError(f"label_smoothing must be in [0, 0.5), got {label_smoothing}")
    margin = _margin(chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps)
    losses = -(1.0 - label_smoothing) * F.logsigmoid(beta * margin) - label_smoothing * F.logsigmoid(
        -beta * margin
    )
    loss = _reduce(losses, global_pairs)
    chosen_rewards = beta * (chosen_logps - ref_chosen_logps).detach()
    rejected_rewards = beta * (rejected_logps - ref_rejected_logps).detach()
    return loss, _metrics(losses, chosen_rewards, rejected_rewards)


@PREFERENCE_LOSSES.register("ipo")
def ipo_loss(
    chosen_logps: Tensor,
    rejected_logps: Tensor,
    ref_chosen_logps: Tensor,
    ref_rejected_logps: Tensor,
    *,
    beta: float = 0.1,
    global_pairs: float | Tensor | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """IPO: squared distance of the margin from 1 / (2 beta); beta is the regularisation strength."""
    _check_beta(beta)
    margin = _margin(chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps)
    losses = (margin - 1.0 / (2.0 * beta)) ** 2
    loss = _reduce(losses, global_pairs)
    chosen_rewards = beta * (chosen_logps - ref_chosen_logps).detach()
    rejected_rewards = beta * (rejected_logps - ref_rejected_logps).detach()
    return loss, _metrics(losses, chosen_rewards, rejected_rewards)


def pair_up(seq_values: Tensor, chosen: Tensor, pair_index: Tensor) -> tuple[Tensor, Tensor]:
    """Split per-sequence values (B,) into (chosen (P,), rejected (P,)) by pair, keeping gradients.

    chosen: (B,) bool; pair_index: (B,) integer label shared by the two members of a pair.
    Every pair must have exactly two members, one chosen. Pairs are ordered by label.
    """
    batch = seq_values.shape[0]
    for key, value in (("chosen", chosen), ("pair_index", pair_index)):
        if tuple(value.shape) != (batch,):
            raise ValueError(f"shape mismatch: {key} {tuple(value.shape)} must be (B,) = ({batch},)")
    if chosen.dtype != torch.bool:
        raise ValueError(f"chosen must be a bool tensor, got dtype {chosen.dtype}")
    ids, num_pairs = group_ids(pair_index)  # (B,), P
    members = torch.zeros(num_pairs, dtype=torch.long, device=ids.device).index_add(
        0, ids, torch.ones_like(ids)
    )
    chosen_count = torch.zeros_like(members).index_add(0, ids, chosen.long())
    labels = torch.unique(pair_index)  # (P,), sorted like ids
    bad = (members != 2) | (chosen_count != 1)
    if bool(bad.any()):
        details = [
            f"pair {int(labels[p])}: {int(members[p])} members, {int(chosen_count[p])} chosen"
            for p in torch.nonzero(bad).flatten()[:5].tolist()
        ]
        raise ValueError("each pair needs exactly 2 members, 1 chosen; " + "; ".join(details))
    zeros = seq_values.new_zeros(num_pairs)
    chosen_values = zeros.index_add(0, ids[chosen], seq_values[chosen])  # (P,)
    rejected_values = zeros.index_add(0, ids[~chosen], seq_values[~chosen])  # (P,)
    return chosen_values, rejected_values
