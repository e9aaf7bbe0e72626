"""The critic's loss: clipped value regression (PPO; Schulman et al. 2017, arXiv:1707.06347)."""

from __future__ import annotations

import torch
from torch import Tensor

from .aggregation import aggregate
from .masking import check_mask, check_same_shape, masked_mean

__all__ = ["clipped_value_loss"]


def clipped_value_loss(
    values: Tensor,
    old_values: Tensor,
    returns: Tensor,
    response_mask: Tensor,
    *,
    clip_range_value: float | None = 0.5,
    loss_agg_mode: str = "token-mean",
    global_tokens: float | Tensor | None = None,
    global_seqs: float | Tensor | None = None,
    norm_length: float | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """0.5 * agg(max((V - R)^2, (V_clip - R)^2)), V_clip = V_old + clamp(V - V_old, +-clip_range_value).

    values: (B, T) current critic prediction (with grad); old_values: (B, T) the prediction
    when the rollout was scored; returns: (B, T) targets (`gae`'s returns). Taking the max
    makes the update pessimistic: a prediction moved more than `clip_range_value` away from the
    old one gets no gradient towards the target (same as verl and OpenRLHF). None disables
    clipping. Metrics, over this call's tokens alone (the `global_*` normalizers do not enter
    them): `critic/vf_loss`, `critic/vf_clipfrac` (share of valid tokens where the clipped term
    is larger), `critic/vpred_mean`.
    """
    response_mask = check_mask(response_mask)
    check_same_shape(values=values, old_values=old_values, returns=returns, response_mask=response_mask)
    unclipped = (values - returns) ** 2  # (B, T)
    if clip_range_value is None:
        loss_mat = unclipped
        clipfrac = torch.zeros((), dtype=values.dtype)
    else:
        if clip_range_value < 0:
            raise ValueError(f"clip_range_value must be >= 0 or None, got {clip_range_value}")
        values_clipped = old_values + (values - old_values).clamp(-clip_range_value, clip_range_value)
        clipped = (values_clipped - returns) ** 2
        loss_mat = torch.maximum(unclipped, clipped)
        clipfrac = masked_mean((clipped > unclipped).to(values.dtype), response_mask)
    loss = 0.5 * aggregate(
        loss_mat,
        response_mask,
        loss_agg_mode,
        global_tokens=global_tokens,
        global_seqs=global_seqs,
        norm_length=norm_length,
    )
    metrics = {
        # of this call alone (local normalizers), so it can be averaged over micro-batches
        "critic/vf_loss": 0.5
        * float(aggregate(loss_mat.detach(), response_mask, loss_agg_mode, norm_length=norm_length)),
        "critic/vf_clipfrac": float(clipfrac.item()),
        "critic/vpred_mean": float(masked_mean(values.detach(), response_mask).item()),
    }
    return loss, metrics
