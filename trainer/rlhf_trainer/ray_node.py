"""`python -m rlhf_trainer.ray_node start ...`: Ray's own `ray start`, made to survive a slow agent.

Every pod of a job on a cluster starts a Ray node: the controller pod the head, each role pod a
worker node (`rlhf worker`). A Ray node is a raylet plus two Python agents (the dashboard agent,
which serves metrics, and the runtime-env agent). When the agents bind port 0, the raylet waits
for each of them to write its port to a file in the session directory, and Ray gives that wait a
fixed 15 s with no setting to change it (ray-project/ray#65983): on a node where the whole gang
starts at once (and in the test suite, six pods on two cores) an agent that is still importing
misses it, the raylet aborts ("Timed out waiting for file .../metrics_agent_port_<node>") and the
pod fails, costing a gang restart.

A pod has its own network namespace, so the agents can bind fixed ports there without any
collision (`contract.RAY_AGENT_PORTS`); the raylet then knows every port up front and waits for no
file. Ray's CLI passes three of the four to the raylet; the dashboard agent's HTTP port it only
gives to the agent, so the raylet would still wait for that one's file. This entry point runs
Ray's CLI unchanged, except that it adds that one flag to the raylet's command line (the flag the
raylet itself defines). Where a future Ray starts the raylet differently, the addition is skipped
with a warning and the node starts as plain `ray start` would.

Every Ray the project starts, here (`ray start` on a pod) and in `startup.start_ray` (a local
`ray.init`), gives its workers the niceness of `worker_niceness` (0): Ray renices each non-driver
worker by +15 by default so that its own daemons keep the CPU, but here the workers are the job
(the actor's update, the rollout, the reward model), and a driver-side peer such as TRL runs at
the driver's priority.

A pod whose environment asks for token authentication (`RAY_AUTH_MODE=token`, set by the
operator on every pod) refuses to start a Ray older than `MIN_TOKEN_AUTH_RAY`: such a Ray ignores
the setting and its head would accept any client on the pod network (`check_token_auth`).

Importing this module is cheap (stdlib and the pod contract only); Ray is imported by `main`.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

from rlhf_api import contract

#: The first Ray that enforces `RAY_AUTH_MODE=token` (older ones ignore the variable); the trainer
#: extra's lower bound in pyproject.toml (tests/unit/test_pins.py keeps the two equal).
MIN_TOKEN_AUTH_RAY = (2, 52)

#: The exit code of a pod whose Ray cannot enforce the token the operator gave it.
EXIT_NO_TOKEN_AUTH = 3

#: The raylet's own flag for the dashboard agent's HTTP port (Ray's CLI does not pass it).
RAYLET_LISTEN_PORT_FLAG = "--dashboard_agent_listen_port"


def worker_niceness() -> int:
    """The niceness Ray's workers add to their raylet's: 0 (the raylet's own priority) unless the
    user sets `RAY_worker_niceness`. Ray reads the setting in each worker when it starts (its
    core worker calls `nice(worker_niceness)`), from the system config or else the environment."""
    return contract.ENV_RAY_worker_niceness.get_int()


def system_config() -> dict[str, int]:
    """The `_system_config` of a Ray the project starts with `ray.init` (a local head)."""
    return {"worker_niceness": worker_niceness()}


def agent_port_args(ports: contract.RayAgentPorts = contract.RAY_AGENT_PORTS) -> list[str]:
    """The `ray start` options that pin the node's agents to `ports` (pod-local)."""
    return [
        f"--metrics-export-port={ports.metrics_export}",
        f"--dashboard-agent-grpc-port={ports.dashboard_agent_grpc}",
        f"--dashboard-agent-listen-port={ports.dashboard_agent_listen}",
        f"--runtime-env-agent-port={ports.runtime_env_agent}",
    ]


def command(args: Sequence[str], python: str | None = None) -> list[str]:
    """The command line that runs `ray start ARGS` through this module, agents on fixed ports."""
    return [python or sys.executable, "-m", __name__, "start", *args, *agent_port_args()]


def listen_port_of(argv: Sequence[str]) -> int | None:
    """The `--dashboard-agent-listen-port` that `argv` (a `ray start` line) gives, if any."""
    for i, arg in enumerate(argv):
        if arg.startswith("--dashboard-agent-listen-port="):
            return int(arg.split("=", 1)[1])
        if arg == "--dashboard-agent-listen-port" and i + 1 < len(argv):
            return int(argv[i + 1])
    return None


def with_listen_port(raylet_command: list[str], port: int) -> list[str]:
    """`raylet_command` with the raylet told the dashboard agent's HTTP port (unless it is)."""
    if any(a.startswith(RAYLET_LISTEN_PORT_FLAG + "=") for a in raylet_command):
        return raylet_command
    return [*raylet_command, f"{RAYLET_LISTEN_PORT_FLAG}={port}"]


def install(port: int, services: Any = None) -> bool:
    """Makes Ray's process launcher add the listen-port flag to the raylet it starts. Returns
    whether it could (False, with a warning, where this Ray has no such launcher)."""
    if services is None:
        import ray._private.services as services
    launch = getattr(services, "start_ray_process", None)
    raylet = getattr(getattr(services, "ray_constants", None), "PROCESS_TYPE_RAYLET", None)
    if launch is None or raylet is None:
        print(
            "rlhf ray_node: this Ray has no services.start_ray_process; the raylet waits for the "
            "dashboard agent's port file as plain `ray start` does",
            file=sys.stderr,
        )
        return False

    def start_ray_process(cmd: list[str], process_type: str, *args: Any, **kwargs: Any) -> Any:
        if process_type == raylet:
            cmd = with_listen_port(list(cmd), port)
        return launch(cmd, process_type, *args, **kwargs)

    services.start_ray_process = start_ray_process
    return True


def check_token_auth(ray_version: str) -> str | None:
    """Why this Ray cannot start here, or None: the pod asks for token authentication and
    `ray_version` predates it."""
    if contract.ENV_RAY_AUTH_MODE.get() != "token":
        return None
    parts = [int(p) if p.isdigit() else 0 for p in ray_version.split(".")[:2]]
    if tuple(parts) >= MIN_TOKEN_AUTH_RAY:
        return None
    need = ".".join(map(str, MIN_TOKEN_AUTH_RAY))
    return (
        f"rlhf ray_node: this image's Ray is {ray_version}, which ignores RAY_AUTH_MODE=token "
        f"(token authentication needs Ray >= {need}): its head would accept any client on the "
        f"pod network. Build the image with ray>={need} (pip install 'rlhf-operator[trainer]')."
    )


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    import ray

    refused = check_token_auth(ray.__version__) if argv[:1] == ["start"] else None
    if refused:
        print(refused, file=sys.stderr)
        return EXIT_NO_TOKEN_AUTH
    port = listen_port_of(argv)
    if port:
        install(port)
    from ray.scripts.scripts import main as ray_main

    sys.argv = ["ray", *argv]
    # The raylet this starts, and every worker it spawns, inherit the environment.
    with contract.ENV_RAY_worker_niceness.overridden(str(worker_niceness())):
        try:
            ray_main()
        except SystemExit as done:
            return int(done.code or 0) if not isinstance(done.code, str) else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
