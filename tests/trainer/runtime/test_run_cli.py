"""The command line of the runtime: cheap to import, clear errors, status payload."""

from __future__ import annotations

import datetime as dt
import subprocess
import sys

from rlhf_trainer.cli import main
from rlhf_trainer.run_cli import StatusReporter


def test_importing_the_cli_does_not_import_torch_or_ray():
    code = "import sys, rlhf_trainer.cli as c; c.build_parser(); print('torch' in sys.modules, 'ray' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False"]


def test_run_and_report_are_subcommands(capsys):
    for argv in (["run", "--help"], ["report", "--help"], ["controller", "--help"]):
        try:
            main(argv)
        except SystemExit as exit_:
            assert exit_.code == 0
    assert "--no-resume" in capsys.readouterr().out


def test_report_of_a_folder_without_metrics_is_an_error(tmp_path, capsys):
    assert main(["report", str(tmp_path)]) == 1
    assert "no metrics.jsonl" in capsys.readouterr().err


def test_run_of_an_invalid_manifest_names_the_field(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        "apiVersion: rlhf.dev/v1alpha1\nkind: RLTrainingJob\nmetadata: {name: bad}\n"
        "spec: {model: {path: /nope}, data: {path: x.jsonl}, reward: {functions: [{path: 'a.b:c'}]},"
        " algorithm: {name: not-an-algo}}\n"
    )
    assert main(["run", str(bad)]) == 2
    assert "spec.algorithm.name" in capsys.readouterr().err


def test_status_progress_payload():
    now = dt.datetime(2026, 12, 7, 14, 0, 0, tzinfo=dt.timezone.utc)
    reporter = StatusReporter(api=None, name="job", namespace="ns", wall_clock=lambda: now)
    body = reporter.progress(3, 10, {"reward/mean": 0.5, "timing/step": 1.25, "other": 1.0}, 2)
    assert body == {
        "status": {
            "progress": {
                "step": 3,
                "totalSteps": 10,
                "updated": "2026-12-07T14:00:00Z",
                "checkpointStep": 2,
                "metrics": {"reward_mean": "0.5", "timing_step": "1.25"},
                "reward": 0.5,
            }
        }
    }
    nan = reporter.progress(4, 10, {"reward/mean": float("nan")})["status"]["progress"]
    assert "reward" not in nan  # JSON has no NaN: a patch carrying one would be refused
    assert "evalReward" not in body["status"]["progress"]  # a step without an evaluation


def test_status_progress_carries_the_evaluation_of_a_step_that_ran_one():
    reporter = StatusReporter(api=None, name="job", namespace="ns")
    metrics = {
        "reward/mean": 0.5,
        "eval/reward_mean": 0.75,
        "eval/step": 10.0,
        "eval/greedy/reward_mean": 0.75,
    }
    progress = reporter.progress(10, 20, metrics)["status"]["progress"]
    assert progress["evalReward"] == 0.75 and progress["evalStep"] == 10
    assert progress["metrics"]["eval_reward_mean"] == "0.75"
    failed = reporter.progress(10, 20, {**metrics, "eval/reward_mean": float("nan")})["status"]["progress"]
    assert "evalReward" not in failed and "evalStep" not in failed


def test_controller_outside_a_pod_reports_nothing(monkeypatch):
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    assert StatusReporter.from_environment("job", "ns") is None
