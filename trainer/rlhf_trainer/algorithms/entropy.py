"""Token entropy of the policy from its logits, in chunks so memory stays bounded.

H(z) = logsumexp(z) - sum_v softmax(z)_v z_v, the entropy of softmax(z). Computing it on the
full (B, T, V) logits at once materialises softmax(z), a second (B, T, V) tensor (gigabytes for
a 150k vocabulary), and autograd would keep it alive until backward. Here rows are processed
`chunk_size` at a time in a custom autograd function: the forward pass keeps only the input
(no copy) and the (B, T) result; the backward pass recomputes softmax chunk by chunk and
writes dH/dz = -p * (z - E_p[z]) (times the incoming gradient) straight into the gradient
tensor autograd needs anyway. Temporaries never exceed (chunk_size, V).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

__all__ = ["entropy_from_logits"]


def _chunk_stats(chunk: Tensor) -> tuple[Tensor, Tensor]:
    """(softmax (N, V), E_p[z] (N,)) of a chunk of rows."""
    probs = torch.softmax(chunk, dim=-1)
    return probs, (probs * chunk).sum(dim=-1)


class _ChunkedEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, rows: Tensor, chunk_size: int) -> Tensor:  # rows: (N, V)
        out = rows.new_empty(rows.shape[0])  # (N,)
        for start in range(0, rows.shape[0], chunk_size):
            chunk = rows[start : start + chunk_size]  # (n, V)
            _, expected = _chunk_stats(chunk)
            out[start : start + chunk_size] = torch.logsumexp(chunk, dim=-1) - expected
        ctx.save_for_backward(rows)
        ctx.chunk_size = chunk_size
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor, None]:  # grad_out: (N,)
        (rows,) = ctx.saved_tensors
        grad = torch.empty_like(rows)  # (N, V)
        for start in range(0, rows.shape[0], ctx.chunk_size):
            chunk = rows[start : start + ctx.chunk_size]  # (n, V)
            probs, expected = _chunk_stats(chunk)
            scale = grad_out[start : start + ctx.chunk_size].unsqueeze(1)  # (n, 1)
            grad[start : start + ctx.chunk_size] = -probs * (chunk - expected.unsqueeze(1)) * scale
        return grad, None


def entropy_from_logits(logits: Tensor, *, chunk_size: int = 1024) -> Tensor:
    """Entropy per position: logits (B, T, V) -> (B, T) (any leading shape works)."""
    if logits.dim() < 2:
        raise ValueError(f"logits must have a vocabulary dimension (..., V), got shape {tuple(logits.shape)}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    leading = logits.shape[:-1]
    rows = logits.reshape(-1, logits.shape[-1])  # (B*T, V), a view for contiguous logits
    entropy: Tensor = _ChunkedEntropy.apply(rows, chunk_size)  # (B*T,)
    return entropy.reshape(leading)  # (B, T)
