"""Every local example manifest runs end to end with a tiny budget."""

from __future__ import annotations

from pathlib import Path

import pytest

from .conftest import read_metrics

EXAMPLES = Path(__file__).resolve().parents[3] / "manifests" / "examples"


def _tiny_reward_model(path: Path, policy: Path) -> None:
    """A sequence classifier (1 label) built from the bootstrap policy's config, with its tokenizer."""
    import torch
    from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer

    config = AutoConfig.from_pretrained(policy, num_labels=1)
    tokenizer = AutoTokenizer.from_pretrained(policy)
    config.pad_token_id = tokenizer.pad_token_id
    torch.manual_seed(0)
    AutoModelForSequenceClassification.from_config(config).save_pretrained(path)
    tokenizer.save_pretrained(path)


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", ["quickstart", "grpo", "rloo", "reinforce_pp", "online_dpo", "ppo"])
def test_example_runs(name, tiny_model, ray_session, tmp_path):
    import dataclasses

    from rlhf_trainer.controller import run
    from rlhf_trainer.spec import load_manifest

    job = load_manifest(EXAMPLES / f"{name}.yaml")
    spec = job.spec
    if spec.reward.model is not None:
        rm = tmp_path / "reward-model"
        _tiny_reward_model(rm, tiny_model)
        spec = dataclasses.replace(
            spec,
            reward=dataclasses.replace(
                spec.reward, model=dataclasses.replace(spec.reward.model, path=str(rm))
            ),
        )
    spec = dataclasses.replace(
        spec,
        training=dataclasses.replace(spec.training, prompts_per_step=4, mini_batch_size=0),
        output=dataclasses.replace(spec.output, progress=False, report=False),
    )
    job = dataclasses.replace(job, spec=spec)
    summary = run(job, manifest_dir=EXAMPLES, steps=2, run_dir=tmp_path / "run")
    rows = read_metrics(tmp_path / "run")
    assert [r["step"] for r in rows] == [0, 1]
    assert summary.steps == 2
    assert all(r["actor/policy_version"] >= 1 for r in rows)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_custom_pipeline_with_conditional_update(tiny_model, ray_session, tmp_path):
    """`spec.pipeline` replaces the standard stream; the roles follow its algorithms (PPO: a critic)."""
    from rlhf_trainer.controller import run

    from .conftest import make_job

    job = make_job(
        "pipeline",
        pipeline="runtime_pipelines:build",
        reward={"functions": [{"path": "rlhf_trainer.rewards.builtin:arithmetic_partial"}]},
        rollout={"samplesPerPrompt": 2, "maxNewTokens": 4},
        training={"steps": 2, "promptsPerStep": 8, "microBatchSize": 16},
    )
    run(job, run_dir=tmp_path)
    rows = read_metrics(tmp_path)
    assert len(rows) == 2
    for r in rows:
        assert r["true/samples"] + r["false/samples"] == 16
        routed = [b for b in ("true", "false") if r[f"{b}/samples"] > 0]
        assert all(f"{b}/actor/loss" in r for b in routed)
    assert any("true/critic/loss" in r for r in rows) or all(r["true/samples"] == 0 for r in rows)
