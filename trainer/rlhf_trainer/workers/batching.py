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
    """The sub-batch of `rows`: per-row tensors are indexed, scalars kept."""
    n = int(batch["response_mask"].shape[0])
    out: dict[str, Any] = {}
    for key, value in batch.items():
        if isinstance(value, Tensor) and value.dim() > 0 and value.shape[0] == n:
            out[key] = value[rows]
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
