"""Checkpoints: published step directories, retention, latest-complete lookup, optimizer state round trip
(the shared-volume protocol itself: test_checkpoint_shared.py)."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch

from rlhf_trainer import checkpoint
from rlhf_trainer.workers.training import flatten_optimizer_state, unflatten_optimizer_state


def _actor(staging: Path) -> dict[str, checkpoint.PartInfo]:
    """A stand-in for actor rank 0: one file, then the part marker."""
    return {
        "actor": checkpoint.write_part(
            staging, "actor", lambda d: (d / "model.safetensors").write_bytes(b"x")
        )
    }


def test_save_keeps_the_newest_and_latest_ignores_incomplete(tmp_path):
    for step in (2, 4, 6):
        checkpoint.save(tmp_path, step, {"data": {"pos": step}}, _actor, keep=2)
    assert [s for s, _ in checkpoint.checkpoint_dirs(tmp_path)] == [4, 6]
    assert checkpoint.parts(tmp_path / "step-000006") == ["actor", "controller"]
    # A run killed mid-write leaves a staging dir, or a step dir without its COMPLETE marker.
    (tmp_path / ".staging-step-000008-abc").mkdir()
    (tmp_path / "step-000010").mkdir()
    (tmp_path / "step-000012").mkdir()  # the layout before role parts: ignored, never deleted
    (tmp_path / "step-000012" / checkpoint.STATE_FILE).write_text("{}")
    assert checkpoint.latest(tmp_path) == tmp_path / "step-000006"
    checkpoint.save(tmp_path, 8, {}, _actor, keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-000006", "step-000008", "step-000012"]


def test_failed_write_leaves_no_checkpoint(tmp_path):
    def boom(_: Path) -> dict[str, Any]:
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        checkpoint.save(tmp_path, 2, {}, boom, keep=1)
    assert checkpoint.latest(tmp_path) is None
    assert not list(tmp_path.iterdir())


def test_controller_rng_state_round_trips(tmp_path):
    random.seed(3)
    torch.manual_seed(3)
    path = checkpoint.save(tmp_path, 1, {"algorithm": {"kl_coef": 0.1}}, _actor, keep=1)
    expected = (random.random(), torch.rand(3))
    random.seed(99)
    torch.manual_seed(99)
    state = checkpoint.load_state(path)
    assert state["step"] == 1 and state["algorithm"] == {"kl_coef": 0.1}
    assert random.random() == expected[0]
    assert torch.equal(torch.rand(3), expected[1])


def test_optimizer_state_flattens_and_restores():
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(4, 3)).sum().backward()
    opt.step()
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    state: Any = get_optimizer_state_dict(model, opt)
    tensors, meta = flatten_optimizer_state(state)
    back = unflatten_optimizer_state(tensors, meta)
    for name, entries in state["state"].items():
        for key, value in entries.items():
            torch.testing.assert_close(back["state"][name][key], value)
    assert back["param_groups"][0]["betas"] == state["param_groups"][0]["betas"]


def test_rank0_missing_a_ranks_shard_file_names_the_file_and_the_hosts(tmp_path):
    """A sharded part: rank 0 must see every file DCP's metadata names, at its full length."""
    from types import SimpleNamespace

    (tmp_path / "__0_0.distcp").write_bytes(b"x" * 10)
    (tmp_path / "__1_0.distcp").write_bytes(b"x" * 4)
    info = SimpleNamespace
    metadata = SimpleNamespace(
        storage_data={
            "a": info(relative_path="__0_0.distcp", offset=0, length=10),
            "b": info(relative_path="__1_0.distcp", offset=0, length=4),
        }
    )
    assert checkpoint.shards_problem(tmp_path, metadata, ["pod-a", "pod-b"]) is None
    metadata.storage_data["c"] = info(relative_path="__1_0.distcp", offset=4, length=6)
    problem = checkpoint.shards_problem(tmp_path, metadata, ["pod-a", "pod-b"])
    assert problem and "__1_0.distcp has 4 bytes, its ranks wrote 10" in problem and "pod-a, pod-b" in problem
    del metadata.storage_data["c"]
    metadata.storage_data["d"] = info(relative_path="__2_0.distcp", offset=0, length=1)
    assert "__2_0.distcp is missing" in (checkpoint.shards_problem(tmp_path, metadata, ["h"]) or "")
