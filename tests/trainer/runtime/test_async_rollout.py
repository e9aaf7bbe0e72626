"""Asynchronous (one-step-off-policy) rollouts, `spec.rollout.maxStaleness: 1`, end to end on a
local Ray with a disaggregated rollout fleet: the fleet generates step k+1 while the actor
trains step k, every trained sample is at most one policy version old, the loss is corrected
with importance weights against the rollout engine's log-probs, the policy learns, and a run
interrupted after a checkpoint resumes exactly (the checkpoint holds the batch generated ahead)."""

from __future__ import annotations

import pytest

from .conftest import make_job, read_metrics

FLEET = {
    "placement": "disaggregated",
    "critic": {"replicas": 0},
    "reference": {"replicas": 0},
    "rollout": {"replicas": 1},
}


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_one_step_off_policy_learns_within_the_staleness_bound(tiny_model, ray_session, tmp_path):
    from rlhf_trainer.controller import run

    steps = 60  # the quickstart's length
    job = make_job(
        "async-learns",
        rollout={"samplesPerPrompt": 8, "maxNewTokens": 4, "maxStaleness": 1},
        training={"steps": steps, "promptsPerStep": 16, "microBatchSize": 128, "learningRate": 1e-3},
        roles=FLEET,
    )
    run(job, run_dir=tmp_path)
    rows = read_metrics(tmp_path)
    assert [r["step"] for r in rows] == list(range(steps))
    for r in rows:
        trained_at = r["actor/policy_version"] - 1  # the version the update started from
        # Every trained sample's generating version is within one of the policy it trained.
        assert r["offpolicy/behaviour_version_min"] >= trained_at - 1, r
        assert r["offpolicy/staleness_max"] <= 1.0 and r["offpolicy/dropped"] == 0.0
    # Step 0 is generated then trained; every later step trains the batch generated while the
    # previous one trained, one version old: old log-probs recomputed, importance-weighted.
    assert rows[0]["offpolicy/staleness_max"] == 0.0 and "offpolicy/is_weight_mean" not in rows[0]
    for r in rows[1:]:
        assert r["offpolicy/staleness_mean"] == 1.0, r
        # One optimizer step per batch: the proximal log-probs are the update's own (no extra
        # pass), the importance weight against the engine's log-probs corrects the loss.
        assert r["update/old_log_probs_skipped"] == 1.0
        assert 0.0 < r["offpolicy/is_weight_mean"] <= 2.0
        assert r["rollout/ahead_seconds"] > 0.0
    rewards = [round(r["reward/mean"], 3) for r in rows]
    print(f"\nmaxStaleness 1 rewards: {rewards}")
    print(f"mismatch kl: {[round(r.get('offpolicy/mismatch_kl', 0.0), 4) for r in rows]}")
    assert sum(rewards[-10:]) / 10 > sum(rewards[:10]) / 10 + 0.1, rewards


class Interrupted(RuntimeError):
    pass


COMPARED = (
    "reward/mean",
    "actor/loss",
    "actor/grad_norm",
    "offpolicy/is_weight_mean",
    "offpolicy/mismatch_kl",
    "rollout/tokens",
)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_resume_with_a_rollout_ahead_matches_the_uninterrupted_run(tiny_model, ray_session, tmp_path):
    """A run stopped after step 3 (checkpoint after step 2, holding step 2's batch generated
    ahead by version 1) resumes at step 2 and reproduces the uninterrupted run's steps 2-5.
    Two mini-batches per step: the old (proximal) log-probs are a pass of their own here."""
    from rlhf_trainer.controller import run

    job = make_job(
        "async-resume",
        rollout={"samplesPerPrompt": 4, "maxNewTokens": 4, "maxStaleness": 1},
        training={
            "steps": 6,
            "promptsPerStep": 4,
            "miniBatchSize": 8,
            "microBatchSize": 8,
            "learningRate": 1e-3,
        },
        checkpoint={"every": 2, "keep": 3},
        roles=FLEET,
    )
    run(job, run_dir=tmp_path / "straight", resume=False)
    expected = {r["step"]: r for r in read_metrics(tmp_path / "straight")}

    def stop_after_step_3(
        done: int, total: int, metrics: dict[str, float], checkpoint_step: int | None
    ) -> None:
        if done == 3:
            raise Interrupted("stopped after step 3")

    with pytest.raises(Interrupted):
        run(job, run_dir=tmp_path / "resumed", resume=False, on_status=stop_after_step_3)
    saved = tmp_path / "resumed" / "checkpoints" / "step-000002"
    assert (saved / "controller" / "controller_tensors.safetensors").is_file()
    run(job, run_dir=tmp_path / "resumed", resume=True)
    got = {r["step"]: r for r in read_metrics(tmp_path / "resumed")}
    assert sorted(got) == list(range(6))
    assert got[2]["offpolicy/staleness_max"] == 1.0  # the saved batch, not a fresh one
    assert all(got[s]["update/old_log_probs_skipped"] == 0.0 for s in range(2, 6))
    for step in range(2, 6):
        for key in COMPARED:
            assert got[step][key] == pytest.approx(expected[step][key], rel=1e-5, abs=1e-6), (step, key)
