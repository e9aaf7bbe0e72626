"""`rlhf worker`, the role pods' entrypoint: a bounded wait for the Ray head, then `ray start`.

Real sockets on loopback stand in for the head: one that starts listening late, one that never does.
"""

from __future__ import annotations

import contextlib
import copy
import re
import socket
import threading
import time
from collections.abc import Iterator, Sequence

import pytest

from rlhf_api import contract
from rlhf_api.loader import parse_job
from rlhf_operator import children
from rlhf_trainer import cli, ray_node, worker_cli


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def late_head() -> Iterator[int]:
    """A port on loopback where a listener appears after 1.5 s (the head starting after the pod)."""
    port = _free_port()
    stop = threading.Event()

    def serve() -> None:
        if stop.wait(1.5):
            return
        with socket.socket() as srv:
            srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            srv.bind(("127.0.0.1", port))
            srv.listen()
            srv.settimeout(0.1)
            while not stop.is_set():
                with contextlib.suppress(OSError):  # the accept timed out: look at `stop` again
                    srv.accept()[0].close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield port
    stop.set()
    thread.join(5)


class Run:
    """Records the `ray start` line instead of running Ray."""

    def __init__(self) -> None:
        self.calls: list[tuple[list[str], int]] = []

    def __call__(self, cmd: Sequence[str], attempts: int) -> int:
        self.calls.append((list(cmd), attempts))
        return 0


