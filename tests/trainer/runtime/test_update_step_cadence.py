"""`Algorithm.update_step` runs once per training step, after all of its optimizer steps
(algorithms/base.py states the contract; issue 22: it said once per optimizer step)."""

from __future__ import annotations

import pytest

from .conftest import make_job, read_metrics


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_update_step_runs_once_per_training_step_over_all_its_optimizer_steps(
    tiny_model, ray_session, tmp_path
):
    from runtime_algorithms import RecordingGRPO

    from rlhf_trainer.controller import run

    RecordingGRPO.calls.clear()
    job = make_job(
        algorithm={"name": "runtime_algorithms:RecordingGRPO", "params": {"klCoef": 0.0}},
        training={"steps": 2, "promptsPerStep": 4, "miniBatchSize": 8, "epochsPerBatch": 2},
    )
    run(job, run_dir=tmp_path / "run")
    rows = read_metrics(tmp_path / "run")
    # 16 samples per step, mini-batches of 8, two epochs: 4 optimizer steps, ONE update_step.
    assert [r["actor/optimizer_steps"] for r in rows] == [4.0, 4.0]
    assert RecordingGRPO.calls == [
        {"actor/optimizer_steps": 4.0, "batch/num_samples": 16.0},
        {"actor/optimizer_steps": 4.0, "batch/num_samples": 16.0},
    ]
