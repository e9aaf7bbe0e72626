"""Sharded checkpoints and rank-0 loading of FSDP2-sharded roles, on 2 gloo ranks.

* Loading: only rank 0 reads the model; the other rank shards a meta-device skeleton and gets
  its shards by broadcast; the shards equal, bit for bit, those of the loading before (every rank
  loads the full model, then shards); tied weights stay tied.
* Save on 2 ranks with the real publication (`checkpoint.save`), resume in 2 fresh processes: the
  next step is exactly the uninterrupted one (loss, grad norm, every weight, bitwise). Each rank
  reads its own shards only: its AdamW moments are DTensor shards of the local size, and the
  bytes its DCP read asks for are about half the checkpoint's.
* The sharded checkpoint resumes on one rank too (DCP reshards), a gathered (one-rank) checkpoint
  still resumes on two, and `rlhf export` turns a sharded checkpoint into a model directory
  `from_pretrained` loads.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from checkpoint_parts import save_tiny_model

from rlhf_trainer import checkpoint

from . import sharded_ranks as sr

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def _assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert set(a) == set(b)
    for name in a:
        assert torch.equal(a[name], b[name]), name


def _check_loading(saved: list[dict[str, Any]]) -> None:
    for rank, record in enumerate(saved):
        _assert_same(record["loaded"], record["today"])  # bitwise the shards of the full load
        assert record["meta_at_shard"], rank  # sharded as a skeleton: no weights in memory
        assert record["broadcast"]
        assert record["local_at_load"], rank  # memory for the shard alone when the broadcast starts
    assert saved[0]["tensors_given"] > 0
    assert saved[1]["tensors_given"] == 0  # rank 1 never held a full tensor


def _check_resume(
    saved: list[dict[str, Any]], resumed: list[dict[str, Any]], step_dir: Path, role: str
) -> None:
    shards = {p.name: p.stat().st_size for p in (step_dir / role / checkpoint.SHARDS_DIR).glob("*.distcp")}
    assert len(shards) == 2  # one file per rank
    total = sum(shards.values())
    for rank in range(2):
        assert resumed[rank]["metrics"] == saved[rank]["metrics"]  # the exact next step
        _assert_same(resumed[rank]["after"], saved[rank]["after"])  # rank 0 gets the full weights
        shapes = resumed[rank]["optimizer_shapes"]
        assert shapes and all(local[0] == _shard_rows(full[0], rank) for local, full in shapes.values()), (
            shapes
        )
        assert any(full[0] > 1 for _, full in shapes.values())
        read = sum(resumed[rank]["read"].values())
        assert 0 < read < 0.6 * total, (rank, resumed[rank]["read"], shards)


def _shard_rows(rows: int, rank: int, world: int = 2) -> int:
    """The rows of dim 0 FSDP2 gives `rank` (torch.chunk's split: a (1, H) head is all on rank 0)."""
    chunks = torch.arange(rows).chunk(world)
    return len(chunks[rank]) if rank < len(chunks) else 0


@pytest.mark.parametrize("role", ["actor", "critic"])
def test_two_ranks_load_from_rank0_save_shards_and_resume_the_exact_next_step(role, tmp_path):
    model = save_tiny_model(tmp_path / "model")
    saved = sr.spawn(sr._save_rank, role, model, tmp_path / "save.pt")
    _check_loading(saved)
    assert saved[0]["after"] and not saved[1]["after"]  # full weights gathered on rank 0 only
    if role == "actor":
        assert all(r["tied"] for r in saved)
    step_dir = saved[0]["published"]
    assert step_dir == checkpoint.latest(tmp_path / "checkpoints")
    files = checkpoint._read_json(step_dir / checkpoint.COMPLETE)["parts"][role]
    assert {f"dcp/__{r}_0.distcp" for r in range(2)} | {"dcp/.metadata", "state.json"} <= set(files)
    assert "optimizer.safetensors" not in files and "model.safetensors" not in files

    resumed = sr.spawn(sr._resume_rank, role, model, tmp_path / "resume.pt")
    _check_resume(saved, resumed, step_dir, role)

    if role == "actor":  # one rank resumes the 2-rank checkpoint (DCP reshards): the same step
        sr._resume_rank(0, 1, 0, role, str(model), str(tmp_path / "one.pt"))
        one = torch.load(tmp_path / "one.pt.0", weights_only=False)
        assert one["metrics"]["actor/loss"] == pytest.approx(saved[0]["metrics"]["actor/loss"], rel=1e-5)
        for name, value in saved[0]["after"].items():
            torch.testing.assert_close(one["after"][name], value, rtol=1e-5, atol=1e-6)
        _check_export(step_dir, saved[0]["at_save"], tmp_path / "exported")


def _check_export(step_dir: Path, at_save: dict[str, torch.Tensor], out: Path) -> None:
    from transformers import AutoModelForCausalLM

    from rlhf_trainer.cli import main

    assert main(["export", str(step_dir), str(out), "-q"]) == 0
    exported = AutoModelForCausalLM.from_pretrained(out).state_dict()
    assert set(exported) == set(at_save)
    for name, value in at_save.items():
        assert torch.equal(exported[name], value), name


def test_a_gathered_checkpoint_still_resumes_two_sharded_ranks(tmp_path):
    """The layout before sharded checkpoints (and of one rank): 2 ranks read it whole, as before."""
    from checkpoint_parts import make_worker

    model = save_tiny_model(tmp_path / "model")
    worker = make_worker("actor", model)
    worker.spec = sr.spec_for(model)
    rows = sr.batch(worker.model.config.vocab_size)
    worker.train_batch(rows, 0, sr.loss_of(worker))
    step_dir = checkpoint.save(
        tmp_path / "checkpoints", 1, {}, lambda s: {"actor": worker.save(str(s))}, keep=2
    )
    assert (step_dir / "actor" / "optimizer.safetensors").is_file()
    metrics = worker.train_batch(rows, 1, sr.loss_of(worker))
    after = sr.full_weights(worker)
    resumed = sr.spawn(sr._resume_rank, "actor", model, tmp_path / "resume.pt")
    for record in resumed:
        assert record["read"] == {}  # no DCP read: the gathered files
        assert record["metrics"]["actor/loss"] == pytest.approx(metrics["actor/loss"], rel=1e-5)
    assert set(resumed[0]["after"]) == set(after)  # the full weights: on rank 0
    for name, value in after.items():
        torch.testing.assert_close(resumed[0]["after"][name], value, rtol=1e-5, atol=1e-6)
