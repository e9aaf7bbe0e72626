"""`rlhf worker`: the entrypoint of a role pod (actor, critic, reference, reward, rollout).

The operator creates a job's pods together, so a role pod usually starts before the controller
pod's Ray head listens. With `restartPolicy: Never` a plain `ray start --address=...` that loses
that race fails the pod and costs a gang restart (`failurePolicy.maxRestarts`). This entrypoint
first waits, bounded, until the head's DNS name resolves and its port accepts TCP, logging where it
stands every few seconds, then runs `ray start --block` joined with this pod's IP as the node
address, passing SIGTERM/SIGINT on to it. Ray gives a node 30 s to register with the head (fixed
in Ray); on a loaded node, with the whole gang starting at once, that can run out: a `ray start`
that fails *before* Ray reports the node started is tried again (`RLHF_RAY_START_ATTEMPTS`), since
a gang restart would only start the same race again. A failure after the start is the pod's exit.
The node is started through `rlhf_trainer.ray_node` (Ray's CLI, agents on fixed pod-local ports),
so a slow agent does not abort the raylet either.

Importing this module is cheap (stdlib and the pod contract only): the trainer image's role pods
run it before anything else.
"""

from __future__ import annotations

import argparse
import json
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from rlhf_api import contract
from rlhf_trainer import gpu_preflight, ray_node

#: How often the wait logs where it stands, and how often it probes the head.
LOG_EVERY_S = 5.0
POLL_S = 1.0
#: Bound of one TCP connect attempt (a silently dropped SYN must not eat the whole budget).
CONNECT_TIMEOUT_S = 2.0
#: What `ray start` prints once its node is registered with the head.
RAY_STARTED = "Ray runtime started"
#: Pause between two `ray start` attempts.
RETRY_PAUSE_S = 5.0


class HeadUnreachable(RuntimeError):
    """The Ray head did not accept connections within the wait's bound."""


def add_subcommands(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "worker",
        help="in-cluster entrypoint of a role pod: wait for the job's Ray head, then join it",
        description="Wait (bounded) until the Ray head's DNS name resolves and its port accepts TCP, "
        "then exec `ray start --block --address=ADDRESS --node-ip-address=$RLHF_POD_IP` with the "
        "given GPUs and resources. Exits 1, naming the address, when the head never answers.",
    )
    p.add_argument("--address", required=True, metavar="HOST:PORT", help="the job's Ray head")
    p.add_argument("--num-gpus", type=int, default=0, help="GPUs this pod gives Ray (default 0)")
    p.add_argument(
        "--num-cpus",
        type=int,
        help="CPUs this pod gives Ray (the pod's CPU request; default: Ray counts the node's cores, "
        "and starts that many idle workers)",
    )
    p.add_argument(
        "--resources",
        default="{}",
        metavar="JSON",
        help='Ray custom resources of this pod, e.g. {"rlhf.dev/role-actor": 1}',
    )
    p.add_argument(
        "--wait-timeout",
        type=float,
        metavar="SECONDS",
        help=f"how long to wait for the head (default ${contract.ENV_RAY_HEAD_TIMEOUT_S.name} "
        f"or {contract.ENV_RAY_HEAD_TIMEOUT_S.default})",
    )
    p.set_defaults(func=cmd_worker)


def cmd_worker(args: argparse.Namespace) -> int:
    return run_worker(args.address, args.num_gpus, args.resources, args.wait_timeout, num_cpus=args.num_cpus)


def _say(message: str) -> None:
    print(f"rlhf worker: {message}", file=sys.stderr, flush=True)


def describe_pod() -> str:
    """`pod j-actor-1 (actor 1, restart attempt 3)` from the pod contract's identity variables, for
    the first log line of a pod; `this host` outside an operator-built pod."""
    name = contract.ENV_POD_NAME.get()
    if not name:
        return "this host"
    role = contract.ENV_ROLE.get() or "?"
    index = contract.ENV_REPLICA_INDEX.get() or "?"
    attempt = contract.ENV_RESTART_ATTEMPT.get() or "0"
    return f"pod {name} ({role} {index}, restart attempt {attempt})"


