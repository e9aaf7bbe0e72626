"""Experiment trackers (`spec.output.trackers`): TensorBoard event files read back with
tensorboard's own reader; a tracker whose package is missing stops the job naming it. One run per
job across restarts, with the real libraries and nothing sent anywhere (W&B offline, MLflow's
local store): the attempts go through the trainer's own resume path (`maybe_resume`,
`start_logging`, the loop's `log_step` and `save_checkpoint_if_due`, no Ray, no workers), a
killed attempt in a child process that SIGKILLs itself."""

from __future__ import annotations

import importlib.util
import logging
import math
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from rlhf_api.job import JobSpec
from rlhf_api.loader import parse_job, parse_spec
from rlhf_api.sections import TrackersSpec
from rlhf_trainer.controller import log_step, save_checkpoint_if_due
from rlhf_trainer.dataflow import DataStream
from rlhf_trainer.dataflow.context import TrainerContext
from rlhf_trainer.startup import Run, maybe_resume, start_logging, teardown
from rlhf_trainer.trackers import (
    MLFLOW_DIR,
    RUN_IDS_FILE,
    TENSORBOARD_DIR,
    TRACKERS,
    TrackerError,
    check_installed,
    enabled,
    open_trackers,
    read_run_ids,
    scalars,
)

needs = {
    name: pytest.mark.skipif(importlib.util.find_spec(name) is None, reason=f"{name} is not installed")
    for name in ("tensorboard", "wandb", "mlflow")
}


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


@needs["tensorboard"]
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


# -- one run per job across restarts -------------------------------------------------------------


@pytest.fixture
def offline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """W&B offline and quiet, its caches in tmp_path; MLflow on its local store in the run dir.
    The variables the trackers set themselves (MLFLOW_ALLOW_FILE_STORE) are restored afterwards."""
    home = tmp_path / "wandb-home"
    for name, value in {
        "WANDB_MODE": "offline",
        "WANDB_SILENT": "true",
        "WANDB_CONSOLE": "off",
        "WANDB_DISABLE_GIT": "true",
        "WANDB_DISABLE_CODE": "true",
        "WANDB_CONFIG_DIR": str(home / "config"),
        "WANDB_CACHE_DIR": str(home / "cache"),
        "WANDB_DATA_DIR": str(home / "data"),
    }.items():
        monkeypatch.setenv(name, value)
    for name in (
        "WANDB_API_KEY",
        "WANDB_PROJECT",
        "WANDB_RUN_ID",
        "WANDB_RESUME",
        "MLFLOW_TRACKING_URI",
        "MLFLOW_ALLOW_FILE_STORE",
        "MLFLOW_EXPERIMENT_NAME",
        "MLFLOW_EXPERIMENT_ID",
        "MLFLOW_RUN_ID",
    ):
        monkeypatch.delenv(name, raising=False)


class _State:
    """A dataset or algorithm position: what a checkpoint saves and a resume loads."""

    consumed = 0

    def state_dict(self) -> dict[str, Any]:
        return {"position": 1}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


def attempt(
    run_dir: Path, trackers: list[str], resume: bool, stop: int, offset: float, close: bool = True
) -> Run:
    """One attempt of a 5-step job checkpointing every 2 steps, as a (re)started controller runs
    it: resume (or not), open the logs, run the steps up to `stop` (reward `offset + step`)."""
    doc = {
        "apiVersion": "rlhf.dev/v1alpha1",
        "kind": "RLTrainingJob",
        "metadata": {"name": "trk"},
        "spec": {
            "model": {"path": "m"},
            "data": {"path": "d.jsonl"},
            "reward": {"functions": [{"path": "rlhf_trainer.rewards.builtin:arithmetic_exact"}]},
            "training": {"steps": 5},
            "checkpoint": {"every": 2},
            "output": {
                "progress": False,
                "report": False,
                "metricsPort": 0,
                "trackers": dict.fromkeys(trackers, True),
            },
        },
    }
    none: Any = None
    ctx = TrainerContext(parse_job(doc).spec, "trk", run_dir, none, _State(), _State())  # type: ignore[arg-type]
    ctx.actor = none  # no trained role writes a part: the controller's part alone
    r = Run(ctx=ctx, stream=DataStream(), start_step=0, checkpoint_dir=run_dir / "checkpoints")
    r.start_step = maybe_resume(r, resume)
    start_logging(r, None)
    for step in range(r.start_step, stop):
        log_step(r, step, {"reward/mean": offset + step})
        save_checkpoint_if_due(r, step + 1)
    if close:
        teardown(r)
    return r


