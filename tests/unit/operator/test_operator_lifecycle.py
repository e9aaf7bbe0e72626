"""A job's end of life: no finalizer (deleting a job or its namespace never waits for the
operator), the daemon of a deleted or recreated job stops, and the operator's metrics forget it."""

from __future__ import annotations

import asyncio
import copy
import json
from pathlib import Path

import pytest
from operator_helpers import job
from test_operator_executor import FakeKube, run

from rlhf_operator import metrics
from rlhf_operator.executor import Executor


def test_no_registered_handler_puts_a_finalizer_on_jobs() -> None:
    import kopf

    from rlhf_operator import handlers

    registry = kopf.get_default_registry()
    daemons = [h for h in registry._spawning.get_all_handlers() if h.fn is handlers.job_worker]
    assert len(daemons) == 1, "the job daemon is registered once"
    spawning = registry._spawning.get_all_handlers()
    changing = registry._changing.get_all_handlers()
    assert spawning and not [h.id for h in [*spawning, *changing] if h.requires_finalizer]


def test_a_deleted_failed_job_leaves_the_jobs_by_phase_gauge() -> None:
    before = metrics.jobs_by_phase()["Failed"]
    body = job()
    body["spec"]["algorithm"] = {"name": "no-such-algorithm"}  # invalid spec: Failed at once
    fake = FakeKube(body)
    ex = Executor(fake)  # type: ignore[arg-type]
    assert run(ex).invalid
    assert metrics.jobs_by_phase()["Failed"] == before + 1
    assert metrics.JOBS.labels("Failed")._value.get() == before + 1  # what /metrics serves

    fake.job = None  # kubectl delete: the next pass finds it gone
    assert run(ex, 1).gone
    assert metrics.jobs_by_phase()["Failed"] == before
    assert metrics.JOBS.labels("Failed")._value.get() == before


def test_a_stopped_daemon_forgets_its_job_but_not_a_recreated_one() -> None:
    before = metrics.jobs_by_phase()
    fake = FakeKube(job())
    ex = Executor(fake)  # type: ignore[arg-type]
    ex.reconcile("ns", "j", uid="uid-1")
    assert metrics.jobs_by_phase()["Pending"] == before["Pending"] + 1
    ex.forget("ns", "j", "uid-1")  # the daemon stopped (deletion, operator pausing or stopping)
    assert metrics.jobs_by_phase() == before

    # Recreated under the same name: the old daemon's pass sees another UID and ends; forgetting
    # the old incarnation keeps the new one's series.
    ex.reconcile("ns", "j", uid="uid-1")
    assert fake.job is not None
    new = copy.deepcopy(fake.job)
    new["metadata"]["uid"] = "uid-2"
    new.pop("status")
    fake.job = new
    assert ex.reconcile("ns", "j", uid="uid-1").gone
    assert not ex.reconcile("ns", "j", uid="uid-2").gone
    ex.forget("ns", "j", "uid-1")
    assert metrics.jobs_by_phase()["Pending"] == before["Pending"] + 1
    ex.forget("ns", "j", "uid-2")
    assert metrics.jobs_by_phase() == before


def test_the_echo_of_the_operators_own_status_write_wakes_no_daemon(monkeypatch: pytest.MonkeyPatch) -> None:
    from rlhf_operator import handlers

    fake = FakeKube(job())
    ex = Executor(fake)  # type: ignore[arg-type]
    run(ex)
    assert fake.job is not None
    mine = fake.job["metadata"]["resourceVersion"]
    monkeypatch.setattr(handlers, "_executor", ex)
    wake = asyncio.Event()
    monkeypatch.setitem(handlers._wake, ("ns", "j"), {"uid": wake})

    def event(version: str, type_: str = "MODIFIED") -> bool:
        wake.clear()
        asyncio.run(
            handlers.job_event(name="j", namespace="ns", meta={"resourceVersion": version}, type=type_)
        )
        return wake.is_set()

    assert not event(mine)
    assert event(str(int(mine) + 1))  # someone else's write (kubectl, the controller pod)
    assert event(mine, "DELETED")
    ex.forget("ns", "j")


def test_kopf_neither_caps_nor_keeps_idle_the_per_object_workers(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """kopf handles each watched object's events in a worker of its own. Capped at 32 with kopf's
    5 s idle time, the events of a burst of new pods waited for idle workers to expire (seconds)."""
    import kopf

    from rlhf_operator import handlers

    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "c", "cluster": {"server": "https://127.0.0.1:1"}}],
        "users": [{"name": "u", "user": {"token": "t"}}],
        "contexts": [{"name": "x", "context": {"cluster": "c", "user": "u"}}],
        "current-context": "x",
    }
    from kubernetes import client
    from kubernetes.config import kube_config

    # configure() loads the kubeconfig into the client's process-wide default: restored afterwards.
    monkeypatch.setattr(client.Configuration, "_default", getattr(client.Configuration, "_default", None))
    (tmp_path / "kubeconfig").write_text(json.dumps(config))
    # The client reads $KUBECONFIG when it is imported: point its default there instead.
    monkeypatch.setattr(kube_config, "KUBE_CONFIG_DEFAULT_LOCATION", str(tmp_path / "kubeconfig"))
    monkeypatch.delenv("RLHF_OPERATOR_WORKER_LIMIT", raising=False)
    monkeypatch.setattr(handlers, "_executor", None)  # configure() makes one (on that kubeconfig)
    settings = kopf.OperatorSettings()
    handlers.configure(settings=settings)
    assert settings.queueing.worker_limit is None
    assert settings.queueing.idle_timeout <= 1.0


