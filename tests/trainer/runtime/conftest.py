"""Fixtures of the runtime tests: the tiny bootstrap model, its prompts, one Ray instance, and a
builder of small jobs."""

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

CACHE = Path("~/.cache/rlhf-operator").expanduser()
MODEL = CACHE / "models" / "tiny-arithmetic"
#: The session's own prompt file (written by `tiny_model`; shared caches may be cleaned by others).
PROMPTS = Path(tempfile.gettempdir()) / f"rlhf-runtime-tests-{os.getpid()}" / "tiny-arithmetic.jsonl"


@pytest.fixture(scope="session")
def tiny_model() -> Iterator[Path]:
    from rlhf_trainer.bootstrap import ensure_model, write_prompts
    from rlhf_trainer.spec import ModelSpec

    ensure_model(ModelSpec(path=str(MODEL), bootstrap="tiny-arithmetic"))
    write_prompts("tiny-arithmetic", PROMPTS, n=1024, seed=0)
    yield MODEL
    shutil.rmtree(PROMPTS.parent, ignore_errors=True)


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
    from rlhf_trainer.spec import parse_job

    doc = copy.deepcopy(BASE)
    doc["metadata"]["name"] = name
    for key, value in sections.items():
        if isinstance(value, dict) and isinstance(doc["spec"].get(key), dict):
            doc["spec"][key] = {**doc["spec"][key], **value}
        else:
            doc["spec"][key] = value
    return parse_job(doc)


def read_metrics(run_dir: Path) -> list[dict[str, float]]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
