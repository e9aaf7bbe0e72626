"""A job recreated under the same name does not resume its predecessor's checkpoints: the
checkpoint directory names the job (UID) that runs from it, and another job's run refuses to start,
saying how to start fresh or resume on purpose. Real checkpoints (`checkpoint.save`)."""

from __future__ import annotations

from pathlib import Path

import pytest
from operator_helpers import job

from rlhf_api import contract
from rlhf_api.loader import parse_job
from rlhf_operator import children
from rlhf_trainer import checkpoint, checkpoint_owner
from rlhf_trainer.startup import RunError, setup

OLD, NEW = "0b6b7a34-8c1e-4a8f-9d2e-5f4c3b2a1908", "7d1f0c55-2b3a-4e6d-8f90-a1b2c3d4e5f6"


def _written_by(root: Path, uid: str) -> None:
    checkpoint.save(root, 4, {"step": 4}, lambda staging: {}, keep=2)
    checkpoint_owner.claim(root, uid, "grpo")


def test_a_new_job_refuses_its_predecessors_checkpoints(tmp_path: Path) -> None:
    _written_by(tmp_path, OLD)
    why = checkpoint_owner.refusal(tmp_path, NEW, "grpo", resume=True)
    assert why is not None
    assert f"(uid {OLD}), not of job grpo (uid {NEW})" in why
    assert "another spec.checkpoint.dir" in why and "spec.checkpoint.resume: false" in why
    assert f"delete {tmp_path / 'JOB'}" in why


def test_what_may_run_from_the_directory(tmp_path: Path) -> None:
    _written_by(tmp_path, OLD)
    assert checkpoint_owner.refusal(tmp_path, OLD, "grpo", resume=True) is None  # its own restart
    assert checkpoint_owner.refusal(tmp_path, NEW, "grpo", resume=False) is None  # fresh on purpose
    assert checkpoint_owner.refusal(tmp_path, "", "grpo", resume=True) is None  # outside a pod
    (tmp_path / "JOB").unlink()  # resumed on purpose (or an earlier release's directory)
    assert checkpoint_owner.refusal(tmp_path, NEW, "grpo", resume=True) is None
    empty = tmp_path / "empty"
    checkpoint_owner.claim(empty, OLD, "grpo")
    assert checkpoint_owner.refusal(empty, NEW, "grpo", resume=True) is None  # nothing to resume
    checkpoint_owner.claim(empty, NEW, "grpo")
    assert checkpoint_owner.owner(empty) == NEW


def test_the_controller_pod_is_told_its_jobs_uid() -> None:
    doc = job()
    doc["metadata"]["uid"] = NEW
    parsed = parse_job(doc)
    env = {
        e["name"]: e.get("value")
        for e in children.build_pod(parsed, "controller")["spec"]["containers"][0]["env"]
    }
    assert env[contract.ENV_JOB_UID.name] == NEW
    actor = children.build_pod(parsed, "actor")["spec"]["containers"][0]["env"]
    assert contract.ENV_JOB_UID.name not in {e["name"] for e in actor}


def test_the_run_stops_before_the_model_loads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`startup.setup` refuses before it loads the model (here a path that does not exist:
    reached, it would raise FileNotFoundError) or starts Ray."""
    ckpt = tmp_path / "ckpt"
    _written_by(ckpt, OLD)
    monkeypatch.setenv(contract.ENV_JOB_UID.name, NEW)
    spec = parse_job(job()).spec
    spec.checkpoint.dir = str(ckpt)
    with pytest.raises(RunError, match=f"uid {OLD}"):
        setup("grpo", spec, tmp_path / "out", None, None, None, None)
    monkeypatch.setenv(contract.ENV_JOB_UID.name, OLD)  # the same job: on to the model
    with pytest.raises(FileNotFoundError, match="model.path"):
        setup("grpo", spec, tmp_path / "out", None, None, None, None)