def _wandb_runs(run_dir: Path) -> list[str]:
    """The ids of the offline W&B runs under the run dir, one per attempt (`offline-run-<time>-<id>`)."""
    return sorted(p.name.rsplit("-", 1)[1] for p in (run_dir / "wandb").glob("offline-run-*"))


def _mlflow_history(run_dir: Path, run_id: str) -> list[tuple[int, float]]:
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=(run_dir / MLFLOW_DIR).resolve().as_uri())
    return sorted((m.step, m.value) for m in client.get_metric_history(run_id, "reward/mean"))


@needs["wandb"]
@pytest.mark.usefixtures("offline")
def test_wandb_a_resumed_run_continues_the_run_a_fresh_one_does_not(tmp_path: Path) -> None:
    attempt(tmp_path, ["wandb"], resume=True, stop=3, offset=0.0)  # steps 0-2, checkpoint at 2
    first = read_run_ids(tmp_path)["wandb"]
    attempt(tmp_path, ["wandb"], resume=True, stop=5, offset=10.0)  # the gang restart: steps 2-4
    assert read_run_ids(tmp_path) == {"wandb": first}
    assert _wandb_runs(tmp_path) == [first, first]  # two attempts, one run
    attempt(tmp_path, ["wandb"], resume=False, stop=1, offset=0.0)  # --no-resume
    fresh = read_run_ids(tmp_path)["wandb"]
    assert fresh != first
    assert sorted(_wandb_runs(tmp_path)) == sorted([first, first, fresh])


@needs["mlflow"]
@pytest.mark.usefixtures("offline")
def test_mlflow_a_resumed_run_continues_the_run_a_fresh_one_does_not(tmp_path: Path) -> None:
    from mlflow import MlflowClient

    attempt(tmp_path, ["mlflow"], resume=True, stop=3, offset=0.0)
    first = read_run_ids(tmp_path)["mlflow"]
    attempt(tmp_path, ["mlflow"], resume=True, stop=5, offset=10.0)
    assert read_run_ids(tmp_path) == {"mlflow": first}
    # step 2 was logged by both attempts: MLflow keeps both values
    assert _mlflow_history(tmp_path, first) == [(0, 0.0), (1, 1.0), (2, 2.0), (2, 12.0), (3, 13.0), (4, 14.0)]
    client = MlflowClient(tracking_uri=(tmp_path / MLFLOW_DIR).resolve().as_uri())
    assert len(client.search_runs(["0"])) == 1
    attempt(tmp_path, ["mlflow"], resume=True, stop=5, offset=20.0)  # the job had finished: nothing to log
    assert len(client.search_runs(["0"])) == 1
    # a run dir without checkpoints starts fresh even when asked to resume (the job recreated)
    import shutil

    shutil.rmtree(tmp_path / "checkpoints")
    attempt(tmp_path, ["mlflow"], resume=True, stop=2, offset=30.0)
    fresh = read_run_ids(tmp_path)["mlflow"]
    assert fresh != first
    assert _mlflow_history(tmp_path, fresh) == [(0, 30.0), (1, 31.0)]
    assert len(client.search_runs(["0"])) == 2


