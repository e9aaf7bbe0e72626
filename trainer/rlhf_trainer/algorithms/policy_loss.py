"""Policy-gradient surrogate losses: (log-probs, advantages) -> (loss, metrics).

Every loss has the signature::

    loss_fn(log_probs, old_log_probs, advantages, response_mask, *, <hyperparameters>,
            loss_agg_mode, global_tokens, global_seqs, norm_length) -> (loss, metrics)

Tensors are `(B, T)`; `log_probs` carries the gradient. `loss` is a scalar tensor (see
`aggregation` for the modes and for the `global_*` normalizers that make micro-batch losses
sum to the full-batch loss). `metrics` maps namespaced keys to Python floats that describe this
call's tokens alone — they ignore the `global_*` normalizers, so averaging them over
micro-batches (token-weighted) is meaningful: `actor/pg_loss` (the loss aggregated with local
normalizers), `actor/pg_clipfrac` (share of tokens where the
clipped branch is active), `actor/pg_clipfrac_lower` (share where the dual clip is active) and
`actor/ppo_kl` (mean of old - new log-prob, the k1 estimate of KL(old || new)).

Keyword-only parameters are filled by `Algorithm` from its params of the same name, so a user
loss registered under `POLICY_LOSSES` only declares the hyperparameters it reads.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .aggregation import aggregate
from .masking import check_mask, check_same_shape, masked_mean, masked_sum
from .registry import POLICY_LOSSES

__all__ = ["ppo_clip_loss", "gspo_loss"]


def _check(log_probs: Tensor, old_log_probs: Tensor, advantages: Tensor, response_mask: Tensor) -> Tensor:
    response_mask = check_mask(response_mask)
    check_same_shape(
        log_probs=log_probs, old_log_probs=old_log_probs, advantages=advantages, response_mask=response_mask
    )
    return response_mask


def _local_value(loss_mat: Tensor, response_mask: Tensor, mode: str, norm_length: float | None) -> float:
    """The loss of this call alone (local normalizers), for metrics."""
    return float(aggregate(loss_mat.detach(), response_mask, mode, norm_length=norm_length).item())


def _check_clip(clip_ratio_low: float, clip_ratio_high: float) -> None:
    if not 0 <= clip_ratio_low < 1:
        raise ValueError(f"clip_ratio_low must be in [0, 1), got {clip_ratio_low}")
    if clip_ratio_high < 0:
        raise ValueError(f"clip_ratio_high must be >= 0, got {clip_ratio_high}")


@POLICY_LOSSES.register("ppo")
def ppo_clip_loss(
    log_probs: Tensor,
    old_log_probs: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    *,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    clip_ratio_c: float | None = 3.0,
    log_ratio_clamp: float = 20.0,
    loss_agg_mode: str = "token-mean",
    global_tokens: float | Tensor | None = None,
    global_seqs: float | Tensor | None = None,
    norm_length: float | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """PPO clipped surrogate (Schulman et al. 2017, arXiv:1707.06347) with two extensions.

    ratio = exp(clamp(log_probs - old_log_probs, +-log_ratio_clamp))   # clamped before exp
    L = max(-A * ratio, -A * clip(ratio, 1 - clip_ratio_low, 1 + clip_ratio_high))

    * Asymmetric clip ("clip-higher", DAPO arXiv:2503.14476): separate low and high epsilons.
    * Dual clip (Ye et al. 2020, arXiv:1912.09729): for A < 0 the loss is also capped at
      -A * clip_ratio_c (c > 1), so a huge ratio on a bad action cannot blow the loss up.
      verl applies it by default with c = 3; OpenRLHF only when asked. None disables it.

    `actor/ppo_kl` uses the unclamped log-ratio (OpenRLHF; verl reports the clamped one).
    """
    response_mask = _check(log_probs, old_log_probs, advantages, response_mask)
    _check_clip(clip_ratio_low, clip_ratio_high)
    if clip_ratio_c is not None and clip_ratio_c <= 1.0:
        raise ValueError(f"clip_ratio_c (dual clip) must be > 1, got {clip_ratio_c}")
    log_ratio = log_probs - old_log_probs  # (B, T)
    ratio = torch.exp(log_ratio.clamp(-log_ratio_clamp, log_ratio_clamp))  # (B, T)
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    surrogate = torch.maximum(unclipped, clipped)  # (B, T)
    clipfrac = masked_mean((clipped > unclipped).to(log_probs.dtype), response_mask)
    negative = advantages < 0
    if clip_ratio_c is not None:
        dual_cap = -advantages * clip_ratio_c  # (B, T)
        loss_mat = torch.where(negative, torch.minimum(surrogate, dual_cap), surrogate)
        clipfrac_lower = masked_mean(((surrogate > dual_cap) & negative).to(log_probs.dtype), response_mask)
    else:
        loss_mat = surrogate
        clipfrac_lower = torch.zeros((), dtype=log_probs.dtype)
    loss = aggregate(
        loss_mat,
        response_mask,
        loss_agg_mode,
        global_tokens=global_tokens,
        global_seqs=global_seqs,
        norm_length=norm_length,
    )
    metrics = {
        "actor/pg_loss": _local_value(loss_mat, response_mask, loss_agg_mode, norm_length),
        "actor/pg_clipfrac": float(clipfrac.item()),
        "actor/pg_clipfrac_lower": float(clipfrac_lower.item()),
        "actor/ppo_kl": float(masked_mean(-log_ratio.detach(), response_mask).item()),
    }
    return loss, metrics


@POLICY_LOSSES.register("gspo")
def gspo_loss(
    log_probs: Tensor,
    old_log_probs: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    *,
    clip_ratio_low: float = 3e-4,
    clip_ratio_high: float = 4e-4,
    log_ratio_clamp: float = 10.0,
    loss_agg_mode: str = "seq-mean-token-mean",
    global_tokens: float | Tensor | None = None,
    global_seqs: float | Tensor | None = None,
    norm_length: float | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """Group Sequence Policy Optimization (Zheng et al. 2025, arXiv:2507.18071).

    The importance ratio is per sequence, the geometric mean of the token ratios:
    s_i = exp(clamp((1/n_i) sum_t m_it (log_probs - old_log_probs)_it, +-log_ratio_clamp)),
    broadcast over the sequence's tokens; then the clipped surrogate of `ppo_clip_loss`
    (no dual clip). The paper's clip ranges are tiny (3e-4 / 4e-4, the defaults here) because
    s_i is a length-normalised ratio. Aggregate with ``seq-mean-token-mean`` (default) for the
    paper's sequence-level objective.

    The gradient flows through s_i (the paper's GSPO, as in OpenRLHF). verl implements the
    "GSPO-token" form (stop-gradient on s_i, a per-token gradient); both give the same gradient
    when advantages are constant within a sequence and the loss is ``seq-mean-token-mean``.
    `actor/pg_clipfrac_lower` is always 0.
    """
    response_mask = _check(log_probs, old_log_probs, advantages, response_mask)
    _check_clip(clip_ratio_low, clip_ratio_high)
    log_ratio = log_probs - old_log_probs  # (B, T)
    lengths = response_mask.sum(dim=1).clamp(min=1)  # (B,)
    seq_log_ratio = masked_sum(log_ratio, response_mask, dim=1) / lengths  # (B,)
    seq_ratio = torch.exp(seq_log_ratio.clamp(-log_ratio_clamp, log_ratio_clamp))  # (B,)
    ratio = seq_ratio.unsqueeze(1).expand_as(log_ratio)  # (B, T): s_i on each token
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    loss_mat = torch.maximum(unclipped, clipped)
    loss = aggregate(
        loss_mat,
        response_mask,
        loss_agg_mode,
        global_tokens=global_tokens,
        global_seqs=global_seqs,
        norm_length=norm_length,
    )
    metrics = {
        "actor/pg_loss": _local_value(loss_mat, response_mask, loss_agg_mode, norm_length),
        "actor/pg_clipfrac": float(
            masked_mean((clipped > unclipped).to(log_probs.dtype), response_mask).item()
        ),
        "actor/pg_clipfrac_lower": 0.0,
        "actor/ppo_kl": float(masked_mean(-log_ratio.detach(), response_mask).item()),
    }
    return loss, metrics
