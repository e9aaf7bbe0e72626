"""Experiment trackers: each step's numeric metrics sent to TensorBoard, Weights & Biases or MLflow.

`spec.output.trackers` names which (all off by default). Each tracker is a small class in
`TRACKERS`, registered by the spec field that turns it on; `open_trackers(spec, run_dir, job)`
opens the enabled ones (a missing package is an error naming it and the field), and `Trackers`
fans every `log(step, metrics)` out to them. Only finite numbers are sent: tag names are the
metric keys as logged (`reward/mean`, `eval/greedy/reward_mean`, `timing/rollout`).
"""

from __future__ import annotations

import importlib.util
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar

#: Subfolder of the run directory that holds the TensorBoard event files.
TENSORBOARD_DIR = "tensorboard"
#: Subfolder of the run directory MLflow writes to when no MLFLOW_TRACKING_URI is set.
MLFLOW_DIR = "mlruns"


class TrackerError(RuntimeError):
    """A tracker that was asked for but cannot run (its package is missing)."""


def scalars(metrics: Mapping[str, Any]) -> dict[str, float]:
    """The finite numbers among `metrics` (booleans as 0/1; lists, strings, NaN and inf left out)."""
    out: dict[str, float] = {}
    for key, value in metrics.items():
        if isinstance(value, (int, float)) and math.isfinite(value):  # bools are ints
            out[key] = float(value)
    return out


class Tracker:
    """One tracker: opened once per run, `log` once per step, `close` at the end."""

    #: The field of `spec.output.trackers` that enables it.
    field: ClassVar[str] = ""
    #: The package it needs, as imported, and as installed with pip.
    module: ClassVar[str] = ""
    package: ClassVar[str] = ""

    def __init__(self, run_dir: Path, job: str, project: str | None, config: dict[str, Any]):
        raise NotImplementedError

    def log(self, step: int, values: dict[str, float]) -> None:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError


class TensorBoardTracker(Tracker):
    """Event files under `<run dir>/tensorboard`, written by torch's `SummaryWriter` (which needs
    the `tensorboard` package, not TensorFlow)."""

    field = "tensorboard"
    module = "tensorboard"
    package = "tensorboard"

    def __init__(self, run_dir: Path, job: str, project: str | None, config: dict[str, Any]):
        from torch.utils.tensorboard import SummaryWriter

        self.dir = run_dir / TENSORBOARD_DIR
        self.writer = SummaryWriter(log_dir=str(self.dir))

    def log(self, step: int, values: dict[str, float]) -> None:
        for key, value in values.items():
            self.writer.add_scalar(key, value, global_step=step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbTracker(Tracker):
    """One Weights & Biases run named after the job, the job's spec as its config."""

    field = "wandb"
    module = "wandb"
    package = "wandb"

    def __init__(self, run_dir: Path, job: str, project: str | None, config: dict[str, Any]):
        import wandb

        self.run = wandb.init(project=project, name=job, dir=str(run_dir), config=config)

    def log(self, step: int, values: dict[str, float]) -> None:
        self.run.log(values, step=step)

    def close(self) -> None:
        self.run.finish()


class MlflowTracker(Tracker):
    """One MLflow run named after the job; without MLFLOW_TRACKING_URI, the store is
    `<run dir>/mlruns`. MLflow's metric names allow `/`, so the keys stay as logged."""

    field = "mlflow"
    module = "mlflow"
    package = "mlflow"

    def __init__(self, run_dir: Path, job: str, project: str | None, config: dict[str, Any]):
        import mlflow

        from rlhf_api import contract

        if not contract.ENV_MLFLOW_TRACKING_URI.is_set():
            mlflow.set_tracking_uri((run_dir / MLFLOW_DIR).resolve().as_uri())
        if project:
            mlflow.set_experiment(project)
        self.mlflow = mlflow
        self.run = mlflow.start_run(run_name=job)

    def log(self, step: int, values: dict[str, float]) -> None:
        self.mlflow.log_metrics(values, step=step)

    def close(self) -> None:
        self.mlflow.end_run()


#: Every tracker, by the `spec.output.trackers` field that turns it on.
TRACKERS: dict[str, type[Tracker]] = {t.field: t for t in (TensorBoardTracker, WandbTracker, MlflowTracker)}


def enabled(trackers_spec: Any) -> list[type[Tracker]]:
    """The tracker classes `spec.output.trackers` turns on, in `TRACKERS` order."""
    return [cls for name, cls in TRACKERS.items() if getattr(trackers_spec, name)]


def check_installed(trackers_spec: Any) -> None:
    """Raise `TrackerError` naming the field and the package of each enabled tracker whose
    package cannot be imported (at start, before any worker is started)."""
    missing = [cls for cls in enabled(trackers_spec) if importlib.util.find_spec(cls.module) is None]
    if missing:
        raise TrackerError(
            "; ".join(
                f"spec.output.trackers.{cls.field} is true but the `{cls.package}` package is not installed "
                f"(pip install {cls.package}, or set {cls.field}: false)"
                for cls in missing
            )
        )


class Trackers:
    """The run's open trackers; `log` sends a step's scalars to each of them."""

    def __init__(self, trackers: list[Tracker]):
        self.trackers = trackers

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        values = scalars(metrics)
        for t in self.trackers:
            t.log(step, values)

    def close(self) -> None:
        for t in self.trackers:
            t.close()
        self.trackers = []


def open_trackers(spec: Any, run_dir: Path, job: str, config: dict[str, Any] | None = None) -> Trackers:
    """Open the trackers `spec.output.trackers` enables (none: an empty fan-out)."""
    check_installed(spec.output.trackers)
    project = spec.output.trackers.project
    return Trackers([cls(run_dir, job, project, config or {}) for cls in enabled(spec.output.trackers)])