@needs["tensorboard"]
def test_tensorboard_a_resumed_run_hides_the_steps_after_its_checkpoint(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    def curve() -> list[tuple[int, float]]:
        events = EventAccumulator(str(tmp_path / TENSORBOARD_DIR))
        events.Reload()
        return [(e.step, e.value) for e in events.Scalars("reward/mean")]

    attempt(tmp_path, ["tensorboard"], resume=True, stop=3, offset=0.0)
    attempt(tmp_path, ["tensorboard"], resume=True, stop=5, offset=10.0)
    assert curve() == [(0, 0.0), (1, 1.0), (2, 12.0), (3, 13.0), (4, 14.0)]  # step 2: the resumed attempt's
    attempt(tmp_path, ["tensorboard"], resume=False, stop=2, offset=30.0)
    assert curve() == [(0, 30.0), (1, 31.0)]  # a fresh start: the older run's curve hidden
    assert not (tmp_path / RUN_IDS_FILE).exists()  # TensorBoard has no run to reopen


_KILLED = """
import os, signal, sys
from pathlib import Path
sys.path.insert(0, {tests!r})
from test_trackers import attempt
attempt(Path({run_dir!r}), ["wandb", "mlflow"], resume=True, stop=3, offset=0.0, close=False)
os.kill(os.getpid(), signal.SIGKILL)
"""


@pytest.mark.slow  # a child process importing the trainer and both trackers: 14 s, 45 s on 2 busy cores
@needs["wandb"]
@needs["mlflow"]
@pytest.mark.usefixtures("offline")
def test_an_attempt_killed_without_closing_is_resumed_into_the_same_runs(tmp_path: Path) -> None:
    code = _KILLED.format(tests=str(Path(__file__).parent), run_dir=str(tmp_path))
    # A pod of its own: not this process's W&B service (whose address wandb puts in WANDB_SERVICE).
    env = {k: v for k, v in os.environ.items() if k != "WANDB_SERVICE"}
    killed = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    ids = read_run_ids(tmp_path)
    assert set(ids) == {"wandb", "mlflow"}
    attempt(tmp_path, ["wandb", "mlflow"], resume=True, stop=5, offset=10.0)
    assert read_run_ids(tmp_path) == ids
    assert _wandb_runs(tmp_path) == [ids["wandb"]] * 2
    assert _mlflow_history(tmp_path, ids["mlflow"]) == [
        (0, 0.0),
        (1, 1.0),
        (2, 2.0),
        (2, 12.0),
        (3, 13.0),
        (4, 14.0),
    ]


@needs["mlflow"]
@pytest.mark.usefixtures("offline")
def test_mlflow_without_a_tracking_uri_opens_a_store_in_the_run_dir(tmp_path: Path) -> None:
    """MLflow 3 refuses its file store unless MLFLOW_ALLOW_FILE_STORE is true: our default store
    opens all the same (SQLite where SQLAlchemy is installed, not in this venv)."""
    trackers = open_trackers(_spec(mlflow=True), tmp_path, "job")
    trackers.log(0, {"reward/mean": 0.5})
    trackers.close()
    run_id = read_run_ids(tmp_path)["mlflow"]
    if importlib.util.find_spec("sqlalchemy") is None:
        assert _mlflow_history(tmp_path, run_id) == [(0, 0.5)]
    else:
        assert (tmp_path / "mlflow.db").is_file()


@needs["mlflow"]
@pytest.mark.usefixtures("offline")
def test_mlflow_a_users_tracking_uri_is_used_as_given(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = tmp_path / "server"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", store.as_uri())
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # the user's own opt-out, for a test-local store
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    trackers = open_trackers(_spec(mlflow=True), run_dir, "job")
    trackers.log(0, {"reward/mean": 0.5})
    trackers.close()
    assert not (run_dir / MLFLOW_DIR).exists() and not (run_dir / "mlflow.db").exists()
    from mlflow import MlflowClient

    history = MlflowClient(tracking_uri=store.as_uri()).get_metric_history(
        read_run_ids(run_dir)["mlflow"], "reward/mean"
    )
    assert [(m.step, m.value) for m in history] == [(0, 0.5)]


@needs["mlflow"]
@pytest.mark.usefixtures("offline")
def test_mlflow_a_run_id_the_store_lacks_starts_a_new_run(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    (tmp_path / RUN_IDS_FILE).write_text('{"mlflow": "0123456789abcdef0123456789abcdef", "wandb": "kept"}')
    with caplog.at_level(logging.WARNING, logger="rlhf_trainer.trackers"):
        trackers = open_trackers(_spec(mlflow=True), tmp_path, "job", resume_step=2)
    trackers.close()
    ids = read_run_ids(tmp_path)
    assert ids["mlflow"] != "0123456789abcdef0123456789abcdef" and ids["wandb"] == "kept"
    assert "cannot be resumed" in caplog.text
