"""Fixtures shared by the trainer's end-to-end tests (runtime, elastic)."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

#: Modules the tests name by import path in their manifests (rewards, pipelines).
TEST_MODULES = Path(__file__).resolve().parent / "runtime"


@pytest.fixture(scope="session")
def ray_session() -> Iterator[None]:
    """One local Ray instance for every run of the session. It is started once, by whichever test
    needs it first, so its workers' import path must already hold every test module
    (`runtime_rewards`, `runtime_pipelines`): Ray fixes the workers' PYTHONPATH at start."""
    import ray

    from rlhf_trainer.controller import start_ray

    if str(TEST_MODULES) not in sys.path:
        sys.path.insert(0, str(TEST_MODULES))
    owns = start_ray()
    yield
    if owns:
        ray.shutdown()
