"""SIGKILL mid-step, restart: the following steps match an uninterrupted run with the same seed.

Workers reseed from (seed, step, rank) every step and a checkpoint holds the weights, AdamW
moments, LR schedule, data position and algorithm state, so the match is exact up to float
summation order; the stated tolerance is 1e-5 relative.
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

COMPARED = (
    "reward/mean",
    "actor/loss",
    "actor/entropy",
    "actor/grad_norm",
    "advantage/std",
    "rollout/tokens",
)


def _manifest(tmp_path):
    doc = {**BASE, "metadata": {"name": "resume"}}
    doc["spec"] = {
        **BASE["spec"],
        # An entropy bonus: the entropy (and its chunked backward) is computed only when the loss
        # reads it, so this puts it on the resumed path and in the compared metrics.
        "algorithm": {"name": "grpo", "params": {"klCoef": 0.0, "entropyCoef": 0.001}},
        "training": {**BASE["spec"]["training"], "steps": 6, "promptsPerStep": 4},
        "checkpoint": {"every": 2, "keep": 2},
    }
    path = tmp_path / "resume.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_sigkill_mid_step_then_restart_matches_uninterrupted_run(tiny_model, ray_session, tmp_path):
    from rlhf_api.loader import load_manifest
    from rlhf_trainer.controller import run

    manifest = _manifest(tmp_path)
    straight = tmp_path / "straight"
    run(load_manifest(manifest), run_dir=straight, resume=False)
    expected = {r["step"]: r for r in read_metrics(straight)}

    killed = tmp_path / "killed"
    cmd = [
        sys.executable,
        "-m",
        "rlhf_trainer.cli",
        "run",
        str(manifest),
        "--run-dir",
        str(killed),
        "--no-resume",
    ]
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    # stderr goes to a file: a pipe nobody reads while Ray logs to the driver can block the child.
    err_path = tmp_path / "killed.stderr"
    with err_path.open("wb") as err:
        proc = subprocess.Popen(cmd, start_new_session=True, env=env, stdout=subprocess.DEVNULL, stderr=err)
    try:
        deadline = time.monotonic() + 600
        log = killed / "metrics.jsonl"
        while time.monotonic() < deadline and proc.poll() is None:
            if log.is_file() and len(log.read_text().splitlines()) >= 3:  # steps 0-2 done, step 3 running
                break
            time.sleep(0.05)
        assert proc.poll() is None, err_path.read_text()[-3000:]
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # the kill under test, and the cleanup on failure
        proc.wait()
    assert (killed / "checkpoints" / "step-000002").is_dir()

    resumed = subprocess.run(cmd[:-1], env=env, capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resuming from" in resumed.stderr
    got = {r["step"]: r for r in read_metrics(killed)}
    assert sorted(got) == list(range(6))
    for step in range(2, 6):
        for key in COMPARED:
            assert got[step][key] == pytest.approx(expected[step][key], rel=1e-5, abs=1e-6), (step, key)
