"""The multi-turn example (manifests/examples/multiturn-calculator.yaml) learns to call its tool,
through `rlhf run`'s loop (`controller.run`)."""

from __future__ import annotations

import pytest


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_calculator_example_learns_to_call_the_tool(ray_session, tmp_path):
    """GRPO on two-digit products with the calculator environment: the share of episodes that
    call the tool (`multiturn/observed_fraction`) and the reward both rise, the environment's
    tokens are part of every step's responses but not of its trained tokens, and the samples
    show the tool's answers. The first run bootstraps the model (a few minutes, then cached)."""
    import dataclasses
    from pathlib import Path

    from rlhf_api.loader import load_manifest
    from rlhf_trainer.bootstrap import ensure_model, write_prompts
    from rlhf_trainer.controller import run
    from rlhf_trainer.metrics import read_jsonl

    examples = Path(__file__).resolve().parents[3] / "manifests" / "examples"
    job = load_manifest(examples / "multiturn-calculator.yaml")
    spec = job.spec
    ensure_model(spec.model)
    prompts = write_prompts("tiny-calculator", tmp_path / "prompts.jsonl", n=1024, seed=0)
    spec = dataclasses.replace(
        spec,
        data=dataclasses.replace(spec.data, path=str(prompts)),
        checkpoint=dataclasses.replace(spec.checkpoint, every=0),
        output=dataclasses.replace(spec.output, progress=False, report=False),
    )
    run(dataclasses.replace(job, spec=spec), run_dir=tmp_path / "run")
    rows = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert len(rows) == spec.training.steps

    def mean(key: str, part: list[dict]) -> float:
        return sum(r[key] for r in part) / len(part)

    reward = mean("reward/mean", rows[:5]), mean("reward/mean", rows[-5:])
    calls = mean("multiturn/observed_fraction", rows[:5]), mean("multiturn/observed_fraction", rows[-5:])
    print(
        f"\nmulti-turn calculator: reward {reward[0]:.3f} -> {reward[1]:.3f}, tool-call rate {calls[0]:.3f} -> {calls[1]:.3f}"
    )
    assert reward[1] > reward[0] + 0.3, [round(r["reward/mean"], 3) for r in rows]
    assert calls[1] > calls[0] + 0.3, [round(r["multiturn/observed_fraction"], 3) for r in rows]
    for r in rows:
        assert 1.0 <= r["multiturn/turns_mean"] <= 2.0
        assert r["multiturn/observed_fraction"] == 0 or r["multiturn/env_token_fraction"] > 0
    samples = read_jsonl(tmp_path / "run" / "samples.jsonl")
    called = [s for s in samples if "<tool>" in s["response"] and "</tool><result>" in s["response"]]
    assert called and all(s["response"].count("<result>") == 1 for s in called)


#: Keys of a step record that measure wall-clock time, not the run's numbers (not compared).
TIMING = ("time", "perf/", "timing/", "rollout/wait_")


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_kill_in_the_middle_of_an_episode_batch_resumes_exactly(ray_session, tmp_path):
    """The calculator job with a flaky tool (`runtime_environments.FlakyCalculatorEnv`: its
    answers and rewards drawn from Python's `random`, as a user's environment would draw them) is
    SIGKILLed in the middle of step 3's episode batch (some episodes answered by the environment,
    the others not yet), then restarted: every step record (loss, rewards, turns, tool calls,
    every `multiturn/*` metric) equals the uninterrupted run's. The in-flight episodes are lost
    and regenerated from the step-2 checkpoint; the workers reseed Python, NumPy and torch from
    (seed, step, rank) before each generation, so the environment's draws are replayed too.
    Counts and the per-sample scores compare exactly; float metrics to 1e-5 relative, the
    tolerance of test_resume.py (float summation order may differ between processes), although
    here they come out bit-equal. Without the reseed, step 0 already differs (`random` unseeded)."""
    import contextlib
    import math
    import os
    import signal
    import subprocess
    import sys
    import time
    from pathlib import Path

    import yaml

    from rlhf_api.loader import load_manifest
    from rlhf_trainer.bootstrap import ensure_model, write_prompts
    from rlhf_trainer.controller import run
    from rlhf_trainer.metrics import read_jsonl

    examples = Path(__file__).resolve().parents[3] / "manifests" / "examples"
    ensure_model(load_manifest(examples / "multiturn-calculator.yaml").spec.model)
    prompts = write_prompts("tiny-calculator", tmp_path / "prompts.jsonl", n=64, seed=0)
    killed = tmp_path / "killed"

    def manifest(name: str, **hold: object) -> Path:
        doc = yaml.safe_load((examples / "multiturn-calculator.yaml").read_text())
        doc["spec"]["data"]["path"] = str(prompts)
        doc["spec"]["rollout"]["samplesPerPrompt"] = 4
        doc["spec"]["rollout"]["multiTurn"]["environment"] = "runtime_environments:FlakyCalculatorEnv"
        doc["spec"]["rollout"]["multiTurn"]["kwargs"] = {"flakiness": 0.5, **hold}
        doc["spec"]["training"].update(steps=4, promptsPerStep=2)
        doc["spec"]["checkpoint"] = {"every": 2, "keep": 2}
        doc["spec"]["output"] = {"progress": False, "report": False}
        path = tmp_path / f"{name}.yaml"
        path.write_text(yaml.safe_dump(doc))
        return path

    straight = tmp_path / "straight"
    run(load_manifest(manifest("straight")), run_dir=straight, resume=False)
    expected = {r["step"]: r for r in read_jsonl(straight / "metrics.jsonl")}
    assert sorted(expected) == list(range(4))
    # The flaky tool spoke: the comparison below covers the environment's draws.
    assert any(r["multiturn/env_reward_mean"] < 0 for r in expected.values()), expected

    log = killed / "metrics.jsonl"
    held = manifest("killed", hold=str(log), hold_at=3, hold_after=3)
    cmd = [
        sys.executable,
        "-m",
        "rlhf_trainer.cli",
        "run",
        str(held),
        "--run-dir",
        str(killed),
        "--no-resume",
    ]
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parent), env.get("PYTHONPATH", "")])
    err_path = tmp_path / "killed.stderr"
    marker = log.with_name(log.name + ".held")
    with err_path.open("wb") as err:
        proc = subprocess.Popen(cmd, start_new_session=True, env=env, stdout=subprocess.DEVNULL, stderr=err)
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and proc.poll() is None and not marker.exists():
            time.sleep(0.05)
        assert marker.exists() and proc.poll() is None, err_path.read_text()[-3000:]
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # mid-episode-batch: the environment holds step 3
        proc.wait()
    assert len(log.read_text().splitlines()) == 3  # steps 0-2 logged, step 3 in flight
    assert (killed / "checkpoints" / "step-000002").is_dir()

    resumed = subprocess.run(cmd[:-1], env=env, capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resuming from" in resumed.stderr
    got = {r["step"]: r for r in read_jsonl(log)}
    assert sorted(got) == list(range(4))
    for step, want in expected.items():
        keys = {k for k in want if not k.startswith(TIMING)}
        assert {"actor/loss", "reward/scores", "multiturn/turns_mean", "multiturn/observed_fraction"} <= keys
        for key in sorted(keys):
            a, b = got[step][key], want[key]
            if not isinstance(b, float) or key.endswith(
                ("turns_mean", "observed_fraction", "observations_mean")
            ):
                assert a == b, (step, key, a, b)
            elif not (math.isnan(a) and math.isnan(b)):
                assert a == pytest.approx(b, rel=1e-5, abs=1e-6), (step, key, a, b)
