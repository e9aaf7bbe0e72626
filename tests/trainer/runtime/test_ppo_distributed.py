"""PPO with every role separate: 2 actor ranks and 2 critic ranks (FSDP2 over gloo), a reference,
a reward worker and a rollout worker (disaggregated placement, weights pushed after each update)."""

from __future__ import annotations

import pytest

from .conftest import make_job, read_metrics


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_ppo_fsdp2_disaggregated_improves(tiny_model, ray_session, tmp_path):
    from rlhf_trainer.controller import run

    job = make_job(
        "ppo-fsdp",
        reward={"functions": [{"path": "runtime_rewards:starts_with_one"}]},
        algorithm={"name": "ppo", "params": {"klCoef": 0.001}},
        rollout={"samplesPerPrompt": 4, "maxNewTokens": 3},
        training={
            "steps": 8,
            "promptsPerStep": 8,
            "miniBatchSize": 16,
            "microBatchSize": 4,
            "epochsPerBatch": 2,
            "learningRate": 1e-3,
            "criticLearningRate": 2e-3,
        },
        roles={
            "placement": "disaggregated",
            "actor": {"replicas": 2},
            "critic": {"replicas": 2},
            "reference": {"replicas": 1},
            "reward": {"replicas": 1},
            "rollout": {"replicas": 1},
        },
    )
    summary = run(job, run_dir=tmp_path)
    rows = read_metrics(tmp_path)
    assert len(rows) == 8
    first = sum(r["reward/mean"] for r in rows[:2]) / 2
    last = sum(r["reward/mean"] for r in rows[-2:]) / 2
    assert last > first + 0.15, [round(r["reward/mean"], 3) for r in rows]
    # Every role did its part: critic trained, KL measured against the reference, weights pushed.
    assert all("critic/loss" in r and "actor/kl" in r for r in rows)
    assert rows[-1]["actor/policy_version"] == 8 * 1.0
    assert rows[-1]["actor/optimizer_steps"] == 4  # 2 epochs x (32 samples / mini-batch 16)
    assert summary.last_reward == rows[-1]["reward/mean"]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_colocated_two_actor_ranks_hybrid_engine(tiny_model, ray_session, tmp_path):
    """Colocated with FSDP2: each actor rank samples from an unsharded copy refreshed after every update."""
    from rlhf_trainer.controller import run

    job = make_job(
        "grpo-colocated-fsdp",
        training={"steps": 2, "promptsPerStep": 4, "microBatchSize": 4},
        roles={"placement": "colocated", "actor": {"replicas": 2}},
    )
    run(job, run_dir=tmp_path)
    rows = read_metrics(tmp_path)
    assert [r["actor/policy_version"] for r in rows] == [1.0, 2.0]
    assert all(r["rollout/samples"] == 16 and r["rollout/policy_version_lag"] == 0 for r in rows)
