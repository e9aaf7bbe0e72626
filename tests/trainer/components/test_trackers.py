"""Experiment trackers (`spec.output.trackers`): TensorBoard event files read back with
tensorboard's own reader; a tracker whose package is missing stops the job naming it."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest

from rlhf_api.job import JobSpec
from rlhf_api.loader import parse_spec
from rlhf_api.sections import TrackersSpec
from rlhf_trainer.trackers import (
    TENSORBOARD_DIR,
    TRACKERS,
    TrackerError,
    check_installed,
    enabled,
    open_trackers,
    scalars,
)


def _spec(**trackers: object) -> JobSpec:
    return parse_spec(
        {
            "model": {"path": "m"},
            "data": {"path": "d.jsonl"},
            "reward": {"functions": [{"path": "a:b"}]},
            "output": {"trackers": dict(trackers)},
        }
    )


def test_trackers_are_off_by_default_and_the_registry_covers_every_field() -> None:
    assert enabled(_spec().output.trackers) == []
    flags = [
        f for f in TrackersSpec.__dataclass_fields__ if TrackersSpec.__dataclass_fields__[f].type == "bool"
    ]
    assert sorted(TRACKERS) == sorted(flags) == ["mlflow", "tensorboard", "wandb"]
    assert [t.field for t in enabled(_spec(tensorboard=True, mlflow=True).output.trackers)] == [
        "tensorboard",
        "mlflow",
    ]


def test_scalars_keep_finite_numbers_only() -> None:
    got = scalars({"a": 1, "b": 0.5, "c": math.nan, "d": math.inf, "e": [1, 2], "f": "x", "g": True})
    assert got == {"a": 1.0, "b": 0.5, "g": 1.0}


@pytest.mark.skipif(importlib.util.find_spec("tensorboard") is None, reason="tensorboard is not installed")
def test_tensorboard_event_files_hold_the_reward_scalar(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    spec = _spec(tensorboard=True)
    trackers = open_trackers(spec, tmp_path, "job")
    for step in range(3):
        trackers.log(step, {"reward/mean": 0.25 * step, "eval/reward_mean": 0.5, "reward/scores": [1, 0]})
    trackers.close()
    events = EventAccumulator(str(tmp_path / TENSORBOARD_DIR))
    events.Reload()
    assert set(events.Tags()["scalars"]) == {"reward/mean", "eval/reward_mean"}
    got = [(e.step, e.value) for e in events.Scalars("reward/mean")]
    assert got == [(0, 0.0), (1, 0.25), (2, 0.5)]


@pytest.mark.parametrize("name", ["wandb", "mlflow"])
def test_a_tracker_asked_for_without_its_package_names_it(name: str, tmp_path: Path) -> None:
    if importlib.util.find_spec(name) is not None:
        pytest.skip(f"{name} is installed here")
    spec = _spec(**{name: True})
    with pytest.raises(
        TrackerError, match=rf"spec\.output\.trackers\.{name} .*`{name}` package is not installed"
    ):
        check_installed(spec.output.trackers)
    with pytest.raises(TrackerError, match=name):
        open_trackers(spec, tmp_path, "job")
    assert not (tmp_path / TENSORBOARD_DIR).exists()
