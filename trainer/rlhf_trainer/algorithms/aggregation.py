"""Loss aggregation: a masked `(B, T)` loss matrix -> one scalar.

Every mode has the signature::

    agg(loss_mat, response_mask, *, global_tokens=None, global_seqs=None, norm_length=None) -> Tensor

`loss_mat` and `response_mask` are `(B, T)`. Let `L[i, t]` be the loss, `m[i, t]` the mask,
`n_i = sum_t m[i, t]` the valid tokens of row i, N the valid tokens of the batch and S the
sequences with at least one valid token (a fully masked row is not a sequence: it adds nothing
to any numerator or denominator).

| mode | value | used by |
|---|---|---|
| `token-mean` | sum_it m L / N | PPO default (verl, OpenRLHF "token level loss") |
| `token-sum` | sum_it m L | |
| `seq-mean-token-sum` | (1/S) sum_i sum_t m L | |
| `seq-mean-token-mean` | (1/S) sum_i (1/n_i) sum_t m L | original GRPO, GSPO, OpenRLHF sample-level loss |
| `seq-mean-token-sum-norm` | (1/S) sum_i sum_t m L / norm_length | Dr.GRPO (Liu et al. 2025, arXiv:2503.20783) |

`seq-mean-token-sum-norm` follows the Dr.GRPO paper: token sums divided by a constant length
(`norm_length`, default the padded length T; set it to the generation budget so it is the same
for every micro-batch), then averaged over sequences. verl's mode of that name leaves out the
1/S and relies on its gradient-accumulation scaling instead.

Data parallelism and micro-batching
-----------------------------------
Without normalizers, N and S are counted on the tensors given, so each micro-batch gets its
own mean and the mean of those means is *not* the full-batch mean when micro-batches hold
different numbers of tokens. Pass the full step's counts instead — `global_tokens` (N) and
`global_seqs` (S) summed over all micro-batches of all data-parallel ranks (see
`masking.count_normalizers`) — and each call returns that micro-batch's *share* of the
full-batch loss: summing the returned values over micro-batches and ranks gives exactly the
full-batch value. Concretely, backpropagate each micro-batch's value as is (gradients
accumulate as a sum) and all-reduce gradients with a SUM; with a MEAN all-reduce (DDP/FSDP
default) multiply the loss by the data-parallel world size first.
"""

from __future__ import annotations

from torch import Tensor

from .masking import check_mask, check_same_shape, masked_sum
from .registry import LOSS_AGGREGATIONS

__all__ = ["aggregate"]


def _count(local: Tensor, given: float | Tensor | None, what: str) -> Tensor | float:
    """The normalizer: the global count when given, else the local one; never below 1."""
    if given is None:
        return local.clamp(min=1)
    value = float(given)
    if value < 0:
        raise ValueError(f"{what} must be >= 0, got {value}")
    return max(value, 1.0)


def _prepare(loss_mat: Tensor, response_mask: Tensor) -> Tensor:
    response_mask = check_mask(response_mask)
    check_same_shape(loss_mat=loss_mat, response_mask=response_mask)
    return response_mask


def _sequence_count(response_mask: Tensor) -> Tensor:
    return (response_mask.sum(dim=1) > 0).to(response_mask.dtype).sum()


@LOSS_AGGREGATIONS.register("token-mean")
def token_mean(
    loss_mat: Tensor,
    response_mask: Tensor,
    *,
    global_tokens: float | Tensor | None = None,
    global_seqs: float | Tensor | None = None,
    norm_length: float | None = None,
) -> Tensor:
    """sum of valid losses / valid tokens (N = `global_tokens` when given)."""
    response_mask = _prepare(loss_mat, response_mask)
    return masked_sum(loss_mat, response_mask) / _count(response_mask.sum(), global_tokens, "global_tokens")


@LOSS_AGGREGATIONS.register("token-sum")
def token_sum(
    loss_mat: Tensor,
    response_mask: Tensor,
    *,
    global_tokens: float | Tensor | None = None,
    global_seqs: float | Tensor | None = None,
    norm_length: float | None = None,
) -> Tensor:
    """sum of valid losses (already additive across micro-batches; normalizers are unused)."""
    response_mask = _prepare(loss_mat, response_mask)
    return masked_sum(loss_mat, response_mask)


@LOSS_AGGREGATIONS.register("seq-mean-token-sum")
def seq_mean_token_sum(
    loss_mat: Tensor,
    response_mask: Tensor,
    *,
    global_tokens: float | Tensor | None = None,
    global_seqs: float | Tensor | None = None,
    norm_length: float | None = None,
) -> Tensor:
    """Per-sequence token sums, averaged over non-empty sequences (S = `global_seqs` when given)."""
    response_mask = _prepare(loss_mat, response_mask)
    seq_sums = masked_sum(loss_mat, response_mask, dim=1)  # (B,)
    return seq_sums.sum() / _count(_sequence_count(response_mask), global_seqs, "global_seqs")


@LOSS_AGGREGATIONS.register("seq-mean-token-mean")
def seq_mean_token_mean(
    loss_mat: Tensor,
    response_mask: Tensor,
    *,
    global_tokens: float | Tensor | None = None,
    global_seqs: float | Tensor | None = None,
    norm_length: float | None = None,
) -> Tensor:
    """Per-sequence token means, averaged over non-empty sequences (S = `global_seqs` when given)."""
    response_mask = _prepare(loss_mat, response_mask)
    seq_means = masked_sum(loss_mat, response_mask, dim=1) / response_mask.sum(dim=1).clamp(min=1)  # (B,)
    return seq_means.sum() / _count(_sequence_count(response_mask), global_seqs, "global_seqs")


@LOSS_AGGREGATIONS.register("seq-mean-token-sum-norm")
def seq_mean_token_sum_norm(
    loss_mat: Tensor,
    response_mask: Tensor,
    *,
    global_tokens: float | Tensor | None = None,
    global_seqs: float | Tensor | None = None,
    norm_length: float | None = None,
) -> Tensor:
    """Per-sequence token sums / `norm_length` (default T), averaged over non-empty sequences."""
    response_mask = _prepare(loss_mat, response_mask)
    length = float(loss_mat.shape[1]) if norm_length is None else float(norm_length)
    if length <= 0:
        raise ValueError(f"norm_length must be > 0, got {norm_length}")
    seq_sums = masked_sum(loss_mat, response_mask, dim=1)  # (B,)
    return seq_sums.sum() / (_count(_sequence_count(response_mask), global_seqs, "global_seqs") * length)


def aggregate(
    loss_mat: Tensor,
    response_mask: Tensor,
    mode: str = "token-mean",
    *,
    global_tokens: float | Tensor | None = None,
    global_seqs: float | Tensor | None = None,
    norm_length: float | None = None,
) -> Tensor:
    """Aggregate `loss_mat` (B, T) with the registered mode `mode` (or an import path to one)."""
    fn = LOSS_AGGREGATIONS.get(mode)
    return fn(  # type: ignore[no-any-return]
        loss_mat, response_mask, global_tokens=global_tokens, global_seqs=global_seqs, norm_length=norm_length
    )
