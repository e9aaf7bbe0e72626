"""ConditionalUpdateOperator's one update: the branches' rows merged into one batch, each row
trained by its branch's loss (no Ray, no model: real algorithms on hand-made tensors)."""

from __future__ import annotations

import pytest
import torch

from rlhf_trainer.algorithms import build_algorithm
from rlhf_trainer.dataflow import StepBatch
from rlhf_trainer.dataflow.phases import merge_branches
from rlhf_trainer.workers import batching
from rlhf_trainer.workers.training import UpdateBranch, branch_losses, step_normalizers

T = 5


def _part(rows: int, seed: int, dpo: bool) -> StepBatch:
    g = torch.Generator().manual_seed(seed)
    mask = (torch.rand(rows, T, generator=g) > 0.25).float()
    mask[:, 0] = 1.0
    tensors = {
        "response_mask": mask,
        "old_log_probs": -torch.rand(rows, T, generator=g) * mask,
        "group_index": torch.arange(rows) // 2 + 10 * seed,
        "scores": torch.rand(rows, generator=g),
    }
    if dpo:
        tensors["ref_log_probs"] = -torch.rand(rows, T, generator=g) * mask
        tensors["chosen"] = torch.arange(rows) % 2 == 0
        tensors["pair_index"] = tensors["group_index"].clone()
    else:
        tensors["advantages"] = torch.randn(rows, T, generator=g) * mask
    return StepBatch(tensors=tensors, prompts=["p"] * rows, responses=["r"] * rows, columns=[{}] * rows)


def test_merge_fills_what_a_branch_lacks_and_labels_each_row():
    pg, dpo = _part(4, 1, dpo=False), _part(6, 2, dpo=True)
    merged, fillers = merge_branches([("true", pg), ("false", dpo)])
    assert merged["branch_index"].tolist() == [0] * 4 + [1] * 6
    assert fillers == [("chosen", "pair_index", "ref_log_probs"), ("advantages",)]
    # rows without a pair are single units; the DPO pairs stay whole
    units = sorted(len(u) for u in batching.units_of(merged.tensors))
    assert units == [1, 1, 1, 1, 2, 2, 2]
    assert not merged["chosen"][:4].any() and merged["advantages"][4:].abs().sum() == 0
    assert len(merged.prompts) == 10


@pytest.mark.parametrize("micro_rows", [10, 3, 1])
def test_each_row_is_trained_by_its_branch_loss_normalised_over_its_branch(micro_rows):
    """Summed over micro-batches, the merged loss and its gradient are the two branch losses,
    each over its own rows with its own normalizers, added."""
    pg, dpo = _part(4, 1, dpo=False), _part(6, 2, dpo=True)
    merged, fillers = merge_branches([("true", pg), ("false", dpo)])
    algos = [
        build_algorithm("grpo", {"klCoef": 0.0, "lossAggMode": "seq-mean-token-mean"}),
        build_algorithm("online_dpo", {"beta": 0.2}),
    ]
    branches = [
        UpdateBranch("grpo", {}, {}, label="true", filler_keys=fillers[0]),
        UpdateBranch("online_dpo", {}, {}, label="false", filler_keys=fillers[1]),
    ]
    log_probs = (merged["old_log_probs"] + 0.1 * torch.randn(10, T)).requires_grad_(True)
    batch = {**merged.tensors, "log_probs": log_probs}
    norms = step_normalizers(batch, torch.arange(10), 2)

    def loss_of(algo, micro):
        return algo.compute_loss(micro)

    total = torch.zeros(())
    metric_keys: set[str] = set()
    units = batching.units_of(batch)
    for micro in batching.micro_batches(units, len(units), 1, micro_rows):
        out = branch_losses(
            {**batching.select_rows(batch, micro), **norms}, branches, algos, loss_of, "actor"
        )
        total = total + out["loss"]
        metric_keys |= {k for k in out if k not in ("loss", "metric_tokens")}
    (grad,) = torch.autograd.grad(total, log_probs)

    lp = log_probs.detach().clone().requires_grad_(True)
    expected = torch.zeros(())
    for k, part in enumerate((pg, dpo)):
        rows = torch.nonzero(merged["branch_index"] == k).squeeze(-1)
        own = {key: v for key, v in part.tensors.items()}
        own["log_probs"] = lp[rows]
        expected = expected + algos[k].compute_loss(own)["loss"]  # local counts = the branch's counts
    (expected_grad,) = torch.autograd.grad(expected, lp)
    torch.testing.assert_close(total, expected)
    torch.testing.assert_close(grad, expected_grad)
    assert {
        "true/actor/pg_loss",
        "true/actor/loss",
        "false/actor/dpo_loss",
        "false/actor/loss",
    } <= metric_keys
    assert not any(k.startswith("false/actor/pg") for k in metric_keys)  # a DPO row never sees the PG loss


def test_a_branch_never_sees_the_keys_other_branches_brought():
    """GRPO with klCoef 0 would report a KL against zeros if the DPO branch's `ref_log_probs`
    filler reached it."""
    pg, dpo = _part(4, 1, dpo=False), _part(6, 2, dpo=True)
    merged, fillers = merge_branches([("a", pg), ("b", dpo)])
    seen: list[set[str]] = []

    def loss_of(algo, micro):
        seen.append(set(micro))
        return {"loss": micro["log_probs"].sum()}

    batch = {**merged.tensors, "log_probs": merged["old_log_probs"].clone().requires_grad_(True)}
    branches = [UpdateBranch("x", {}, {}, "a", fillers[0]), UpdateBranch("y", {}, {}, "b", fillers[1])]
    branch_losses(
        {**batch, **step_normalizers(batch, torch.arange(10), 2)}, branches, [None, None], loss_of, "actor"
    )
    assert "ref_log_probs" not in seen[0] and "chosen" not in seen[0] and "advantages" in seen[0]
    assert "advantages" not in seen[1] and "ref_log_probs" in seen[1]
    assert all("branch_index" not in s for s in seen)
