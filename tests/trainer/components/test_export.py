"""`rlhf export`: a checkpoint's policy as a Hugging Face model directory that from_pretrained
loads and generates with, its weights the checkpoint's, tied weights stored once and tied again."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from checkpoint_parts import make_worker, save_tiny_model
from safetensors import safe_open
from safetensors.torch import load_file

from rlhf_trainer import checkpoint
from rlhf_trainer.cli import main
from rlhf_trainer.export import export_policy


def _checkpoint(root: Path, model_dir: Path, step: int = 2) -> Path:
    actor = make_worker("actor", model_dir)
    return checkpoint.save(root, step, {"data": {}}, lambda s: {"actor": actor.save(str(s))}, keep=2)


@pytest.fixture(scope="module")
def tied_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    base = tmp_path_factory.mktemp("tied")
    return _checkpoint(base / "checkpoints", save_tiny_model(base / "model"))


def _load(out: Path) -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return AutoModelForCausalLM.from_pretrained(out), AutoTokenizer.from_pretrained(out)


def _assert_weights_are_the_checkpoints(model: Any, step_dir: Path) -> None:
    stored = load_file(step_dir / "actor" / "model.safetensors")
    state = model.state_dict()
    assert set(state) == set(stored)
    for name, value in state.items():
        assert torch.equal(value, stored[name]), name


def test_export_loads_generates_and_holds_the_checkpoints_weights(tied_checkpoint, tmp_path):
    out = tmp_path / "model"
    done = export_policy(tied_checkpoint, out, log=None)
    assert done.step == 2 and done.checkpoint == tied_checkpoint
    names = {p.name for p in out.iterdir()}
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json"} <= names
    assert "tokenizer_config.json" in names
    assert not [n for n in tmp_path.iterdir() if n.name.startswith(".")]  # no temp dir left

    model, tok = _load(out)
    _assert_weights_are_the_checkpoints(model, tied_checkpoint)
    # Tied: stored once, under the embedding's name; tied again on load.
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
        assert f.metadata() == {"format": "pt"}
    assert "model.embed_tokens.weight" in keys and "lm_head.weight" not in keys
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()

    ids = tok(["3+4=", "12+5="], return_tensors="pt", padding=True)
    gen = model.generate(**ids, max_new_tokens=5, do_sample=False)
    assert gen.shape[0] == 2 and gen.shape[1] > ids.input_ids.shape[1]
    assert all(isinstance(t, str) for t in tok.batch_decode(gen, skip_special_tokens=True))


def test_untied_model_exports_both_matrices(tmp_path):
    step = _checkpoint(tmp_path / "checkpoints", save_tiny_model(tmp_path / "model", tied=False))
    out = tmp_path / "out"
    export_policy(step, out, log=None)
    model, _ = _load(out)
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert "lm_head.weight" in set(f.keys())
    assert model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr()
    _assert_weights_are_the_checkpoints(model, step)


def test_large_models_are_sharded_with_an_index(tied_checkpoint, tmp_path):
    out = tmp_path / "out"
    export_policy(tied_checkpoint, out, log=None, max_shard_bytes=64 * 1024)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(p.name for p in out.glob("model-*.safetensors"))
    assert len(shards) > 1 and set(index["weight_map"].values()) == set(shards)
    assert not (out / "model.safetensors").exists()
    model, _ = _load(out)
    _assert_weights_are_the_checkpoints(model, tied_checkpoint)


def test_dtype_cast_and_config(tied_checkpoint, tmp_path):
    out = tmp_path / "out"
    export_policy(tied_checkpoint, out, dtype="bfloat16", log=None)
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    stored = load_file(tied_checkpoint / "actor" / "model.safetensors")
    exported = load_file(out / "model.safetensors")
    for name, value in exported.items():
        assert value.dtype == torch.bfloat16
        assert torch.equal(value, stored[name].to(torch.bfloat16)), name


def test_command_line_export_prints_progress_and_refuses_to_overwrite(tied_checkpoint, tmp_path, capsys):
    out = tmp_path / "out"
    # A checkpoint directory names its newest complete checkpoint.
    assert main(["export", str(tied_checkpoint.parent), str(out)]) == 0
    captured = capsys.readouterr()
    assert captured.out.strip() == str(out)
    assert f"exporting the policy of {tied_checkpoint}" in captured.err and "exported" in captured.err
    assert main(["export", str(tied_checkpoint), str(out)]) == 1
    assert "pass --force" in capsys.readouterr().err
    assert main(["export", "-q", "--force", str(tied_checkpoint), str(out)]) == 0
    assert capsys.readouterr().err == ""


def test_paths_that_are_not_checkpoints_name_what_was_expected(tied_checkpoint, tmp_path, capsys):
    missing = tmp_path / "nope"
    assert main(["export", str(missing), str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert f"{missing} does not exist" in err and "expected a complete checkpoint" in err

    partial = tmp_path / "ckpt"
    (partial / ".staging-step-000004-abcd" / "actor").mkdir(parents=True)
    (partial / "step-000006").mkdir()
    assert main(["export", str(partial), str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert (
        "holds no complete checkpoint (only unfinished saves: .staging-step-000004-abcd, step-000006)" in err
    )

    assert main(["export", str(partial / "step-000006"), str(tmp_path / "out")]) == 1
    assert "has no COMPLETE marker" in capsys.readouterr().err


def test_tied_copies_that_differ_are_an_error(tmp_path):
    step = _checkpoint(tmp_path / "checkpoints", save_tiny_model(tmp_path / "model"))
    weights = step / "actor" / "model.safetensors"
    tensors = load_file(weights)
    tensors["lm_head.weight"] = tensors["lm_head.weight"] + 1.0
    from safetensors.torch import save_file

    save_file(tensors, weights)
    # The checkpoint's marker records sizes; same size, so it still counts as complete.
    with pytest.raises(Exception, match=r"model.embed_tokens.weight and lm_head.weight differ"):
        export_policy(step, tmp_path / "out", log=None)


def test_a_run_directory_names_its_checkpoint_dir_through_its_spec(tied_checkpoint, tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "spec.json").write_text(json.dumps({"checkpoint": {"dir": str(tied_checkpoint.parent)}}))
    assert export_policy(run_dir, tmp_path / "out", log=None).checkpoint == tied_checkpoint


def _sharded_checkpoint(root: Path, model_dir: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    """A sharded (DCP) actor part written by one process, as FSDP2 ranks write theirs, and the
    actor's weights at the save."""
    from rlhf_trainer.workers import modeling

    actor = make_worker("actor", model_dir)

    def write(out: Path) -> None:
        modeling.save_sharded(actor.model, actor.optimizer, out / checkpoint.SHARDS_DIR)
        actor.write_model_files(out)

    step = checkpoint.save(root, 3, {}, lambda s: {"actor": checkpoint.write_part(s, "actor", write)}, keep=2)
    return step, {k: v.detach().clone() for k, v in actor.model.state_dict().items()}


def test_a_sharded_checkpoint_exports_to_a_model_from_pretrained_loads(tmp_path):
    step, weights = _sharded_checkpoint(tmp_path / "checkpoints", save_tiny_model(tmp_path / "model"))
    assert not (step / "actor" / "model.safetensors").exists()
    out = tmp_path / "out"
    done = export_policy(step, out, log=None)
    assert done.step == 3
    model, _ = _load(out)
    state = model.state_dict()
    assert set(state) == set(weights)
    for name, value in weights.items():
        assert torch.equal(state[name], value), name
    with safe_open(str(out / "model.safetensors"), "pt") as f:  # tied: stored once, as before
        assert "lm_head.weight" not in set(f.keys())
    assert not any("exp_avg" in name for name in state)


def test_a_sharded_part_without_its_metadata_names_what_is_missing(tmp_path):
    step, _ = _sharded_checkpoint(tmp_path / "checkpoints", save_tiny_model(tmp_path / "model"))
    (step / "actor" / checkpoint.SHARDS_DIR / ".metadata").unlink()
    with pytest.raises(checkpoint.CheckpointError, match=r"\.metadata is missing"):
        export_policy(step, tmp_path / "out", log=None)
