"""The controller pod's API calls: every one has a timeout (a hung connection costs a step a few
seconds, never the run), and `status.progress` is written at most once per interval (the last and
evaluating steps always), each write saying when it was made and which checkpoint is the last. The hung connection is a real socket that accepts and never answers,
reached through the real kubernetes client."""

from __future__ import annotations

import datetime as dt
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from rlhf_api import contract
from rlhf_trainer.fleet.cluster_membership import API_REQUEST_TIMEOUT, KubernetesJob
from rlhf_trainer.run_cli import StatusReporter


class RecordingApi:
    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple[Any, ...], dict[str, Any]]] = []

    def patch_namespaced_custom_object_status(self, *args: Any, **kwargs: Any) -> None:
        self.calls.append(("patch", args, kwargs))

    def get_namespaced_custom_object(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        self.calls.append(("get", args, kwargs))
        return {"status": {}}


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_progress_is_written_at_most_once_per_interval() -> None:
    api, clock = RecordingApi(), Clock()
    report = StatusReporter(api, "j", "ns", min_interval=10.0, clock=clock)
    for step in range(1, 100):  # 99 steps of 0.5 s: 49.5 s
        clock.now += 0.5
        report(step, 100, {"reward/mean": 0.1}, None)
    written = [c[1][-1]["status"]["progress"]["step"] for c in api.calls]
    assert written == [1, 21, 41, 61, 81]
    clock.now += 0.5
    report(100, 100, {"reward/mean": 0.2}, 100)  # the last step: always
    clock.now += 0.1
    report(50, 100, {"eval/reward_mean": 0.3}, 100)  # an evaluating step: always
    assert [c[1][-1]["status"]["progress"]["step"] for c in api.calls][-2:] == [100, 50]


def test_each_write_says_when_it_was_made_and_the_last_checkpoint() -> None:
    api, clock = RecordingApi(), Clock()
    utc = dt.timezone.utc
    times = iter(
        [
            dt.datetime(2026, 12, 7, 14, 0, 0, 250_000, tzinfo=utc),
            dt.datetime(2026, 12, 7, 15, 0, 30, tzinfo=utc),
        ]
    )
    report = StatusReporter(api, "j", "ns", min_interval=10.0, clock=clock, wall_clock=lambda: next(times))
    report(1, 10, {}, None)  # no checkpoint yet
    clock.now += 30.0
    report(2, 10, {}, 2)
    first, second = [c[1][-1]["status"][contract.STATUS_PROGRESS] for c in api.calls]
    assert first[contract.PROGRESS_UPDATED] == "2026-12-07T14:00:00Z"
    assert contract.PROGRESS_CHECKPOINT_STEP not in first  # a merge patch: absent, never null
    assert second[contract.PROGRESS_UPDATED] == "2026-12-07T15:00:30Z"
    assert second[contract.PROGRESS_CHECKPOINT_STEP] == 2


def test_every_write_and_read_has_a_timeout() -> None:
    api = RecordingApi()
    StatusReporter(api, "j", "ns")(1, 10, {}, None)
    jobs = KubernetesJob(api, "j", "ns")
    jobs.read()
    jobs.patch_status({"status": {"rollout": {"syncedGeneration": 1}}})
    assert [c[0] for c in api.calls] == ["patch", "get", "patch"]
    assert all(c[2].get("_request_timeout") == API_REQUEST_TIMEOUT for c in api.calls)


@pytest.fixture
def silent_server() -> Iterator[int]:
    """A TCP server that accepts connections and never answers (a hung API connection)."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        server.settimeout(0.2)
        while not stop.is_set():
            try:
                held.append(server.accept()[0])
            except OSError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield server.getsockname()[1]
    stop.set()
    thread.join()
    for s in held:
        s.close()
    server.close()


def test_a_hung_api_connection_costs_the_step_its_timeout(silent_server: int) -> None:
    kubernetes = pytest.importorskip("kubernetes")
    config = kubernetes.client.Configuration()
    config.host = f"http://127.0.0.1:{silent_server}"
    config.retries = False
    api = kubernetes.client.CustomObjectsApi(kubernetes.client.ApiClient(config))
    report = StatusReporter(api, "j", "ns", request_timeout=(0.5, 0.5))
    started = time.monotonic()
    report(1, 10, {"reward/mean": 0.5}, None)  # logged, not raised
    assert time.monotonic() - started < 5.0
