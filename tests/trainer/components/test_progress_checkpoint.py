"""The controller's progress writes name the step of the last checkpoint: the one saved, or the
one the run resumed from; none before any. `Run.checkpoint_step` holds the fact (set where a
checkpoint is saved or loaded) and the loop's last phase hands it to the status callback, after
the step's checkpoint. No Ray, no workers: the controller's part of a checkpoint only."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rlhf_api.loader import parse_job
from rlhf_trainer.controller import report_progress, save_checkpoint_if_due
from rlhf_trainer.dataflow import DataStream
from rlhf_trainer.dataflow.context import TrainerContext
from rlhf_trainer.startup import Run, maybe_resume


class State:
    """A dataset or algorithm position: what a checkpoint saves and a resume loads."""

    def __init__(self) -> None:
        self.loaded: dict[str, Any] | None = None

    def state_dict(self) -> dict[str, Any]:
        return {"position": 1}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.loaded = state


def _run(tmp_path: Path) -> Run:
    doc = {
        "apiVersion": "rlhf.dev/v1alpha1",
        "kind": "RLTrainingJob",
        "metadata": {"name": "ckpt"},
        "spec": {
            "model": {"path": "m"},
            "data": {"path": "d.jsonl"},
            "reward": {"functions": [{"path": "rlhf_trainer.rewards.builtin:arithmetic_exact"}]},
            "training": {"steps": 5},
            "checkpoint": {"every": 2},
        },
    }
    none: Any = None
    ctx = TrainerContext(parse_job(doc).spec, "ckpt", tmp_path, none, State(), State())  # type: ignore[arg-type]
    ctx.actor = none  # no trained role writes a part: the controller's part alone
    return Run(ctx=ctx, stream=DataStream(), start_step=0, checkpoint_dir=tmp_path / "checkpoints")


def test_each_status_write_names_the_last_checkpoint(tmp_path: Path) -> None:
    r = _run(tmp_path)
    seen: list[tuple[int, int | None]] = []
    r.on_status = lambda done, total, metrics, checkpoint_step: seen.append((done, checkpoint_step))
    for done in range(1, 6):
        save_checkpoint_if_due(r, done)  # every 2 steps and the last
        report_progress(r, done, {})
    assert seen == [(1, None), (2, 2), (3, 2), (4, 4), (5, 5)]


def test_a_resumed_run_reports_the_checkpoint_it_resumed_from(tmp_path: Path) -> None:
    first = _run(tmp_path)
    for done in (1, 2, 3):
        save_checkpoint_if_due(first, done)
    resumed = _run(tmp_path)
    assert resumed.checkpoint_step is None
    assert maybe_resume(resumed, True) == 2
    assert resumed.checkpoint_step == 2
    fresh = _run(tmp_path)
    assert maybe_resume(fresh, False) == 0 and fresh.checkpoint_step is None  # --no-resume: none yet
