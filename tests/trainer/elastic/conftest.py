"""Fixtures of the elastic-rollout tests: BASE, the small disaggregated job they vary (the tiny
model, prompts and Ray come from tests/trainer/conftest.py)."""

from __future__ import annotations

from typing import Any

from trainer_jobs import MODEL, PROMPTS, job_from, read_metrics

__all__ = ["BASE", "PROMPTS", "exactly_once", "make_job", "read_metrics"]

BASE: dict[str, Any] = {
    "apiVersion": "rlhf.dev/v1alpha1",
    "kind": "RLTrainingJob",
    "metadata": {"name": "elastic"},
    "spec": {
        "model": {"path": str(MODEL)},
        "data": {"path": str(PROMPTS)},
        "reward": {"functions": [{"path": "rlhf_trainer.rewards.builtin:arithmetic_exact"}]},
        # klCoef 0: no reference worker (fewer processes on the shared cores)
        "algorithm": {"name": "grpo", "params": {"klCoef": 0.0}},
        "rollout": {"samplesPerPrompt": 2, "maxNewTokens": 3},
        "training": {"steps": 5, "promptsPerStep": 6, "microBatchSize": 12, "learningRate": 1e-3},
        "checkpoint": {"every": 0},
        "output": {"progress": False, "report": False},
    },
}


def make_job(name: str, **sections: Any) -> Any:
    """BASE with each given spec section merged in (one level deep)."""
    return job_from(BASE, name, sections)


def exactly_once(rows: list[dict[str, Any]], prompts: int, samples_per_step: int = 12) -> None:
    """The run log shows every prompt enqueued, leased and acked exactly once (a requeued lease
    counted once more as leased, never as acked) and each step trained on all its samples."""
    last = rows[-1]
    assert last["queue/enqueued"] == prompts == last["data/prompts_consumed"]
    assert last["queue/acked"] == prompts
    assert last["queue/leased"] == last["queue/acked"] + last["queue/requeued"]
    assert last["queue/stale_acks"] == 0
    # each step trained on samplesPerPrompt samples of each of its prompts
    assert all(r["rollout/samples"] == samples_per_step for r in rows)
