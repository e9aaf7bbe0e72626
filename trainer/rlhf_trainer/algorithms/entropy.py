"""Token entropy of the policy from its logits, in chunks so memory stays bounded.

H = logsumexp(z) - sum_v softmax(z)_v z_v, the entropy of softmax(z). Computing it on the full
(B, T, V) logits at once materialises softmax(z), a second (B, T, V) tensor (gigabytes for a
150k vocabulary). Here the rows are processed `chunk_size` at a time, so the only temporaries
are (chunk_size, V); under autograd each chunk is recomputed in the backward pass
(activation checkpointing) instead of keeping every chunk's softmax alive.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint

__all__ = ["entropy_from_logits"]


def _entropy_rows(logits: Tensor) -> Tensor:
    """(N, V) -> (N,)."""
    probs = torch.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - (probs * logits).sum(dim=-1)


def entropy_from_logits(logits: Tensor, *, chunk_size: int = 1024) -> Tensor:
    """Entropy per position: logits (B, T, V) -> (B, T) (any leading shape works)."""
    if logits.dim() < 2:
        raise ValueError(f"logits must have a vocabulary dimension (..., V), got shape {tuple(logits.shape)}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    leading = logits.shape[:-1]
    rows = logits.reshape(-1, logits.shape[-1])  # (B*T, V), a view for contiguous logits
    keep_graph = torch.is_grad_enabled() and logits.requires_grad
    parts = []
    for start in range(0, rows.shape[0], chunk_size):
        chunk = rows[start : start + chunk_size]  # (chunk, V)
        if keep_graph:
            parts.append(checkpoint(_entropy_rows, chunk, use_reentrant=False))
        else:
            parts.append(_entropy_rows(chunk))
    if not parts:
        return logits.new_zeros(leading)
    return torch.cat(parts).reshape(leading)  # (B, T)
