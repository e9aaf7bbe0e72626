"""Fixtures of the runtime tests: BASE, the small job they vary (the tiny model, prompts and
Ray come from tests/trainer/conftest.py)."""

from __future__ import annotations

from typing import Any

from trainer_jobs import MODEL, PROMPTS, job_from, read_metrics

__all__ = ["BASE", "PROMPTS", "make_job", "read_metrics"]

BASE: dict[str, Any] = {
    "apiVersion": "rlhf.dev/v1alpha1",
    "kind": "RLTrainingJob",
    "metadata": {"name": "test"},
    "spec": {
        "model": {"path": str(MODEL)},
        "data": {"path": str(PROMPTS)},
        "reward": {"functions": [{"path": "rlhf_trainer.rewards.builtin:arithmetic_exact"}]},
        "algorithm": {"name": "grpo", "params": {"klCoef": 0.0}},
        "rollout": {"samplesPerPrompt": 4, "maxNewTokens": 4},
        "training": {"steps": 2, "promptsPerStep": 4, "microBatchSize": 16, "learningRate": 1e-3},
        "checkpoint": {"every": 0},
        "output": {"progress": False, "report": False},
    },
}


def make_job(name: str = "test", **sections: Any) -> Any:
    """A small job: BASE with each given spec section merged in (one level deep)."""
    return job_from(BASE, name, sections)
