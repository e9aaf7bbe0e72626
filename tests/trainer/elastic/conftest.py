"""Fixtures of the elastic-rollout tests: the tiny bootstrap model, a prompt file, one Ray
instance, and a builder of small disaggregated jobs."""

from __future__ import annotations

import copy
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

MODEL = Path("~/.cache/rlhf-operator/models/tiny-arithmetic").expanduser()
PROMPTS = Path(tempfile.gettempdir()) / f"rlhf-elastic-tests-{os.getpid()}" / "tiny-arithmetic.jsonl"


@pytest.fixture(scope="session")
def tiny_model() -> Iterator[Path]:
    from rlhf_trainer.bootstrap import ensure_model, write_prompts
    from rlhf_trainer.spec import ModelSpec

    ensure_model(ModelSpec(path=str(MODEL), bootstrap="tiny-arithmetic"))
    write_prompts("tiny-arithmetic", PROMPTS, n=256, seed=0)
    yield MODEL
    shutil.rmtree(PROMPTS.parent, ignore_errors=True)


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
    from rlhf_trainer.spec import parse_job

    doc = copy.deepcopy(BASE)
    doc["metadata"]["name"] = name
    for key, value in sections.items():
        if isinstance(value, dict) and isinstance(doc["spec"].get(key), dict):
            doc["spec"][key] = {**doc["spec"][key], **value}
        else:
            doc["spec"][key] = value
    return parse_job(doc)


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