def parse_address(address: str) -> tuple[str, int]:
    """`host:port` (or `[v6]:port`) -> (host, port), naming the bad value when it is neither."""
    host, sep, port_text = address.rpartition(":")
    host = host.strip("[]")
    valid = f"expected HOST:PORT, e.g. j-controller.j.ns.svc:{contract.RAY_PORT}"
    if not sep or not host or not port_text.isdigit():
        raise ValueError(f"--address {address!r}: {valid}")
    port = int(port_text)
    if not 0 < port < 65536:
        raise ValueError(f"--address {address!r}: port {port} is outside 1..65535")
    return host, port


def _check_resources(text: str) -> None:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        raise ValueError(f"--resources {text!r} is not JSON ({err.msg})") from None
    if not isinstance(value, dict) or not all(
        isinstance(v, (int, float)) and not isinstance(v, bool) for v in value.values()
    ):
        raise ValueError(
            f'--resources {text!r}: expected a JSON object of numbers, e.g. {{"rlhf.dev/role-actor": 1}}'
        )


def probe(host: str, port: int, connect_timeout: float = CONNECT_TIMEOUT_S) -> str | None:
    """None when `host:port` accepts a TCP connection, else why not (one short phrase)."""
    try:
        socket.create_connection((host, port), timeout=connect_timeout).close()
    except socket.gaierror as err:
        # A headless Service publishes a pod's record only once the pod has an IP.
        return f"{host} does not resolve yet ({err.strerror or err})"
    except OSError as err:
        return f"no answer on port {port} ({err.strerror or err})"
    return None


def wait_for_head(
    host: str,
    port: int,
    timeout: float,
    *,
    log: Callable[[str], None] = _say,
    log_every: float = LOG_EVERY_S,
    poll: float = POLL_S,
) -> float:
    """Block until `host:port` accepts TCP; return the seconds waited. Logs a line every
    `log_every` seconds while waiting; raises HeadUnreachable after `timeout` seconds."""
    start = time.monotonic()
    next_log = start + log_every
    while True:
        why = probe(host, port, connect_timeout=min(CONNECT_TIMEOUT_S, max(timeout, 0.1)))
        now = time.monotonic()
        waited = now - start
        if why is None:
            return waited
        if waited >= timeout:
            raise HeadUnreachable(
                f"the Ray head at {host}:{port} did not accept connections within {timeout:g} s "
                f"(last: {why}); is the controller pod running? "
                f"({contract.ENV_RAY_HEAD_TIMEOUT_S.name} sets how long to wait)"
            )
        if now >= next_log:
            log(f"waiting for the Ray head at {host}:{port} ({waited:.0f} s of {timeout:g} s): {why}")
            next_log = now + log_every
        time.sleep(min(poll, max(0.0, timeout - waited)))


def ray_start_command(
    address: str, num_gpus: int, resources: str, node_ip: str | None, num_cpus: int | None = None
) -> list[str]:
    """The `ray start` line a role pod runs once the head answers (through `ray_node`, which
    pins the node's agents to pod-local ports)."""
    cmd = ["--block", f"--address={address}"]
    if node_ip:
        # Ray would otherwise guess the node's address from a route lookup; the pod IP is the one
        # address other pods reach this pod's raylet and object manager on.
        cmd.append(f"--node-ip-address={node_ip}")
    if num_cpus is not None:
        # Without a CPU limit Ray counts the node's cores, not the pod's, and starts one idle
        # worker per core: on a shared node that is a pod's worth of processes per core.
        cmd.append(f"--num-cpus={num_cpus}")
    return ray_node.command([*cmd, f"--num-gpus={num_gpus}", f"--resources={resources}"])


