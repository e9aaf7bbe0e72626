"""Checkpoints on a shared volume: each role's rank 0 writes its part from its own process (a pod),
the controller publishes; a save interrupted anywhere is ignored on resume and cleaned up.

Pods are simulated by subprocesses with their own working and temp directories: the only path
they share with the controller (this process) is the checkpoint directory.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from rlhf_trainer import checkpoint

from .conftest import make_job, read_metrics

PARTS_SCRIPT = Path(__file__).resolve().parents[1] / "checkpoint_parts.py"


def _stub(role: str) -> Any:
    def write(d: Path) -> None:
        (d / "model.safetensors").write_bytes(role.encode() * 100)

    return lambda staging: checkpoint.write_part(staging, role, write)


def _stub_roles(staging: Path) -> dict[str, checkpoint.PartInfo]:
    return {role: _stub(role)(staging) for role in ("actor", "critic")}


def _interrupted_save(root: Path, step: int, where: str) -> None:
    """`checkpoint.save` in a subprocess that dies (os._exit, no cleanup) at `where`:
    `between-roles` (the actor's part is written, the critic's never), `before-marker`
    (the step directory is renamed into place, its COMPLETE marker never written)."""
    code = textwrap.dedent(
        f"""
        import os
        from pathlib import Path
        from rlhf_trainer import checkpoint

        def roles(staging):
            def part(role):
                return checkpoint.write_part(staging, role, lambda d: (d / "model.safetensors").write_bytes(b"x"))

            info = {{"actor": part("actor")}}
            if {where!r} == "between-roles":
                os._exit(9)
            return {{**info, "critic": part("critic")}}

        write_json = checkpoint._write_json
        def dying_write_json(path, value):
            if path.name == checkpoint.COMPLETE and {where!r} == "before-marker":
                os._exit(9)
            write_json(path, value)
        checkpoint._write_json = dying_write_json
        checkpoint.save({str(root)!r}, {step}, {{}}, roles, keep=5)
        """
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 9, res.stderr


def test_interrupted_saves_are_ignored_on_resume_and_removed_by_the_next_save(tmp_path):
    root = tmp_path / "volume"
    checkpoint.save(root, 2, {"data": {"position": 8}}, _stub_roles, keep=5)

    _interrupted_save(root, 4, "between-roles")
    staged = [p for p in root.iterdir() if p.name.startswith(".staging-step-000004-")]
    assert len(staged) == 1 and (staged[0] / "actor" / checkpoint.PART_MARKER).is_file()
    assert not (staged[0] / "critic").exists()
    assert checkpoint.latest(root) == root / "step-000002"

    _interrupted_save(root, 6, "before-marker")  # (its save removed the staging dir above)
    assert (root / "step-000006" / "critic").is_dir() and not (
        root / "step-000006" / checkpoint.COMPLETE
    ).exists()
    assert checkpoint.latest(root) == root / "step-000002"

    # A copy on a file system without atomic renames, cut short: marker there, a file truncated.
    shutil.copytree(root / "step-000002", root / "step-000008")
    with (root / "step-000008" / "actor" / "model.safetensors").open("r+b") as f:
        f.truncate(10)
    assert "has 10 bytes, its marker says 500" in (checkpoint.complete_problem(root / "step-000008") or "")

    assert checkpoint.latest(root) == root / "step-000002"
    assert checkpoint.load_state(checkpoint.latest(root))["data"] == {"position": 8}

    checkpoint.save(root, 10, {}, _stub_roles, keep=5)
    assert sorted(p.name for p in root.iterdir()) == ["step-000002", "step-000010"]


def test_two_roles_in_their_own_processes_and_dirs_make_one_checkpoint(tmp_path):
    from checkpoint_parts import digest, make_worker, save_tiny_model

    model_dir = save_tiny_model(tmp_path / "model")
    root = tmp_path / "volume"
    reports: dict[str, Any] = {}

    def pods(staging: Path) -> dict[str, checkpoint.PartInfo]:
        procs = {}
        for seed, role in enumerate(("actor", "critic"), start=1):
            pod = tmp_path / f"pod-{role}"
            (pod / "tmp").mkdir(parents=True)
            env = {**os.environ, "TMPDIR": str(pod / "tmp")}
            cmd = [sys.executable, str(PARTS_SCRIPT), role, str(model_dir), str(staging), str(seed)]
            procs[role] = subprocess.Popen(
                cmd, cwd=pod, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE
            )
        for role, proc in procs.items():
            out, err = proc.communicate(timeout=300)
            assert proc.returncode == 0, err.decode()[-3000:]
            reports[role] = json.loads(out.decode().strip().splitlines()[-1])
        return {role: r["info"] for role, r in reports.items()}

    step_dir = checkpoint.save(root, 3, {"data": {"position": 12}}, pods, keep=2)

    assert [p.name for p in root.iterdir()] == ["step-000003"]
    assert checkpoint.complete_problem(step_dir) is None
    assert checkpoint.parts(step_dir) == ["actor", "controller", "critic"]
    assert {reports[r]["cwd"] for r in reports} == {str(tmp_path / "pod-actor"), str(tmp_path / "pod-critic")}
    actor_files = json.loads((step_dir / "actor" / checkpoint.PART_MARKER).read_text())["files"]
    assert {"model.safetensors", "optimizer.safetensors", "state.json", "config.json"} <= set(actor_files)
    assert "tokenizer/tokenizer.json" in actor_files
    # What the pods wrote is what fresh workers load (weights, and the optimizer resumes).
    for seed, role in enumerate(("actor", "critic"), start=7):
        worker = make_worker(role, model_dir, seed)
        assert digest(worker) != reports[role]["digest"]
        worker.load(str(step_dir))
        assert digest(worker) == reports[role]["digest"]
        assert worker.optimizer.state_dict()["state"], role
    assert checkpoint.load_state(step_dir)["data"] == {"position": 12}


def test_a_part_the_controller_cannot_see_fails_the_save_naming_the_volume(tmp_path):
    root = tmp_path / "volume"

    def unshared(staging: Path) -> dict[str, checkpoint.PartInfo]:
        private = tmp_path / "pod-disk" / staging.name  # the pod wrote to a disk of its own
        private.mkdir(parents=True)
        return {"actor": _stub("actor")(private)}

    with pytest.raises(
        checkpoint.CheckpointError, match="does not see it.*mounted at the same path in every pod"
    ):
        checkpoint.save(root, 2, {}, unshared, keep=2)
    assert checkpoint.latest(root) is None and not list(root.iterdir())

    with pytest.raises(checkpoint.CheckpointError, match="does not exist on host"):
        checkpoint.write_part(tmp_path / "not-mounted" / ".staging-step-000002-x", "actor", lambda d: None)


def test_startup_probe_names_the_role_that_does_not_see_the_volume(tmp_path):
    root = tmp_path / "volume"
    checkpoint.check_shared(root, {"actor": lambda probe: checkpoint.answer_probe(probe, "actor", 0)})
    assert not list(root.iterdir())

    def elsewhere(probe: str) -> None:  # the pod's own, empty directory at that path
        checkpoint.answer_probe(tmp_path / "pod-disk" / Path(probe).name, "critic", 1)

    with pytest.raises(checkpoint.CheckpointError, match="critic rank 1 .* does not see"):
        checkpoint.check_shared(root, {"critic": elsewhere})
    assert not list(root.iterdir())


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_run_checkpoints_on_the_volume_resumes_past_partial_saves_and_exports(
    tiny_model, ray_session, tmp_path
):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlhf_trainer.controller import run

    volume, run_dir = tmp_path / "volume", tmp_path / "run"
    sections: dict[str, Any] = {"checkpoint": {"dir": str(volume), "every": 1, "keep": 2}}
    summary = run(make_job("shared", **sections), run_dir=run_dir, resume=False)

    assert sorted(p.name for p in volume.iterdir()) == ["step-000001", "step-000002"]
    assert checkpoint.parts(volume / "step-000002") == ["actor", "controller"]
    assert not (run_dir / "checkpoints").exists()
    assert summary.model == run_dir / "final"

    def assert_export_is(step_dir: Path) -> None:
        model = AutoModelForCausalLM.from_pretrained(run_dir / "final")
        stored = load_file(step_dir / "actor" / "model.safetensors")
        for name, value in model.state_dict().items():
            assert torch.equal(value, stored[name]), name
        tok = AutoTokenizer.from_pretrained(run_dir / "final")
        out = model.generate(**tok(["2+3="], return_tensors="pt"), max_new_tokens=4, do_sample=False)
        assert out.shape[1] > 4

    assert_export_is(volume / "step-000002")

    # A later save interrupted twice: staged actor part only; a renamed step without its marker.
    staged = volume / ".staging-step-000003-dead"
    shutil.copytree(volume / "step-000002" / "actor", staged / "actor")
    shutil.copytree(volume / "step-000002", volume / "step-000004")
    (volume / "step-000004" / checkpoint.COMPLETE).unlink()

    summary = run(make_job("shared", training={"steps": 3}, **sections), run_dir=run_dir)
    assert [r["step"] for r in read_metrics(run_dir)] == [0, 1, 2]
    assert summary.steps == 3
    assert sorted(p.name for p in volume.iterdir()) == ["step-000002", "step-000003"]
    assert_export_is(volume / "step-000003")
