"""Fixtures of the elastic-rollout tests: BASE, the small disaggregated job they vary (the tiny
model, prompts and Ray come from tests/trainer/conftest.py)."""

from __future__ import annotations

from typing import Any

from trainer_jobs import MODEL, PROMPTS, job_from, read_metrics

__all__ = ["BASE", "PROMPTS", "make_job", "read_metrics"]

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
