"""DAPO's recipe (Yu et al. 2025, "DAPO: An Open-Source LLM Reinforcement Learning System at
Scale", arXiv:2503.14476) as pure functions of tensors: the overlong soft penalty (section 3.4,
eq. 13), overlong filtering (truncated responses out of the loss, section 3.4) and the group
filter of dynamic sampling (section 3.2). Clip-higher is `clipRatioHigh` and the token-level
loss `lossAggMode: token-mean`, already params of every policy-gradient algorithm.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .masking import group_ids

__all__ = ["overlong_penalty", "groups_with_variance"]


def overlong_penalty(lengths: Tensor, max_length: int, buffer_length: int, factor: float) -> Tensor:
    """(B,) penalty added to each response's reward: 0 up to `max_length - buffer_length` tokens,
    then linear down to `-factor` at `max_length` (and beyond):

        R(L) = -factor * clamp((L - (max_length - buffer_length)) / buffer_length, 0, 1)

    lengths: (B,) response tokens (EOS included). DAPO's eq. 13 with factor 1."""
    if buffer_length <= 0:
        raise ValueError(f"overlong_penalty: buffer_length must be > 0, got {buffer_length}")
    if buffer_length >= max_length:
        raise ValueError(f"overlong_penalty: buffer_length {buffer_length} must be < max_length {max_length}")
    start = max_length - buffer_length
    over = (lengths.float() - start).clamp(min=0.0) / buffer_length  # (B,): 0 at start, 1 at max_length
    return -factor * over.clamp(max=1.0)


def groups_with_variance(scores: Tensor, group_index: Tensor) -> tuple[Tensor, Tensor]:
    """Dynamic sampling's filter: which samples belong to a group whose rewards are not all equal.

    scores: (B,), group_index: (B,) prompt label of each sample. Returns `keep` (B,) bool and
    `varied` (G,) bool per group, groups in label order. A group of one has no variance."""
    ids, num_groups = group_ids(group_index)  # (B,), G
    scores = scores.float()
    high = torch.full((num_groups,), float("-inf")).scatter_reduce(0, ids, scores, reduce="amax")  # (G,)
    low = torch.full((num_groups,), float("inf")).scatter_reduce(0, ids, scores, reduce="amin")  # (G,)
    varied = high > low  # (G,)
    return varied[ids], varied