def test_the_api_client_pools_a_connection_per_calling_thread() -> None:
    from rlhf_operator import kube

    assert kube.Kube(pool_size=24).api.configuration.connection_pool_maxsize == 24


def test_the_jobs_by_phase_gauge_survives_passes_in_many_threads() -> None:
    """Passes run on a pool of threads (`handlers.PASS_WORKERS`): each records its job's phase
    and a stopping daemon forgets its job while others refresh the gauge. Unguarded, the tally
    iterated the phases while another thread changed them ("dictionary changed size during
    iteration": the pass raised after its work was done)."""
    import sys
    import threading

    errors: list[str] = []
    interval = sys.getswitchinterval()

    def passes(i: int) -> None:
        try:
            for k in range(1500):
                metrics.observe_phase("race", f"j{i}-{k % 40}", "Running", "u")
                metrics.forget_job("race", f"j{i}-{k % 40}", "u")
        except Exception as err:  # noqa: BLE001 - collected, asserted below
            errors.append(repr(err))

    sys.setswitchinterval(1e-6)  # switch threads as often as the interpreter can
    try:
        threads = [threading.Thread(target=passes, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(interval)
    assert not errors, errors
    assert not [k for k in metrics._phases if k[0] == "race"]


def test_a_pod_event_wakes_its_job_whatever_the_orphan_release_does(monkeypatch: pytest.MonkeyPatch) -> None:
    """A Kueue group pod being deleted and not released (Kueue preempting a live job, or the
    garbage collector deleting a deleted job's pods) makes the pod watch look for an orphan. That
    look-up must neither hold back nor swallow the wake-up of the job's daemon (a transient API
    error raised out of the handler before it woke the job), and it runs on the operator's pass
    pool, not the event loop's default executor (kopf's DNS lookups; a namespace's deletion sends
    an event for each of its pods, and kopf's per-object workers are uncapped)."""
    import threading

    from rlhf_operator import handlers, kube, kueue

    pod = {
        "metadata": {
            "name": "j-actor-0",
            "namespace": "ns",
            "uid": "pod-uid",
            "resourceVersion": "7",
            "labels": {"rlhf.dev/job-name": "j", "kueue.x-k8s.io/pod-group-name": "j-0123456789"},
            "deletionTimestamp": "2025-01-01T12:00:00Z",
        }
    }
    assert kueue.maybe_orphaned(pod)
    threads: list[str] = []

    class Failing(FakeKube):
        def get_job(self, namespace: str, name: str) -> dict | None:  # type: ignore[type-arg]
            threads.append(threading.current_thread().name)
            raise kube.Retry("the API server is restarting")

    ex = Executor(Failing(job()))  # type: ignore[arg-type]
    monkeypatch.setattr(handlers, "_executor", ex)
    wake = asyncio.Event()
    monkeypatch.setitem(handlers._wake, ("ns", "j"), {"uid": wake})

    async def deliver() -> None:
        await handlers.pod_event(
            namespace="ns", labels={"rlhf.dev/job-name": "j"}, event={"object": pod}, type="MODIFIED"
        )

    try:
        asyncio.run(deliver())
    finally:
        handlers._pods.forget("ns", "j")
        ex.forget("ns", "j")
    assert wake.is_set()
    assert threads and all(t.startswith("rlhf-pass") for t in threads), threads


def test_a_call_to_an_api_server_that_never_answers_ends_as_a_retry() -> None:
    """Every API call carries (connect, read) timeouts: a server that accepts the connection and
    never answers (stuck, or a black-holed address) costs the call its timeout, then the call is
    retried like a reset, instead of holding its thread (and the pass, or the CRD check every pass
    consults) for good."""
    import socket
    import threading

    from kubernetes import client

    from rlhf_operator import kube

    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)  # accepts (the kernel's backlog), never reads, never answers
    config = client.Configuration()
    config.host = f"http://127.0.0.1:{silent.getsockname()[1]}"
    api = kube.Kube(client.ApiClient(config), request_timeout=(1.0, 0.5))
    outcome: list[BaseException | None] = []

    def call() -> None:
        try:
            api.crd_annotations("rltrainingjobs.rlhf.dev")
            outcome.append(None)
        except BaseException as err:  # noqa: BLE001 - recorded for the assertion
            outcome.append(err)

    try:
        caller = threading.Thread(target=call, daemon=True)
        caller.start()
        caller.join(30)  # without a read timeout the call never returns
        assert not caller.is_alive(), "the call is still waiting for the silent server"
        assert len(outcome) == 1 and isinstance(outcome[0], kube.Retry), outcome
    finally:
        silent.close()
