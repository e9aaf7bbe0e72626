"""SIGTERM mid-run: the step in progress is finished and checkpointed, the run exits 143, and the
next run resumes at that step (no step lost), with one metrics record per step.

`rlhf run` (the same loop as the controller pod) in a subprocess; periodic checkpoints only at the
end, so the resumed step can come only from the checkpoint written on SIGTERM.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time

import pytest
import yaml

from .conftest import BASE, read_metrics

STEPS = 12


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_sigterm_checkpoints_the_step_in_progress_and_the_next_run_resumes_there(tiny_model, tmp_path):
    doc = {**BASE, "metadata": {"name": "preempted"}}
    doc["spec"] = {
        **BASE["spec"],
        "training": {**BASE["spec"]["training"], "steps": STEPS, "promptsPerStep": 4},
        "checkpoint": {"every": 0, "keep": 2},  # only at the end
    }
    manifest = tmp_path / "job.yaml"
    manifest.write_text(yaml.safe_dump(doc))
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "rlhf_trainer.cli", "run", str(manifest), "--run-dir", str(run_dir)]
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    err_path = tmp_path / "first.stderr"
    with err_path.open("wb") as err:
        proc = subprocess.Popen(cmd, start_new_session=True, env=env, stdout=subprocess.DEVNULL, stderr=err)
    try:
        log = run_dir / "metrics.jsonl"
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline and proc.poll() is None:
            if log.is_file() and len(log.read_text().splitlines()) >= 3:
                break
            time.sleep(0.05)
        assert proc.poll() is None, err_path.read_text()[-3000:]
        done_at_sigterm = len(log.read_text().splitlines())
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=120)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    stderr = err_path.read_text()
    assert rc == 143, stderr[-3000:]
    assert "stopped on SIGTERM after step" in stderr, stderr[-3000:]
    saved = sorted(
        int(p.parent.name.split("-")[1]) for p in (run_dir / "checkpoints").glob("step-*/COMPLETE")
    )
    assert len(saved) == 1 and done_at_sigterm <= saved[0] < STEPS, (saved, done_at_sigterm)

    resumed = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"(step {saved[0]})" in resumed.stderr, resumed.stderr[-3000:]
    assert [r["step"] for r in read_metrics(run_dir)] == list(range(STEPS))