def test_waits_for_a_head_that_starts_late_then_execs_ray_start(
    late_head: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(contract.ENV_POD_IP.name, "10.1.2.3")
    monkeypatch.setenv(contract.ENV_POD_NAME.name, "j-actor-1")
    monkeypatch.setenv(contract.ENV_ROLE.name, "actor")
    monkeypatch.setenv(contract.ENV_REPLICA_INDEX.name, "1")
    lines: list[str] = []
    run = Run()
    address = f"127.0.0.1:{late_head}"
    t0 = time.monotonic()
    rc = worker_cli.run_worker(
        address, 8, '{"rlhf.dev/role-actor": 1}', wait_timeout=30, run=run, log=lines.append
    )
    assert rc == 0
    assert 1.0 < time.monotonic() - t0 < 15
    assert run.calls == [
        (
            ray_node.command(
                [
                    "--block",
                    f"--address={address}",
                    "--node-ip-address=10.1.2.3",
                    "--num-gpus=8",
                    '--resources={"rlhf.dev/role-actor": 1}',
                ]
            ),
            3,  # RLHF_RAY_START_ATTEMPTS' default
        )
    ]
    assert lines[0].startswith("GPU preflight: ")  # a GPU pod checks its driver before anything else
    assert (
        lines[1]
        == f"pod j-actor-1 (actor 1, restart attempt 0): waiting for the Ray head at {address} (up to 30 s)"
    )
    assert lines[-1].startswith(f"the Ray head at {address} answered after ")


def test_the_wait_logs_where_it_stands_every_few_seconds(late_head: int) -> None:
    lines: list[str] = []
    waited = worker_cli.wait_for_head("127.0.0.1", late_head, 30, log=lines.append, log_every=0.3, poll=0.1)
    assert waited >= 1.0
    assert len(lines) >= 2, lines
    assert re.match(
        rf"waiting for the Ray head at 127\.0\.0\.1:{late_head} \(\d+ s of 30 s\): no answer", lines[0]
    )


def test_a_head_that_never_listens_times_out_naming_the_address(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(contract.ENV_RAY_HEAD_TIMEOUT_S.name, "1.5")  # the default comes from the contract
    lines: list[str] = []
    run = Run()
    port = _free_port()
    t0 = time.monotonic()
    rc = worker_cli.run_worker(f"127.0.0.1:{port}", run=run, log=lines.append)
    assert rc == 1 and not run.calls
    assert 1.5 <= time.monotonic() - t0 < 6
    assert f"the Ray head at 127.0.0.1:{port} did not accept connections within 1.5 s" in lines[-1]
    assert "RLHF_RAY_HEAD_TIMEOUT_S" in lines[-1]


def test_a_name_that_does_not_resolve_says_so() -> None:
    with pytest.raises(
        worker_cli.HeadUnreachable, match=r"j-controller\.j\.ns\.svc\.invalid does not resolve"
    ):
        worker_cli.wait_for_head("j-controller.j.ns.svc.invalid", 6379, 0.5, log=lambda _: None, poll=0.1)


@pytest.mark.parametrize(
    "address,resources,message",
    [
        ("j-controller", "{}", "--address 'j-controller': expected HOST:PORT"),
        ("j-controller:99999", "{}", "port 99999 is outside 1..65535"),
        ("j-controller:6379", "actor", "--resources 'actor' is not JSON"),
        ("j-controller:6379", '["actor"]', "expected a JSON object of numbers"),
    ],
)
def test_bad_arguments_exit_2_naming_the_value(address: str, resources: str, message: str) -> None:
    lines: list[str] = []
    rc = worker_cli.run_worker(address, 0, resources, 1, run=Run(), log=lines.append)
    assert rc == 2 and message in lines[0]


def test_the_operators_role_pod_command_is_a_valid_rlhf_worker_line() -> None:
    body = {
        "apiVersion": "rlhf.dev/v1alpha1",
        "kind": "RLTrainingJob",
        "metadata": {"name": "j", "namespace": "ns"},
        "spec": {
            "model": {"path": "m"},
            "data": {"path": "d.jsonl"},
            "reward": {"functions": [{"path": "r:f"}]},
            "roles": {"placement": "disaggregated", "critic": {"replicas": 0}, "reference": {"replicas": 0}},
        },
    }
    pod = children.build_pod(parse_job(copy.deepcopy(body)), "rollout", 1)
    command = pod["spec"]["containers"][0]["command"]
    assert command[0] == "rlhf"
    args = cli.build_parser().parse_args(command[1:])
    assert args.func is worker_cli.cmd_worker
    assert args.address == contract.head_address("j", "ns")
    assert args.num_gpus == 0 and args.wait_timeout is None
    assert worker_cli.parse_address(args.address) == ("j-controller.j.ns.svc", contract.RAY_PORT)


# -- ray start under supervision: a failure before the node registered is tried again ------------


def _script(*attempts: tuple[str, int]) -> list[str]:
    """One `python -c` per attempt, printing `out` and exiting with `code` (a stand-in for Ray)."""
    return [f"import sys; print({out!r}); sys.exit({code})" for out, code in attempts]


def _popen_of(scripts: list[str], started: list[str]):
    import subprocess
    import sys

    def popen(cmd: Sequence[str], **kw: object):
        started.append(" ".join(cmd))
        return subprocess.Popen([sys.executable, "-c", scripts[len(started) - 1]], **kw)  # type: ignore[call-overload]

    return popen


def test_a_start_that_times_out_before_the_node_registered_is_tried_again() -> None:
    scripts = _script(
        ("Exception: The current node timed out during startup.", 1),
        (f"{worker_cli.RAY_STARTED}.", 0),
    )
    started: list[str] = []
    cleanups: list[int] = []
    lines: list[str] = []
    rc = worker_cli.supervise_ray_start(
        ["ray", "start", "--block"],
        3,
        log=lines.append,
        popen=_popen_of(scripts, started),
        cleanup=lambda: cleanups.append(1),
        pause=0,
    )
    assert rc == 0 and len(started) == 2 and cleanups == [1]
    assert lines == ["ray start failed before its node started (exit 1; attempt 1 of 3); trying again in 0 s"]


def test_a_failure_after_the_node_started_is_the_pods_exit() -> None:
    scripts = _script((f"{worker_cli.RAY_STARTED}.\nraylet died", 3), ("never", 0))
    started: list[str] = []
    rc = worker_cli.supervise_ray_start(
        ["ray"], 3, log=lambda _: None, popen=_popen_of(scripts, started), cleanup=lambda: None, pause=0
    )
    assert rc == 3 and len(started) == 1


def test_attempts_are_bounded() -> None:
    scripts = _script(("timed out", 1), ("timed out", 1))
    started: list[str] = []
    lines: list[str] = []
    rc = worker_cli.supervise_ray_start(
        ["ray"], 2, log=lines.append, popen=_popen_of(scripts, started), cleanup=lambda: None, pause=0
    )
    assert rc == 1 and len(started) == 2
    assert lines[-1] == "ray start failed 2 times before its node started (exit 1); giving up"


# -- SIGTERM: held until the job's Ray head is gone (the controller checkpoints with this pod) -----


def test_sigterm_reaches_ray_only_once_the_head_is_gone(late_head: int) -> None:
    """A stand-in `ray start --block` that exits on SIGTERM; the 'head' listens from 1.5 s on. The
    SIGTERM arrives at once, but reaches the child only after the head stopped listening."""
    import os
    import signal

    head_up = threading.Event()
    head_gone = threading.Event()
    times: dict[str, float] = {}
    script = (
        "import signal, sys, time\n"
        f"print({worker_cli.RAY_STARTED!r}, flush=True)\n"
        "signal.signal(signal.SIGTERM, lambda *a: sys.exit(143))\n"
        "time.sleep(60)\n"
    )

    def popen(cmd: Sequence[str], **kw: object):
        import subprocess
        import sys

        return subprocess.Popen([sys.executable, "-c", script], **kw)  # type: ignore[call-overload]

    def hold() -> None:
        worker_cli.wait_for_head("127.0.0.1", late_head, 10, log=lambda _: None, poll=0.05)
        head_up.set()
        head_gone.wait(10)  # the fixture's listener closes when the test ends: say "gone" here
        times["released"] = time.monotonic()

    def terminate_then_stop_the_head() -> None:
        time.sleep(0.5)
        times["sigterm"] = time.monotonic()
        os.kill(os.getpid(), signal.SIGTERM)
        head_up.wait(10)
        time.sleep(0.5)
        head_gone.set()

    previous = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    lines: list[str] = []
    threading.Thread(target=terminate_then_stop_the_head, daemon=True).start()
    try:
        rc = worker_cli.supervise_ray_start(["ray"], 1, log=lines.append, popen=popen, hold=hold)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    ended = time.monotonic()
    assert rc == 143
    assert times["released"] - times["sigterm"] >= 1.0  # held while the head still answered
    assert ended >= times["released"]
    assert any("until the job's Ray head is gone" in line for line in lines)


def test_wait_until_gone_returns_once_the_port_closes() -> None:
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen()
    port = srv.getsockname()[1]
    threading.Timer(0.6, srv.close).start()
    lines: list[str] = []
    waited = worker_cli.wait_until_gone("127.0.0.1", port, poll=0.05, log=lines.append)
    assert 0.4 <= waited < 5
    assert lines and "is gone after" in lines[0]
