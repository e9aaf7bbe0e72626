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


# -- micro-batches by token budget (`training.maxTokensPerMicroBatch`) -------------------------


def _uneven(rows: int, seed: int = 0, pairs: bool = False) -> dict[str, torch.Tensor]:
    """Left-padded prompts of 1..6 tokens and right-padded responses of 0..12 (a long tail)."""
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(1, 7, (rows,), generator=g)
    response = torch.where(
        torch.rand(rows, generator=g) < 0.25, 12, torch.randint(0, 4, (rows,), generator=g)
    )
    out = {
        "prompt_mask": (torch.arange(6)[None] >= 6 - prompt[:, None]).long(),  # (B, 6)
        "response_mask": (torch.arange(12)[None] < response[:, None]).float(),  # (B, 12)
        "loss_mat": torch.randn(rows, 12, generator=g),
    }
    if pairs:
        out["pair_index"] = torch.arange(rows) // 2
    return out


def test_first_fit_decreasing_keeps_bins_within_the_budget():
    lengths = [9, 2, 30, 5, 5, 1, 8, 12]
    bins = batching.pack_by_tokens(lengths, 12)
    assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
    assert [2] in bins  # longer than the budget: alone
    assert all(sum(lengths[i] for i in b) <= 12 for b in bins if len(b) > 1)
    # longest first, each into the first bin with room: 30 | 12 | 9+2+1 | 8 | 5+5
    assert bins == [[2], [7], [0, 1, 5], [6], [3, 4]]


@pytest.mark.parametrize(
    "rows,world,budget,pairs",
    [(16, 1, 10, False), (16, 2, 14, False), (11, 3, 9, False), (12, 2, 20, True), (5, 2, 4, False)],
)
def test_token_budget_micro_batches_agree_on_the_count_and_hold_every_row_once(rows, world, budget, pairs):
    batch = _uneven(rows, seed=rows + world, pairs=pairs)
    tokens = batching.row_tokens(batch)
    step_rows = torch.randperm(rows, generator=torch.Generator().manual_seed(0))
    seen, counts = [], set()
    for rank in range(world):
        micros = batching.token_micro_batches(batch, step_rows, rank, world, budget)
        counts.add(len(micros))
        units, _ = batching.shard_for_rank(batch, step_rows, rank, world)
        assert sorted(torch.cat(micros).tolist()) == sorted(torch.cat(units).tolist())  # this rank's rows
        for m in micros:
            if len(batching.units_of(batching.select_rows(batch, m))) > 1:  # type: ignore[arg-type]
                assert int(tokens[m].sum()) <= budget
            if pairs:
                p = batch["pair_index"][m]
                assert all((p == q).sum() == 2 for q in p.unique())
        seen.extend(torch.cat(micros).tolist())
    assert len(counts) == 1, f"ranks disagree on the micro-batch count: {counts}"
    assert sorted(seen) == sorted(step_rows.tolist())


def test_a_rank_with_fewer_units_than_the_count_gets_empty_micro_batches():
    batch = _uneven(5)
    batch["prompt_mask"][:3] = 1  # rank 0 (rows 0-2): long rows, one micro-batch each
    batch["response_mask"][:3] = 1.0
    micros = [batching.token_micro_batches(batch, torch.arange(5), r, 2, 8) for r in range(2)]
    assert [len(m) for m in micros[0]] == [1, 1, 1]
    assert sorted(len(m) for m in micros[1]) == [0, 1, 1]


@pytest.mark.parametrize(
    "mode",
    ["token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"],
)
@pytest.mark.parametrize("world,budget", [(1, 8), (2, 12), (3, 5)])
def test_token_budget_micro_batch_shares_sum_to_the_full_batch_loss(mode, world, budget):
    """The cross-rank aggregation above, with micro-batches by token budget (float64, exact to 1e-12)."""
    batch = {k: (v.double() if v.is_floating_point() else v) for k, v in _uneven(14, seed=world).items()}
    mask = batch["response_mask"]
    full = aggregate(batch["loss_mat"], mask, mode=mode)
    norms = {"global_tokens": float(mask.sum()), "global_seqs": float((mask.sum(-1) > 0).sum())}
    total = torch.zeros((), dtype=torch.float64)
    for rank in range(world):
        for m in batching.token_micro_batches(batch, torch.arange(14), rank, world, budget):
            if m.numel():
                total += aggregate(batch["loss_mat"][m], mask[m], mode=mode, **norms)
    torch.testing.assert_close(total, full, atol=1e-12, rtol=0)


def test_select_rows_moves_the_index_to_each_tensors_device():
    """A batch holds tensors on several devices (the model's and the host's); a CUDA index into a
    CPU tensor raises, so the index follows each tensor. Seen here with a `meta` tensor beside a
    CPU one: the index reaching each `__getitem__` is on that tensor's device."""
    seen: list[tuple[str, str]] = []

    class Recording(torch.Tensor):
        @classmethod
        def __torch_function__(cls, func, types, args=(), kwargs=None):
            if func is torch.Tensor.__getitem__:
                seen.append((str(args[0].device), str(args[1].device)))
            return super().__torch_function__(func, types, args, kwargs or {})

    batch = {
        "response_mask": torch.ones(4, 3).as_subclass(Recording),
        "log_probs": torch.empty(4, 3, device="meta").as_subclass(Recording),
        "kl_coef": torch.tensor(0.1),  # a scalar: kept as is
    }
    out = batching.select_rows(batch, torch.tensor([0, 2]))
    assert sorted(seen) == [("cpu", "cpu"), ("meta", "meta")]
    assert out["log_probs"].shape == (2, 3) and out["log_probs"].device.type == "meta"
    assert out["kl_coef"] is batch["kl_coef"]
