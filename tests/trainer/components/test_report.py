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


def test_report_shows_the_evaluation_and_the_last_samples(tmp_path: Path) -> None:
    run = _run(tmp_path, steps=6)
    with JsonlLogger(run / "metrics.jsonl") as log:  # two more steps, each evaluated
        for s, value in ((6, 0.375), (7, 0.625)):
            log.log({"reward/mean": 0.5, "eval/reward_mean": value, "eval/greedy/reward_mean": value}, step=s)
    with JsonlLogger(run / "samples.jsonl") as log:
        for step in (6, 7):
            log.log({"split": "train", "prompt": f"old {step}", "response": "r", "reward": 0.0}, step=step)
        log.log({"split": "train", "prompt": "1+1=<b>", "response": "2", "reward": 1.0}, step=7)
        log.log({"split": "eval/greedy", "prompt": "2+2=", "response": "5", "reward": None}, step=7)
    page = write_report(run).read_text()
    assert (run / "eval.png").read_bytes().startswith(b"\x89PNG")
    assert "Evaluation reward" in page
    assert "<th>first eval reward (step 6)</th><td>0.375</td>" in page
    assert "<th>last eval reward (step 7)</th><td>0.625</td>" in page
    assert "train samples, step 7" in page and "eval/greedy samples, step 7" in page
    assert "1+1=&lt;b&gt;" in page  # escaped
    assert "old 6" not in page and "old 7" in page  # the last step's rows only
    assert "<td>failed</td>" in page  # a sample whose reward failed


def test_report_without_evaluation_or_samples_has_neither(tmp_path: Path) -> None:
    page = write_report(_run(tmp_path, steps=3)).read_text()
    assert "eval" not in page and "samples, step" not in page


def test_timed_phases_keep_the_logged_order_without_the_total() -> None:
    from rlhf_trainer.report import timed_phases

    records = [
        {"timing/rollout": 1.0, "timing/step": 2.0, "timing/update": 0.5},
        {"timing/reward": 0.1, "timing/rollout": 1.0},
    ]
    assert timed_phases(records) == ["rollout", "update", "reward"]
    assert timed_phases([{"timing/step": 1.0}]) == []


@pytest.mark.parametrize(
    "name",
    ["reward.png", "kl.png", "loss.png", "reward_hist.png", "timing.png", "eval.png"],
)
def test_each_plot_draws_alone_and_only_from_its_own_metrics(name: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from rlhf_trainer.report import PLOTS

    draw = {n: d for n, _, d in PLOTS}[name]
    metric = {
        "reward.png": {"reward/mean": 0.5},
        "kl.png": {"actor/kl": 0.01},
        "loss.png": {"actor/pg_loss": 0.3},
        "reward_hist.png": {"reward/scores": [0.0, 1.0]},
        "timing.png": {"timing/rollout": 0.2},
        "eval.png": {"eval/greedy/reward_mean": 0.4},
    }[name]
    assert draw(plt, [{"step": 0, "perf/samples_per_second": 1.0}]) is None
    fig = draw(plt, [{"step": 0, **metric}, {"step": 1, **metric}])
    assert fig is not None and fig.axes[0].has_data()
    plt.close(fig)
