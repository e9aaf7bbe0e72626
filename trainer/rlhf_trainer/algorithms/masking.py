"""Masked reductions and input checks shared by every family.

All tensors of the library are `(B, T)` over response tokens, with a `response_mask` `(B, T)`
holding 1.0 for valid tokens and 0.0 for padding (a bool mask is accepted and converted).
Padding may be on either side, in the middle (multi-turn observation tokens), or cover a
whole row.

Reductions drop masked positions with `torch.where`, not by multiplying with the mask, so a
NaN or inf left at a padded position does not leak into a forward value.
"""

from __future__ import annotations

import torch
from torch import Tensor


def check_mask(response_mask: Tensor, name: str = "response_mask") -> Tensor:
    """Validate a `(B, T)` mask of 0/1 values; return it as a floating tensor.

    A bool or integer mask becomes torch's default float dtype; a floating mask keeps its dtype.
    """
    if not isinstance(response_mask, Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(response_mask).__name__}")
    if response_mask.dim() != 2:
        raise ValueError(f"{name} must be 2-D (B, T), got shape {tuple(response_mask.shape)}")
    if response_mask.dtype == torch.bool:
        return response_mask.to(torch.get_default_dtype())
    if not response_mask.is_floating_point():
        response_mask = response_mask.to(torch.get_default_dtype())
    if not bool(((response_mask == 0) | (response_mask == 1)).all()):
        bad = response_mask[(response_mask != 0) & (response_mask != 1)].flatten()[:3].tolist()
        raise ValueError(f"{name} must hold only 0 and 1, found {bad}")
    return response_mask


def check_same_shape(**tensors: Tensor | None) -> None:
    """Raise ValueError naming every shape unless all given (non-None) tensors share one shape."""
    given = {k: v for k, v in tensors.items() if v is not None}
    for key, value in given.items():
        if not isinstance(value, Tensor):
            raise ValueError(f"{key} must be a torch.Tensor, got {type(value).__name__}")
    shapes = {k: tuple(v.shape) for k, v in given.items()}
    if len(set(shapes.values())) > 1:
        listed = ", ".join(f"{k} {s}" for k, s in shapes.items())
        raise ValueError(f"shape mismatch: {listed}")


def check_per_sequence(response_mask: Tensor, **tensors: Tensor | None) -> None:
    """Raise ValueError unless each given tensor is `(B,)` with the mask's B."""
    batch = response_mask.shape[0]
    for key, value in tensors.items():
        if value is None:
            continue
        if not isinstance(value, Tensor):
            raise ValueError(f"{key} must be a torch.Tensor, got {type(value).__name__}")
        if tuple(value.shape) != (batch,):
            raise ValueError(
                f"shape mismatch: {key} {tuple(value.shape)} must be (B,) = ({batch},) "
                f"for response_mask {tuple(response_mask.shape)}"
            )


def masked_sum(values: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Sum of `values` where `mask` is 1 (over all elements, or along `dim`)."""
    kept = torch.where(mask.bool(), values, torch.zeros((), dtype=values.dtype, device=values.device))
    return kept.sum() if dim is None else kept.sum(dim=dim)


def masked_mean(values: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Mean of `values` where `mask` is 1; 0 where nothing is valid (instead of NaN)."""
    total = masked_sum(values, mask, dim)
    count = mask.sum() if dim is None else mask.sum(dim=dim)
    return total / count.clamp(min=1)


def masked_var(values: Tensor, mask: Tensor, unbiased: bool = True) -> Tensor:
    """Variance of the valid elements of `values` (scalar).

    `unbiased` divides by n - 1 (Bessel; verl), otherwise by n (OpenRLHF). With fewer than
    two valid elements the unbiased variance is taken as 0 rather than failing (verl raises).
    """
    mean = masked_mean(values, mask)
    count = mask.sum()
    sq = masked_sum((values - mean) ** 2, mask)
    denom = (count - 1).clamp(min=1) if unbiased else count.clamp(min=1)
    return sq / denom


def masked_whiten(values: Tensor, mask: Tensor, unbiased: bool = True, eps: float = 1e-8) -> Tensor:
    """`(values - mean) / sqrt(var + eps)` with mean and variance over valid elements; 0 at masked ones.

    values, mask: (B, T). Statistics span the whole batch (all valid tokens), as in verl's and
    OpenRLHF's advantage normalisation. `unbiased` selects verl's (True) or OpenRLHF's (False)
    variance; verl adds `eps` inside the square root, OpenRLHF clamps the variance at `eps`,
    which differ only when the variance is below `eps`.
    """
    mean = masked_mean(values, mask)
    var = masked_var(values, mask, unbiased=unbiased)
    whitened = (values - mean) * torch.rsqrt(var + eps)
    return torch.where(mask.bool(), whitened, torch.zeros((), dtype=values.dtype, device=values.device))


def last_valid_index(response_mask: Tensor) -> Tensor:
    """(B,) long: the index of the last valid token of each row; -1 for a fully masked row."""
    _, length = response_mask.shape
    positions = torch.arange(length, device=response_mask.device).expand_as(response_mask)  # (B, T)
    return torch.where(response_mask.bool(), positions, torch.full_like(positions, -1)).amax(dim=1)


def scores_to_token_rewards(scores: Tensor, response_mask: Tensor) -> Tensor:
    """Place each sequence's score on its last valid token: (B,) -> (B, T).

    The usual way an outcome reward enters a token-level estimator (GAE, REINFORCE++). A fully
    masked row receives nothing.
    """
    response_mask = check_mask(response_mask)
    check_per_sequence(response_mask, scores=scores)
    last = last_valid_index(response_mask)  # (B,)
    positions = torch.arange(response_mask.shape[1], device=scores.device)  # (T,)
    at_last = positions.unsqueeze(0) == last.unsqueeze(1)  # (B, T)
    dtype = scores.dtype if scores.is_floating_point() else response_mask.dtype
    return torch.where(
        at_last, scores.unsqueeze(1).to(dtype), torch.zeros((), dtype=dtype, device=scores.device)
    )


def group_ids(group_index: Tensor) -> tuple[Tensor, int]:
    """Dense group ids 0..G-1 for arbitrary (B,) labels, and G."""
    if group_index.dtype.is_floating_point or group_index.dtype == torch.bool:
        raise ValueError(f"group_index must be an integer tensor, got dtype {group_index.dtype}")
    _, inverse = torch.unique(group_index, return_inverse=True)
    num_groups = int(inverse.max().item()) + 1 if inverse.numel() else 0
    return inverse, num_groups


def count_normalizers(response_mask: Tensor) -> tuple[float, float]:
    """Local `(tokens, sequences)` counts, to be summed over micro-batches and ranks.

    The sums are the `global_tokens` / `global_seqs` normalizers of `aggregation`: valid
    tokens, and sequences with at least one valid token.
    """
    response_mask = check_mask(response_mask)
    return float(response_mask.sum().item()), float((response_mask.sum(dim=1) > 0).sum().item())
