"""write_report: PNG plots and a self-contained report.html from a run's metrics.jsonl."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest

from rlhf_trainer.metrics import JsonlLogger
from rlhf_trainer.report import write_report


def _run(tmp_path: Path, steps: int = 12, hist: bool = False) -> Path:
    run = tmp_path / "quickstart"
    with JsonlLogger(run / "metrics.jsonl") as log:
        for s in range(steps):
            rec: dict[str, Any] = {
                "reward/mean": 0.2 + 0.05 * s,
                "reward/std": 0.1,
                "actor/kl": 0.001 * s,
                "actor/pg_loss": -0.1 * math.sin(s),
                "critic/vf_loss": 1.0 / (s + 1),
                "timing/rollout": 0.5,
                "timing/reward": 0.1,
                "timing/update": 0.3,
                "timing/step": 0.9,
                "perf/tokens_per_second": 100.0 + s,
                "perf/samples_per_second": 50.0,
            }
            if hist:
                rec["reward/hist"] = {"counts": [3, 5], "edges": [0.0, 0.5, 1.0]}
            else:
                rec["reward/scores"] = [0.0, 1.0, 1.0, float(s % 2)]
            log.log(rec, step=s)
    return run


def test_report_files_and_summary(tmp_path: Path) -> None:
    run = _run(tmp_path)
    out = write_report(run)
    assert out == run / "report.html"
    for name in ("reward.png", "kl.png", "loss.png", "reward_hist.png", "timing.png"):
        data = (run / name).read_bytes()
        assert data.startswith(b"\x89PNG") and len(data) > 1000, name
    page = out.read_text()
    assert page.count("data:image/png;base64,") == 5
    assert "<th>first mean reward</th><td>0.2</td>" in page
    assert "<th>last mean reward</th><td>0.75</td>" in page
    assert "<th>steps logged</th><td>12</td>" in page
    assert "<th>mean tokens/s</th><td>105.5</td>" in page


def test_report_with_a_histogram_record_and_missing_metrics(tmp_path: Path) -> None:
    run = tmp_path / "bare"
    with JsonlLogger(run / "metrics.jsonl") as log:
        log.log({"reward/mean": 0.1, "reward/hist": {"counts": [1, 2], "edges": [0, 1, 2]}}, step=0)
    write_report(run)
    assert (run / "reward.png").exists() and (run / "reward_hist.png").exists()
    assert not (run / "kl.png").exists() and not (run / "timing.png").exists()
    hist_run = _run(tmp_path / "h", steps=3, hist=True)
    write_report(hist_run)
    assert (hist_run / "reward_hist.png").exists()


def test_report_errors(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no metrics log"):
        write_report(tmp_path)
    (tmp_path / "metrics.jsonl").write_text("")
    with pytest.raises(ValueError, match="no step records"):
        write_report(tmp_path)
