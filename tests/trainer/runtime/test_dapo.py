"""The quickstart with DAPO's recipe and the rollout correction on, through `rlhf run`'s loop."""

from __future__ import annotations

import pytest


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_quickstart_with_dapo_and_the_rollout_correction_learns(tiny_model, ray_session, tmp_path):
    """GRPO on the arithmetic task with dynamic sampling, the overlong soft penalty (a response
    that runs to maxNewTokens 4 loses 0.5), truncated responses masked out of the loss, and the
    truncated importance weights against the engine's log-probs (maxStaleness 0): the reward
    rises, dynamic sampling's counts add up, and the weights are about 1 (the colocated hf engine
    samples from the training module itself)."""
    import dataclasses
    from pathlib import Path

    from rlhf_api.loader import load_manifest
    from rlhf_trainer.controller import run

    from .conftest import PROMPTS, read_metrics

    examples = Path(__file__).resolve().parents[3] / "manifests" / "examples"
    job = load_manifest(examples / "quickstart.yaml")
    spec = job.spec
    algorithm = dataclasses.replace(
        spec.algorithm,
        params={
            "klCoef": 0.0,
            "overlongBufferLength": 1,
            "overlongPenaltyFactor": 0.5,
            "maskTruncated": True,
        },
        dynamic_sampling=dataclasses.replace(
            spec.algorithm.dynamic_sampling, enabled=True, max_extra_rounds=2
        ),
        rollout_correction=dataclasses.replace(spec.algorithm.rollout_correction, enabled=True),
    )
    spec = dataclasses.replace(
        spec,
        model=dataclasses.replace(spec.model, path=str(tiny_model)),
        data=dataclasses.replace(spec.data, path=str(PROMPTS)),
        algorithm=algorithm,
        training=dataclasses.replace(spec.training, steps=30),
        checkpoint=dataclasses.replace(spec.checkpoint, every=0),
        output=dataclasses.replace(spec.output, progress=False, report=False),
    )
    run(dataclasses.replace(job, spec=spec), run_dir=tmp_path)
    rows = read_metrics(tmp_path)
    assert len(rows) == 30
    first = sum(r["reward/mean"] for r in rows[:5]) / 5
    last = sum(r["reward/mean"] for r in rows[-5:]) / 5
    print(f"\nDAPO quickstart reward: first 5 steps {first:.3f}, last 5 {last:.3f}")
    assert last > first + 0.1, [round(r["reward/mean"], 3) for r in rows]
    for r in rows:
        parts = sum(r[f"dynamic_sampling/groups_{k}"] for k in ("kept", "uniform", "surplus"))
        assert r["dynamic_sampling/groups_generated"] == parts
        assert r["dynamic_sampling/groups_kept"] <= 16 and r["dynamic_sampling/rounds"] <= 2
        if r.get("update/skipped"):
            continue
        assert abs(r["rollout/is_weight_mean"] - 1.0) < 0.05 and r["rollout/is_weight_max"] >= 1.0
        assert 0.0 <= r["rollout/is_truncated_fraction"] <= 1.0
        assert "dapo/truncated_masked" in r and "dapo/overlong_penalized" in r
    assert any(r["dynamic_sampling/groups_uniform"] > 0 for r in rows)  # the filter did drop groups