def supervise_ray_start(
    cmd: list[str],
    attempts: int,
    *,
    log: Callable[[str], None] = _say,
    popen: Callable[..., Any] = subprocess.Popen,
    cleanup: Callable[[], object] | None = None,
    pause: float = RETRY_PAUSE_S,
    hold: Callable[[], object] | None = None,
) -> int:
    """Runs `cmd` (`ray start --block ...`), echoing its output, until it exits; returns its exit
    code. An attempt that fails before `RAY_STARTED` is printed is tried again, up to `attempts`,
    after `cleanup` (`ray stop --force`: what the failed attempt left). SIGTERM and SIGINT go to
    the running `ray start`, and stop the retries. With `hold`, a SIGTERM reaches it only once
    `hold()` returns (run in a thread): the controller checkpoints on SIGTERM (`preemption`)
    with this pod's Ray workers, so they stay until its Ray head is gone."""
    stopping = False
    proc: Any = None

    def send(signum: int) -> None:
        if proc is not None and proc.poll() is None:
            proc.send_signal(signum)

    def forward(signum: int, _frame: Any) -> None:
        nonlocal stopping
        already, stopping = stopping, True
        if hold is None or signum != signal.SIGTERM:
            send(signum)
        elif not already:
            log("SIGTERM: keeping this pod's Ray node until the job's Ray head is gone (its checkpoint)")

            def release() -> None:
                hold()
                send(signum)

            threading.Thread(target=release, daemon=True).start()

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, forward)
    rc = 1
    for attempt in range(1, attempts + 1):
        proc = popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1)
        started = False
        for line in proc.stdout:
            sys.stderr.write(line)
            started = started or RAY_STARTED in line
        sys.stderr.flush()
        rc = int(proc.wait())
        if rc == 0 or started or stopping:
            return rc
        if attempt == attempts:
            break
        log(
            f"ray start failed before its node started (exit {rc}; attempt {attempt} of {attempts}); "
            f"trying again in {pause:g} s"
        )
        (cleanup or _ray_stop)()
        time.sleep(pause)
    log(f"ray start failed {attempts} times before its node started (exit {rc}); giving up")
    return rc


def wait_until_gone(host: str, port: int, *, poll: float = 0.5, log: Callable[[str], None] = _say) -> float:
    """Block until `host:port` stops accepting TCP (the controller exited with its Ray head);
    returns the seconds waited. Unbounded: the kubelet's SIGKILL ends the grace period. The name
    is resolved once: the next attempt's controller pod takes the same DNS name, and its new head
    must not keep this pod waiting."""
    start = time.monotonic()
    try:
        address = str(socket.getaddrinfo(host, port, proto=socket.IPPROTO_TCP)[0][4][0])
    except OSError:  # no record any more: the head's pod is gone
        return 0.0
    while probe(address, port, connect_timeout=min(CONNECT_TIMEOUT_S, poll * 2)) is None:
        time.sleep(poll)
    waited = time.monotonic() - start
    log(f"the Ray head at {host}:{port} is gone after {waited:.1f} s; stopping this pod's Ray node")
    return waited


def _ray_stop() -> None:
    subprocess.run(["ray", "stop", "--force"], capture_output=True, timeout=60)


def run_worker(
    address: str,
    num_gpus: int = 0,
    resources: str = "{}",
    wait_timeout: float | None = None,
    *,
    num_cpus: int | None = None,
    run: Callable[[list[str], int], int] | None = None,
    log: Callable[[str], None] = _say,
) -> int:
    """Wait for the head at `address`, then run `ray start --block` under `supervise_ray_start`
    (`run` replaces it in tests). Returns 2 for bad arguments, 1 when the head never answered,
    else Ray's exit code."""
    try:
        host, port = parse_address(address)
        _check_resources(resources)
        if num_gpus < 0:
            raise ValueError(f"--num-gpus {num_gpus}: must be 0 or more")
        if num_cpus is not None and num_cpus < 1:
            raise ValueError(f"--num-cpus {num_cpus}: must be 1 or more")
        timeout = contract.ENV_RAY_HEAD_TIMEOUT_S.get_float() if wait_timeout is None else wait_timeout
        if timeout <= 0:
            raise ValueError(f"wait timeout {timeout:g} s: must be more than 0")
        attempts = contract.ENV_RAY_START_ATTEMPTS.get_int()
        if attempts < 1:
            raise ValueError(f"{contract.ENV_RAY_START_ATTEMPTS.name}={attempts}: must be 1 or more")
    except ValueError as err:
        log(str(err))
        return 2
    if num_gpus > 0 and (rc := gpu_preflight.exit_code(log)):  # the driver first, before Ray starts
        return rc
    log(f"{describe_pod()}: waiting for the Ray head at {host}:{port} (up to {timeout:g} s)")
    try:
        waited = wait_for_head(host, port, timeout, log=log)
    except HeadUnreachable as err:
        log(str(err))
        return 1
    cmd = ray_start_command(address, num_gpus, resources, contract.ENV_POD_IP.get(), num_cpus)
    log(f"the Ray head at {host}:{port} answered after {waited:.0f} s; running {shlex.join(cmd)}")
    try:
        if run is not None:
            return run(cmd, attempts)
        return supervise_ray_start(cmd, attempts, log=log, hold=lambda: wait_until_gone(host, port, log=log))
    except OSError as err:
        log(f"cannot run {cmd[0]!r}: {err} (the trainer image must have Ray on PATH)")
        return 1
