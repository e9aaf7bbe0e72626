"""Experiment trackers: each step's numeric metrics sent to TensorBoard, Weights & Biases or MLflow.

`spec.output.trackers` names which (all off by default). Each tracker is a small class in
`TRACKERS`, registered by the spec field that turns it on; `open_trackers(spec, run_dir, job)`
opens the enabled ones (a missing package is an error naming it and the field), and `Trackers`
fans every `log(step, metrics)` out to them. Only finite numbers are sent: tag names are the
metric keys as logged (`reward/mean`, `eval/greedy/reward_mean`, `timing/rollout`).

One run per job, across gang restarts and resumes: each tracker's run id is kept in the run
directory (`RUN_IDS_FILE`, on the checkpoint volume with the rest of the run dir on a cluster).
`open_trackers` alone reads and writes it: an attempt that resumed a checkpoint reopens the runs it
names and logs from the checkpoint's step on; a fresh start (`--no-resume`, no checkpoint yet)
starts new runs and overwrites it.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import math
import os
import secrets
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

#: Subfolder of the run directory that holds the TensorBoard event files.
TENSORBOARD_DIR = "tensorboard"
#: MLflow's store in the run directory when no MLFLOW_TRACKING_URI is set: a SQLite database
#: where SQLAlchemy is installed, else the file store's folder (`mlflow_local_store`).
MLFLOW_DB = "mlflow.db"
MLFLOW_DIR = "mlruns"
#: The run directory's record of each tracker's run id, by `spec.output.trackers` field
#: (`{"wandb": "...", "mlflow": "..."}`): what a resumed attempt reopens.
RUN_IDS_FILE = "tracker_runs.json"

log = logging.getLogger(__name__)


class TrackerError(RuntimeError):
    """A tracker that was asked for but cannot run (its package is missing)."""


def scalars(metrics: Mapping[str, Any]) -> dict[str, float]:
    """The finite numbers among `metrics` (booleans as 0/1; lists, strings, NaN and inf left out)."""
    out: dict[str, float] = {}
    for key, value in metrics.items():
        if isinstance(value, (int, float)) and math.isfinite(value):  # bools are ints
            out[key] = float(value)
    return out


@dataclass(frozen=True)
class Start:
    """How an attempt opens a tracker: `step`, the first step it will log (0 on a fresh start,
    the checkpoint's step on a resume); `run_id`, the tracker's run to continue (None: start a
    new run: a fresh start, or a tracker this run had not used before)."""

    step: int = 0
    run_id: str | None = None


def read_run_ids(run_dir: Path) -> dict[str, str]:
    """The run ids `RUN_IDS_FILE` holds (none when it is missing)."""
    path = run_dir / RUN_IDS_FILE
    if not path.is_file():
        return {}
    return {str(k): str(v) for k, v in json.loads(path.read_text()).items()}


def write_run_ids(run_dir: Path, ids: Mapping[str, str]) -> None:
    """Replace `RUN_IDS_FILE` whole or not at all: a pod killed mid-write leaves the old record,
    never a torn one."""
    path = run_dir / RUN_IDS_FILE
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}")
    with tmp.open("w") as f:
        json.dump(dict(ids), f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class Tracker:
    """One tracker: opened once per attempt of the run, `log` once per step, `close` at the end.
    `run_id` names its run for `RUN_IDS_FILE` (None: nothing to reopen, as TensorBoard's files)."""

    #: The field of `spec.output.trackers` that enables it.
    field: ClassVar[str] = ""
    #: The package it needs, as imported, and as installed with pip.
    module: ClassVar[str] = ""
    package: ClassVar[str] = ""
    run_id: str | None = None

    def __init__(self, run_dir: Path, job: str, project: str | None, config: dict[str, Any], start: Start):
        raise NotImplementedError

    def log(self, step: int, values: dict[str, float]) -> None:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError


class TensorBoardTracker(Tracker):
    """Event files under `<run dir>/tensorboard`, written by torch's `SummaryWriter` (which needs
    the `tensorboard` package, not TensorFlow). Each attempt adds an event file; its `purge_step`
    (the first step it logs) tells TensorBoard's reader to hide the earlier files' events at and
    after that step: those an attempt logged after its last checkpoint, or on a fresh start all of
    an older run's."""

    field = "tensorboard"
    module = "tensorboard"
    package = "tensorboard"

    def __init__(self, run_dir: Path, job: str, project: str | None, config: dict[str, Any], start: Start):
        from torch.utils.tensorboard import SummaryWriter

        self.dir = run_dir / TENSORBOARD_DIR
        self.writer = SummaryWriter(log_dir=str(self.dir), purge_step=start.step)

    def log(self, step: int, values: dict[str, float]) -> None:
        for key, value in values.items():
            self.writer.add_scalar(key, value, global_step=step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbTracker(Tracker):
    """One Weights & Biases run named after the job, the job's spec as its config. Its id is ours
    (W&B takes any id it is given) so that a resumed attempt can name it: `resume="allow"`
    continues the run with that id, or creates it where W&B has none (an offline run not synced
    yet). W&B's step only increases: the steps a resumed attempt logs again (after the
    checkpoint, up to where the failed attempt got) are dropped by W&B, which keeps the failed
    attempt's values there; the steps after those land as logged."""

    field = "wandb"
    module = "wandb"
    package = "wandb"

    def __init__(self, run_dir: Path, job: str, project: str | None, config: dict[str, Any], start: Start):
        import wandb

        self.run_id = start.run_id or secrets.token_hex(6)  # W&B's ids: letters and digits
        self.run = wandb.init(
            project=project,
            name=job,
            dir=str(run_dir),
            config=config,
            id=self.run_id,
            resume="allow",
            reinit="create_new",  # a run of its own, whatever else in the process uses wandb
        )

    def log(self, step: int, values: dict[str, float]) -> None:
        self.run.log(values, step=step)

    def close(self) -> None:
        self.run.finish()


def mlflow_local_store(run_dir: Path) -> str:
    """The MLflow store of a run without MLFLOW_TRACKING_URI, in its run directory.

    MLflow 3 decides the same way for its own default (`mlflow.tracking._tracking_service.utils.
    _get_default_tracking_uri`): `sqlite:///mlflow.db`, unless `./mlruns` already holds runs; and
    its file store refuses to open (in maintenance mode) unless MLFLOW_ALLOW_FILE_STORE is true.
    Here: `<run dir>/mlflow.db` where MLflow's SQL store can load (SQLAlchemy and Alembic: the full
    `mlflow` package has them, `mlflow-skinny` does not); else, or where `<run dir>/mlruns`
    already exists (a run begun there resumes there: its run id lives in that store), the file
    store, with MLflow's documented opt-out set for this process unless the user set it. Never
    called for a user's MLFLOW_TRACKING_URI."""
    files = run_dir / MLFLOW_DIR
    sql = all(importlib.util.find_spec(m) is not None for m in ("sqlalchemy", "alembic"))
    if sql and not files.exists():
        return f"sqlite:///{(run_dir / MLFLOW_DB).resolve()}"
    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    return files.resolve().as_uri()


class MlflowTracker(Tracker):
    """One MLflow run named after the job; without MLFLOW_TRACKING_URI, the store is in the run
    directory (`mlflow_local_store`). A resumed attempt reopens the run by its id
    (`start_run(run_id=...)`); MLflow keeps every value logged, so a step the failed attempt
    logged after its checkpoint holds both values (`get_metric_history`), the resumed attempt's
    the later by timestamp. MLflow's metric names allow `/`, so the keys stay as logged."""

    field = "mlflow"
    module = "mlflow"
    package = "mlflow"

    def __init__(self, run_dir: Path, job: str, project: str | None, config: dict[str, Any], start: Start):
        import mlflow
        from mlflow.exceptions import MlflowException

        from rlhf_api import contract

        # The user's store as given (set here too: a URI set earlier in the process would win over
        # the variable), else ours in the run dir.
        mlflow.set_tracking_uri(contract.ENV_MLFLOW_TRACKING_URI.get() or mlflow_local_store(run_dir))
        if project:
            mlflow.set_experiment(project)
        self.mlflow = mlflow
        self.run = None
        if start.run_id is not None:
            try:
                self.run = mlflow.start_run(run_id=start.run_id)
            except MlflowException as e:  # not in this store (MLFLOW_TRACKING_URI changed): a new run
                log.warning("MLflow run %s cannot be resumed (%s): starting a new run", start.run_id, e)
        if self.run is None:
            self.run = mlflow.start_run(run_name=job)
        self.run_id = self.run.info.run_id

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


def open_trackers(
    spec: Any,
    run_dir: Path,
    job: str,
    config: dict[str, Any] | None = None,
    resume_step: int | None = None,
) -> Trackers:
    """Open the trackers `spec.output.trackers` enables (none: an empty fan-out). `resume_step`:
    the step of the checkpoint this attempt resumed (`startup.maybe_resume`), whose runs it
    reopens from `RUN_IDS_FILE`; None, a fresh start: new runs, whatever the file names. The
    file is rewritten with the runs now open (on a resume, keeping the ids of trackers turned
    off for this attempt)."""
    check_installed(spec.output.trackers)
    project = spec.output.trackers.project
    ids = read_run_ids(run_dir) if resume_step is not None else {}
    opened = Trackers([])
    try:
        for cls in enabled(spec.output.trackers):
            start = Start(step=resume_step or 0, run_id=ids.get(cls.field))
            opened.trackers.append(cls(run_dir, job, project, config or {}, start))
        now = {**ids, **{t.field: t.run_id for t in opened.trackers if t.run_id}}
        if now or (run_dir / RUN_IDS_FILE).exists():  # a fresh start forgets an older run's ids
            write_run_ids(run_dir, now)
    except BaseException:
        opened.close()
        raise
    return opened
