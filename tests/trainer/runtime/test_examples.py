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
@pytest.mark.parametrize("name", ["quickstart", "grpo", "rloo", "reinforce_pp", "remax", "online_dpo", "ppo"])
def test_example_runs(name, tiny_model, ray_session, tmp_path):
    import dataclasses

    from rlhf_api.loader import load_manifest
    from rlhf_trainer.controller import run

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
    # Every step reports the policy version; a step trains unless it had nothing to train on
    # (online DPO whose groups all tied: no pair), which it says.
    assert all(r["actor/policy_version"] >= 1 or r.get("update/skipped") == 1.0 for r in rows), [
        {k: v for k, v in r.items() if "version" in k or "skipped" in k or "dpo/" in k} for r in rows
    ]
    assert rows[-1]["actor/policy_version"] >= 1 or name == "online_dpo"
    if name == "remax":  # the greedy baseline rollout ran and was scored each step
        assert all("baseline/reward_mean" in r and "timing/baseline" in r for r in rows)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_remax_baseline_is_the_greedy_responses_reward(tiny_model, ray_session, tmp_path):
    """`algorithm: remax` end to end: the greedy baseline is generated and scored per prompt, and
    with one sample per prompt, no KL and an exact (0/1) reward the advantage of a sample is
    its score minus its prompt's greedy score, so the step's mean advantage over tokens lies
    in [-1, 1] and is 0 when every sample matches its greedy answer's score."""
    from rlhf_trainer.controller import run

    from .conftest import make_job

    job = make_job(
        "remax",
        algorithm={"name": "remax", "params": {"klCoef": 0.0}},
        rollout={"samplesPerPrompt": 1, "maxNewTokens": 4},
        training={"steps": 2, "promptsPerStep": 8, "microBatchSize": 16},
    )
    run(job, run_dir=tmp_path)
    rows = read_metrics(tmp_path)
    assert [r["step"] for r in rows] == [0, 1]
    for r in rows:
        assert 0.0 <= r["baseline/reward_mean"] <= 1.0 and r["baseline/invalid"] == 0.0
        assert 1.0 <= r["baseline/response_length"] <= 4.0
        assert -1.0 <= r["advantage/mean"] <= 1.0
        assert r["actor/optimizer_steps"] == 1.0
    assert rows[-1]["actor/policy_version"] == 2


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("actors", [1, 2])
def test_custom_pipeline_with_conditional_update(actors, tiny_model, ray_session, tmp_path):
    """`spec.pipeline` replaces the standard stream; the roles follow its algorithms (PPO: a critic).

    The conditional trains both branches in ONE update per step: one optimizer and scheduler
    step, so a linear schedule over `steps` ends at 0 on the last step (two updates per step
    reached 0 at mid-run), and the policy version moves by one per step. With two FSDP ranks
    per role as well."""
    from rlhf_trainer.controller import run

    from .conftest import make_job

    steps, lr = 4, 1e-3
    job = make_job(
        "pipeline",
        pipeline="runtime_pipelines:build",
        # two ranks: a rank's rows may hold no sample of a branch (its metric keys then differ)
        roles={"actor": {"replicas": actors}, "critic": {"replicas": actors}},
        reward={"functions": [{"path": "rlhf_trainer.rewards.builtin:arithmetic_partial"}]},
        rollout={"samplesPerPrompt": 2, "maxNewTokens": 4},
        training={
            "steps": steps,
            "promptsPerStep": 8,
            "microBatchSize": 16,
            "learningRate": lr,
            "lrSchedule": "linear",
        },
    )
    run(job, run_dir=tmp_path)
    rows = read_metrics(tmp_path)
    assert len(rows) == steps
    for i, r in enumerate(rows):
        assert r["true/samples"] + r["false/samples"] == 16
        # PPO trains every routed sample; online DPO only the groups with a pair (ties skipped)
        assert ("true/actor/loss" in r) == (r["true/samples"] > 0)
        assert ("false/actor/loss" in r) == (r.get("false/dpo/pairs", 0.0) > 0)
        assert r["actor/optimizer_steps"] == 1.0
        assert r["actor/lr"] == pytest.approx(lr * (1 - (i + 1) / steps), abs=1e-12)
        assert r["actor/policy_version"] == i + 1
        if r["true/samples"] > 0:  # the critic trains on the PPO branch's rows only
            assert r["critic/optimizer_steps"] == 1.0 and "true/critic/loss" in r
    assert rows[-1]["actor/lr"] == 0.0
