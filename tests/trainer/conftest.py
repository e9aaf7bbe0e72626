"""Fixtures shared by the trainer's end-to-end tests (runtime, elastic)."""

from __future__ import annotations

import shutil
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from trainer_jobs import MODEL, PROMPT_ROWS, PROMPTS

#: Modules the tests name by import path in their manifests (rewards, pipelines).
TEST_MODULES = Path(__file__).resolve().parent / "runtime"


@pytest.fixture(scope="session")
def tiny_model() -> Iterator[Path]:
    """The tiny-arithmetic model (created once, cached) and the session's prompt file."""
    from rlhf_api.sections import ModelSpec
    from rlhf_trainer.bootstrap import ensure_model, write_prompts

    ensure_model(ModelSpec(path=str(MODEL), bootstrap="tiny-arithmetic"))
    write_prompts("tiny-arithmetic", PROMPTS, n=PROMPT_ROWS, seed=0)
    yield MODEL
    shutil.rmtree(PROMPTS.parent, ignore_errors=True)


@pytest.fixture(scope="session")
def ray_session() -> Iterator[None]:
    """One local Ray instance for every run of the session. It is started once, by whichever test
    needs it first, so its workers' import path must already hold every test module
    (`runtime_rewards`, `runtime_pipelines`): Ray fixes the workers' PYTHONPATH at start."""
    import ray

    from rlhf_trainer.startup import start_ray

    if str(TEST_MODULES) not in sys.path:
        sys.path.insert(0, str(TEST_MODULES))
    owns = start_ray()
    yield
    if owns:
        ray.shutdown()
