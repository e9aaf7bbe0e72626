"""How a batch is cut into mini-batches, data-parallel shards and micro-batches.

Rows are grouped into *units* that must never be split (the two samples of an online-DPO pair;
otherwise each row alone). Every rank of a sharded (FSDP) role must run the same number of
forward/backward passes, so a rank's shard is cut into a fixed number of micro-batches derived
from the largest shard, never into "as many as it needs".
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor


def row_count(batch: dict[str, Tensor]) -> int:
    return int(batch["response_mask"].shape[0])


def select_rows(batch: Mapping[str, Any], rows: Tensor) -> dict[str, Any]:
    """The sub-batch of `rows`: per-row tensors are indexed, scalars kept. The index follows each
    tensor's device (a batch can hold CPU tensors beside the model's; a CUDA index into a CPU
    tensor raises)."""
    n = int(batch["response_mask"].shape[0])
    out: dict[str, Any] = {}
    for key, value in batch.items():
        if isinstance(value, Tensor) and value.dim() > 0 and value.shape[0] == n:
            out[key] = value[rows.to(value.device)]
        else:
            out[key] = value
    return out


def units_of(batch: dict[str, Tensor]) -> list[Tensor]:
    """Row indices of each unit, in order: pairs when `pair_index` is present, else single rows."""
    n = row_count(batch)
    pair_index = batch.get("pair_index")
    if pair_index is None:
        return [torch.tensor([i]) for i in range(n)]
    units: dict[int, list[int]] = {}
    for row, pair in enumerate(pair_index.tolist()):
        units.setdefault(int(pair), []).append(row)
    return [torch.tensor(rows) for rows in units.values()]


def minibatches(
    batch: dict[str, Tensor], mini_batch_rows: int, epochs: int, generator: torch.Generator
) -> list[Tensor]:
    """Row indices of every optimizer step: `epochs` passes, each a shuffled split into mini-batches.

    With one mini-batch per epoch the order is left as is (nothing to shuffle for).
    """
    units = units_of(batch)
    n = row_count(batch)
    per_unit = max(1, n // max(1, len(units)))
    units_per_mini = max(1, (mini_batch_rows or n) // per_unit)
    steps: list[Tensor] = []
    for _ in range(epochs):
        order = list(range(len(units)))
        if units_per_mini < len(units):
            order = torch.randperm(len(units), generator=generator).tolist()
        for start in range(0, len(order), units_per_mini):
            chosen = [units[u] for u in order[start : start + units_per_mini]]
            steps.append(torch.cat(chosen))
    return steps


def shard_for_rank(batch: dict[str, Tensor], rows: Tensor, rank: int, world: int) -> tuple[list[Tensor], int]:
    """This rank's contiguous share of `rows` as whole units (at least one per rank), and the
    number of units over all ranks."""
    sub = select_rows(batch, rows)
    units = units_of(sub)  # type: ignore[arg-type]
    if len(units) < world:
        raise ValueError(
            f"a mini-batch of {len(rows)} rows ({len(units)} units) cannot be shared by {world} ranks; "
            "raise training.miniBatchSize or the batch size, or lower the role's replicas"
        )
    share = torch.tensor_split(torch.arange(len(units)), world)[rank]
    return [rows[units[u]] for u in share.tolist()], len(units)


def micro_batches(
    my_units: list[Tensor], total_units: int, world: int, micro_batch_rows: int
) -> list[Tensor]:
    """Cut this rank's units into micro-batches; every rank gets the same count.

    The count is what the largest shard needs at `micro_batch_rows`, capped by the smallest
    shard's unit count (so no rank gets an empty micro-batch).
    """
    rows_per_unit = max(1, int(my_units[0].numel()))
    per_micro = max(1, micro_batch_rows // rows_per_unit)
    largest, smallest = math.ceil(total_units / world), total_units // world
    count = max(1, min(math.ceil(largest / per_micro), smallest))
    pieces = torch.tensor_split(torch.arange(len(my_units)), count)
    return [torch.cat([my_units[i] for i in idx.tolist()]) for idx in pieces]


# -- micro-batches by token budget (`spec.training.maxTokensPerMicroBatch`) ------------------------


def row_tokens(batch: Mapping[str, Any]) -> Tensor:
    """Real tokens of each row, (B,): prompt tokens plus response tokens (the model's and, in a
    multi-turn episode, the environment's: `rollout.batch.real_response_mask`)."""
    from rlhf_trainer.rollout.batch import real_response_mask

    real = real_response_mask(batch["response_mask"], batch.get("observation_mask"))
    return batch["prompt_mask"].gt(0).sum(-1) + real.sum(-1)  # (B,)


def pack_by_tokens(lengths: list[int], budget: int) -> list[list[int]]:
    """First-fit decreasing: indices of `lengths` grouped into bins of at most `budget` tokens,
    longest first; an item longer than `budget` gets a bin of its own. Deterministic (ties by index)."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    bins: list[list[int]] = []
    room: list[int] = []
    for i in order:
        for b, left in enumerate(room):
            if lengths[i] <= left:
                bins[b].append(i)
                room[b] -= lengths[i]
                break
        else:
            bins.append([i])
            room.append(budget - lengths[i])
    return bins


def _split_to(bins: list[list[int]], lengths: list[int], count: int) -> list[list[int]]:
    """Split the bins holding several items (the heaviest first) until there are `count` of them,
    or no bin can be split: a split bin's halves each hold fewer tokens, so the budget still holds."""
    bins = [list(b) for b in bins]
    while len(bins) < count:
        splittable = [b for b in range(len(bins)) if len(bins[b]) > 1]
        if not splittable:
            break
        b = max(splittable, key=lambda k: (sum(lengths[i] for i in bins[k]), -k))
        items = bins.pop(b)
        bins[b:b] = [items[::2], items[1::2]]  # items are longest first: halves of similar weight
    return bins


def token_micro_batches(
    batch: Mapping[str, Any], rows: Tensor, rank: int, world: int, budget: int
) -> list[Tensor]:
    """This rank's micro-batches of an optimizer step's `rows` by token budget.

    Every rank shards `rows` as `shard_for_rank` does and packs its units (`pack_by_tokens`, a unit
    weighing its rows' real tokens); all ranks compute every rank's packing, so they agree on the
    count without a collective: the largest. A rank with fewer bins splits its fullest ones; one
    that still has too few (fewer units than the count) gets empty micro-batches (`numel() == 0`),
    which `TrainableWorker.train_batch` runs as a zero-weight pass for FSDP's collectives."""
    tokens = row_tokens(select_rows(batch, rows))  # (R,), in the order of `rows`
    by_row = {int(r): int(n) for r, n in zip(rows.tolist(), tokens.tolist())}
    shards: list[list[Tensor]] = []
    packs: list[list[list[int]]] = []
    for r in range(world):
        units, _ = shard_for_rank(batch, rows, r, world)  # type: ignore[arg-type]
        lengths = [sum(by_row[int(i)] for i in u.tolist()) for u in units]
        shards.append(units)
        packs.append(pack_by_tokens(lengths, budget))
    count = max(len(p) for p in packs)
    units = shards[rank]
    lengths = [sum(by_row[int(i)] for i in u.tolist()) for u in units]
    bins = _split_to(packs[rank], lengths, count)
    micros = [torch.cat([units[i] for i in b]) for b in bins]
    empty = torch.zeros(0, dtype=rows.dtype)
    return micros + [empty] * (count - len(micros))
