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


#: Metrics a resumed multi-turn run must reproduce (episodes, their masks, the update).
RESUME_COMPARED = (
    "reward/mean",
    "actor/loss",
    "actor/grad_norm",
    "rollout/tokens",
    "multiturn/observed_fraction",
    "multiturn/env_token_fraction",
    "multiturn/turns_mean",
)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_kill_in_the_middle_of_an_episode_batch_resumes_exactly(ray_session, tmp_path):
    """SIGKILL while step 3's episodes are being generated or trained on, restart: steps 2-5 are
    those of the uninterrupted run (the in-flight episodes are lost and regenerated from the
    step-2 checkpoint, seeded by the step; the environment keeps no state across steps)."""
    import contextlib
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
    doc = yaml.safe_load((examples / "multiturn-calculator.yaml").read_text())
    ensure_model(load_manifest(examples / "multiturn-calculator.yaml").spec.model)
    prompts = write_prompts("tiny-calculator", tmp_path / "prompts.jsonl", n=256, seed=0)
    doc["spec"]["data"]["path"] = str(prompts)
    doc["spec"]["training"].update(steps=6, promptsPerStep=4)
    doc["spec"]["checkpoint"] = {"every": 2, "keep": 2}
    doc["spec"]["output"] = {"progress": False, "report": False}
    manifest = tmp_path / "multiturn-resume.yaml"
    manifest.write_text(yaml.safe_dump(doc))

    straight = tmp_path / "straight"
    run(load_manifest(manifest), run_dir=straight, resume=False)
    expected = {r["step"]: r for r in read_jsonl(straight / "metrics.jsonl")}

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
    err_path = tmp_path / "killed.stderr"
    with err_path.open("wb") as err:
        proc = subprocess.Popen(cmd, start_new_session=True, env=env, stdout=subprocess.DEVNULL, stderr=err)
    try:
        deadline = time.monotonic() + 600
        log = killed / "metrics.jsonl"
        while time.monotonic() < deadline and proc.poll() is None:
            if log.is_file() and len(log.read_text().splitlines()) >= 3:  # steps 0-2 done, step 3 running
                break
            time.sleep(0.02)
        assert proc.poll() is None, err_path.read_text()[-3000:]
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    assert (killed / "checkpoints" / "step-000002").is_dir()

    resumed = subprocess.run(cmd[:-1], env=env, capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resuming from" in resumed.stderr
    got = {r["step"]: r for r in read_jsonl(killed / "metrics.jsonl")}
    assert sorted(got) == list(range(6))
    for step in range(2, 6):
        for key in RESUME_COMPARED:
            assert got[step][key] == pytest.approx(expected[step][key], rel=1e-5, abs=1e-6), (step, key)
