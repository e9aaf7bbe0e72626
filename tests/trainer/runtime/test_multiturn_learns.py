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

    from rlhf_trainer.bootstrap import ensure_model, write_prompts
    from rlhf_trainer.controller import run
    from rlhf_trainer.metrics import read_jsonl
    from rlhf_trainer.spec import load_manifest

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
