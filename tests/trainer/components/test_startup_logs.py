"""`startup.start_logging` alone (no Ray, no workers): it opens the run's logs together, the loop
reads them through `Run.opened`, and `teardown` closes them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from rlhf_api.loader import parse_job
from rlhf_trainer.dataflow import DataStream
from rlhf_trainer.dataflow.context import TrainerContext
from rlhf_trainer.startup import LineProgress, Run, RunError, start_logging, teardown


def _run(tmp_path: Path, progress: bool) -> Run:
    doc = {
        "apiVersion": "rlhf.dev/v1alpha1",
        "kind": "RLTrainingJob",
        "metadata": {"name": "logs"},
        "spec": {
            "model": {"path": "m"},
            "data": {"path": "d.jsonl"},
            "reward": {"functions": [{"path": "rlhf_trainer.rewards.builtin:arithmetic_exact"}]},
            "output": {"progress": progress, "report": False, "metricsPort": 0},
        },
    }
    none: Any = None  # the logs need neither a tokenizer, nor prompts, nor an algorithm
    ctx = TrainerContext(parse_job(doc).spec, "logs", tmp_path, none, none, none)
    return Run(ctx=ctx, stream=DataStream(), start_step=0, checkpoint_dir=tmp_path / "checkpoints")


def test_the_logs_open_together_and_teardown_closes_them(tmp_path: Path) -> None:
    r = _run(tmp_path, progress=False)
    with pytest.raises(RunError, match="job logs: the run's logs are not open"):
        r.opened()
    seen: list[int] = []
    start_logging(r, lambda done, total, metrics, checkpoint_step: seen.append(done))
    logs = r.opened()
    assert (tmp_path / "metrics_port").read_text() == f"{logs.server.port}\n" and logs.server.port > 0
    assert logs.progress is None
    logs.steps.log({"reward/mean": 0.5}, step=0)
    assert (tmp_path / "metrics.jsonl").read_text().count("\n") == 1
    assert r.on_status is not None
    r.on_status(1, 1, {}, None)
    assert seen == [1]
    teardown(r)
    with pytest.raises(ValueError, match="is closed"):
        logs.steps.log({"reward/mean": 0.5}, step=1)
    with pytest.raises(ValueError, match="is closed"):
        logs.samples.log({"step": 1})


def test_progress_is_lines_where_stderr_is_no_terminal(tmp_path: Path) -> None:
    r = _run(tmp_path, progress=True)
    start_logging(r, None)
    try:
        assert isinstance(r.opened().progress, LineProgress)  # pytest captures stderr: no tty
    finally:
        teardown(r)
