"""How a batch is cut into optimizer steps, rank shards and micro-batches (no Ray, no model)."""

from __future__ import annotations

import pytest
import torch

from rlhf_trainer.algorithms.aggregation import aggregate
from rlhf_trainer.workers import batching


def _batch(rows: int, t: int = 5, pairs: bool = False, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    mask = (torch.rand(rows, t, generator=g) > 0.3).float()
    out = {"response_mask": mask, "loss_mat": torch.randn(rows, t, generator=g)}
    if pairs:
        out["pair_index"] = torch.arange(rows) // 2
    return out


@pytest.mark.parametrize(
    "rows,world,micro,mini", [(8, 1, 3, 0), (8, 2, 2, 4), (9, 2, 2, 0), (12, 3, 1, 6), (7, 2, 8, 0)]
)
def test_every_rank_runs_the_same_number_of_micro_batches_and_every_row_once(rows, world, micro, mini):
    batch = _batch(rows)
    steps = batching.minibatches(batch, mini, epochs=2, generator=torch.Generator().manual_seed(0))
    assert len(steps) == 2 * (rows // (mini or rows))
    for step_rows in steps:
        seen, counts = [], set()
        for rank in range(world):
            units, total = batching.shard_for_rank(batch, step_rows, rank, world)
            micros = batching.micro_batches(units, total, world, micro)
            assert all(len(m) > 0 for m in micros)
            counts.add(len(micros))
            seen.extend(torch.cat(micros).tolist())
        assert len(counts) == 1, f"ranks disagree on the micro-batch count: {counts}"
        assert sorted(seen) == sorted(step_rows.tolist())


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
@pytest.mark.parametrize("world,micro", [(1, 2), (2, 1), (3, 2)])
def test_micro_batch_shares_sum_to_the_full_batch_loss(mode, world, micro):
    """DP-correct normalisation: global counts make micro-batch losses add up to the batch loss."""
    batch = _batch(12, seed=world * 10 + micro)
    full = aggregate(batch["loss_mat"], batch["response_mask"], mode=mode)
    rows = torch.arange(12)
    mask = batch["response_mask"]
    norms = {"global_tokens": float(mask.sum()), "global_seqs": float((mask.sum(-1) > 0).sum())}
    total = torch.zeros(())
    for rank in range(world):
        units, n_units = batching.shard_for_rank(batch, rows, rank, world)
        for m in batching.micro_batches(units, n_units, world, micro):
            total += aggregate(batch["loss_mat"][m], mask[m], mode=mode, **norms)
    torch.testing.assert_close(total, full)


def test_pairs_are_never_split():
    batch = _batch(12, pairs=True)
    steps = batching.minibatches(batch, 4, epochs=1, generator=torch.Generator().manual_seed(1))
    for step_rows in steps:
        for rank in range(2):
            units, total = batching.shard_for_rank(batch, step_rows, rank, 2)
            for m in batching.micro_batches(units, total, 2, 1):
                pairs = batch["pair_index"][m]
                assert all((pairs == p).sum() == 2 for p in pairs.unique())


def test_too_few_rows_for_the_ranks_is_a_clear_error():
    batch = _batch(1)
    with pytest.raises(ValueError, match="cannot be shared by 2 ranks"):
        batching.shard_for_rank(batch, torch.arange(1), 0, 2)
