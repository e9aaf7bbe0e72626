"""`rlhf_trainer.ray_node`: the `ray start` every pod runs survives a dashboard agent slower than
the raylet's fixed 15 s wait for its port files (ray-project/ray#65983).

The slow agent is real: a `sitecustomize` on the node's PYTHONPATH holds each Ray agent process
for longer than Ray's wait before it imports anything, as a node with the whole gang starting on
two cores does. Plain `ray start` under that delay is the control: its raylet aborts, so the delay
does exceed Ray's wait and the test could fail."""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest

from rlhf_api import contract
from rlhf_operator.testing import free_port
from rlhf_trainer import ray_node

#: Longer than the raylet's fixed 15 s wait for an agent's port file.
AGENT_DELAY_S = 22

SITECUSTOMIZE = f"""
import os, sys, time
_agent = sys.argv[0].replace(os.sep, "/")
if _agent.endswith(("dashboard/agent.py", "runtime_env/agent/main.py")):
    time.sleep({AGENT_DELAY_S})
"""


def test_the_raylet_is_given_the_listen_port_and_nothing_else_changes():
    launched: list[tuple[list[str], str]] = []
    services = SimpleNamespace(
        start_ray_process=lambda cmd, kind, *a, **k: launched.append((cmd, kind)),
        ray_constants=SimpleNamespace(PROCESS_TYPE_RAYLET="raylet"),
    )
    assert ray_node.install(52365, services)
    services.start_ray_process(["/ray/raylet", "--node_id=1"], "raylet", True)
    services.start_ray_process(["python", "agent.py"], "dashboard_agent", True)
    services.start_ray_process(["/ray/raylet", "--dashboard_agent_listen_port=9"], "raylet", True)
    assert launched == [
        (["/ray/raylet", "--node_id=1", "--dashboard_agent_listen_port=52365"], "raylet"),
        (["python", "agent.py"], "dashboard_agent"),
        (["/ray/raylet", "--dashboard_agent_listen_port=9"], "raylet"),
    ]
    # A Ray without that launcher: a warning and no change, never an error.
    assert not ray_node.install(52365, SimpleNamespace())


def test_the_command_pins_every_agent_port_of_the_contract():
    cmd = ray_node.command(["--head", "--port=6379"], python="py")
    assert cmd[:5] == ["py", "-m", "rlhf_trainer.ray_node", "start", "--head"]
    ports = contract.RAY_AGENT_PORTS
    assert ray_node.listen_port_of(cmd) == ports.dashboard_agent_listen
    pinned = {int(a.split("=")[1]) for a in ray_node.agent_port_args()}
    assert pinned == {
        ports.metrics_export,
        ports.dashboard_agent_listen,
        ports.dashboard_agent_grpc,
        ports.runtime_env_agent,
    }
    # Pod-local, but never one of the ports the pod serves.
    assert not pinned & {contract.RAY_PORT, contract.METRICS_PORT}
    assert ray_node.listen_port_of(["--dashboard-agent-listen-port", "7"]) == 7
    assert ray_node.listen_port_of(["--head"]) is None


#: What the driver prints: a task's answer, then the niceness of a worker and of the driver.
PROBE = (
    "import os, ray; ray.init(address={address!r}); "
    "print(ray.get(ray.remote(lambda: 6 * 7).remote()), "
    "ray.get(ray.remote(lambda: os.nice(0)).remote()), os.nice(0))"
)


def _start(cmd: list[str], tmp: Path, timeout: float, slow_agents: bool = True) -> tuple[bool, str]:
    """Runs `cmd` (a `ray start --block` line) in its own session (with the slow agents unless
    not `slow_agents`); returns whether the node started and answered a task, and its output
    (ending in the driver's `PROBE` line). Stops everything it started."""
    site = tmp / "site"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(SITECUSTOMIZE if slow_agents else "")
    # Token auth with a token of the test's own, as the operator gives a job's pods.
    auth = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(16)}
    base = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"} | auth
    env = base | {"PYTHONPATH": f"{site}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    log = tmp / "ray-start.log"
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and proc.poll() is None:
            if ray_node_started(log):
                break
            time.sleep(0.5)
        if proc.poll() is not None or not ray_node_started(log):
            return False, log.read_text()
        # The address the node advertises, as `ray start` prints it for joining nodes.
        match = re.search(r"--address='([^']+)'", log.read_text())
        assert match, log.read_text()
        address = match.group(1)
        driver = subprocess.run(
            [sys.executable, "-c", PROBE.format(address=address)],
            capture_output=True,
            text=True,
            timeout=120,
            env=base,
        )
        answered = driver.stdout.strip().split("\n")[-1].startswith("42 ")
        return answered, log.read_text() + driver.stderr + driver.stdout
    finally:
        with_group = os.getpgid(proc.pid) if proc.poll() is None else None
        if with_group is not None:
            os.killpg(with_group, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=30)
        _kill_session(proc.pid)
        proc.wait(timeout=30)


def ray_node_started(log: Path) -> bool:
    return "Ray runtime started" in log.read_text()


def _session(sid: int) -> list[int]:
    pids = []
    for pid_dir in Path("/proc").iterdir():
        if pid_dir.name.isdigit():
            try:
                zombie = (pid_dir / "stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
                if os.getsid(int(pid_dir.name)) == sid and not zombie:
                    pids.append(int(pid_dir.name))
            except (OSError, IndexError):
                pass
    return pids


def _kill_session(sid: int) -> None:
    """SIGKILLs whatever is left of the session `sid`, and waits until it is gone."""
    deadline = time.monotonic() + 30
    while (left := _session(sid)) and time.monotonic() < deadline:
        for pid in left:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.2)
    assert not _session(sid), f"processes of the test's Ray node outlived it: {_session(sid)}"


@pytest.fixture
def short_tmp() -> Iterator[Path]:
    """A temp dir short enough for Ray's socket paths (AF_UNIX allows 107 bytes)."""
    path = Path(tempfile.mkdtemp(prefix="rn-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _raylet_errors(temp_dir: Path) -> str:
    return "".join(p.read_text(errors="replace") for p in temp_dir.glob("session_*/logs/raylet.*"))


@pytest.mark.slow
def test_a_node_with_agents_slower_than_rays_wait_starts(short_tmp: Path):
    head = [
        "start",
        "--head",
        f"--port={free_port()}",
        "--num-cpus=1",
        "--include-dashboard=false",
        "--disable-usage-stats",
        "--block",
    ]
    plain = short_tmp / "a"
    plain.mkdir()
    started, out = _start(
        [sys.executable, "-m", "ray.scripts.scripts", *head, f"--temp-dir={plain / 'r'}"], plain, 90
    )
    assert not started, (
        f"plain `ray start` survived a {AGENT_DELAY_S} s agent: the control shows nothing\n{out[-3000:]}"
    )
    # ... and for the reason this module exists, not another one.
    assert "Timed out waiting for file" in _raylet_errors(plain / "r"), out[-3000:]

    pinned = short_tmp / "b"
    pinned.mkdir()
    started, out = _start(ray_node.command([*head[1:], f"--temp-dir={pinned / 'r'}"]), pinned, 120)
    assert started, f"the node did not start, or did not run a task:\n{out[-3000:]}"
    assert "Timed out waiting for file" not in _raylet_errors(pinned / "r")


def _niceness(out: str) -> tuple[int, int]:
    """(worker, driver) niceness from the `PROBE` line that ends `out`."""
    _, worker, driver = out.strip().split("\n")[-1].split()
    return int(worker), int(driver)


@pytest.mark.slow
def test_a_pods_ray_node_runs_its_workers_at_the_drivers_priority(short_tmp: Path):
    """Ray renices each worker by `worker_niceness` (15 by default); a node the project starts
    (`ray_node`, as every pod does) gives 0, so the role workers run at the priority of the
    processes beside them. Plain `ray start` is the control: its workers sit 15 lower, so the
    probe does see the setting."""
    if os.nice(0) >= 19 - 15:
        pytest.skip(f"this test runs at niceness {os.nice(0)}: +15 would be capped at 19, indistinguishable")
    head = ["start", "--head", f"--port={free_port()}", "--num-cpus=1", "--include-dashboard=false"]
    head += ["--disable-usage-stats", "--block"]
    runs = {}
    for name, cmd in [
        ("plain", [sys.executable, "-m", "ray.scripts.scripts", *head]),
        ("project", ray_node.command(head[1:])),
    ]:
        (short_tmp / name).mkdir()
        started, out = _start([*cmd, f"--temp-dir={short_tmp / name / 'r'}"], short_tmp / name, 120, False)
        assert started, f"{name}: the node did not start, or did not run a task:\n{out[-3000:]}"
        runs[name] = _niceness(out)
    worker, driver = runs["plain"]
    assert worker == driver + 15, f"control: plain `ray start` workers at {worker}, driver at {driver}"
    worker, driver = runs["project"]
    assert worker == driver + ray_node.worker_niceness() == driver, (
        f"the project's node runs its workers at niceness {worker}, its driver at {driver}"
    )


#: A driver that starts a local Ray (`startup.start_ray`, as `rlhf run` does, or plain
#: `ray.init`), then prints the niceness of an actor and its own.
LOCAL_PROBE = """
import os, sys, ray
from rlhf_trainer.startup import start_ray
for attempt in range(3):  # Ray gives a local node a fixed 30 s to register: a loaded machine can miss it
    try:
        start_ray() if sys.argv[1] == "project" else ray.init(num_cpus=1, include_dashboard=False)
        break
    except Exception as err:
        if "timed out during startup" not in str(err) or attempt == 2:
            raise
        ray.shutdown()

@ray.remote
class Probe:
    def niceness(self):
        return os.nice(0)

print("NICE", ray.get(Probe.remote().niceness.remote()), os.nice(0))
ray.shutdown()
"""


@pytest.mark.slow
def test_rlhf_runs_local_ray_workers_at_the_drivers_priority(short_tmp: Path):
    """`rlhf run` starts Ray with `ray.init` (`startup.start_ray`): its role actors run at the
    driver's niceness. Plain `ray.init` is the control (+15)."""
    if os.nice(0) >= 19 - 15:
        pytest.skip(f"this test runs at niceness {os.nice(0)}: +15 would be capped at 19, indistinguishable")
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_worker_niceness")}
    env["RAY_TMPDIR"] = str(short_tmp)
    seen = {}
    for how in ("plain", "project"):
        run = subprocess.run(
            [sys.executable, "-c", LOCAL_PROBE, how], capture_output=True, text=True, timeout=300, env=env
        )
        line = next((ln for ln in run.stdout.splitlines() if ln.startswith("NICE ")), None)
        assert run.returncode == 0 and line, f"{how}: {run.stdout[-2000:]}{run.stderr[-3000:]}"
        seen[how] = tuple(int(x) for x in line.split()[1:])
    assert seen["plain"][0] == seen["plain"][1] + 15, f"control: plain ray.init gives {seen['plain']}"
    assert seen["project"][0] == seen["project"][1], (
        f"start_ray's actor and driver niceness: {seen['project']}"
    )


@pytest.mark.parametrize(
    "mode,version,refused",
    [
        ("token", "2.51.1", True),
        ("token", "2.9.3", True),  # compared as numbers, not strings
        ("token", "2.52.0", False),
        ("token", "3.0.0", False),
        (None, "2.40.0", False),  # no token asked for: nothing to enforce
    ],
)
def test_a_ray_that_ignores_token_auth_is_refused(
    monkeypatch: pytest.MonkeyPatch, mode: str | None, version: str, refused: bool
) -> None:
    if mode is None:
        monkeypatch.delenv(contract.ENV_RAY_AUTH_MODE.name, raising=False)
    else:
        monkeypatch.setenv(contract.ENV_RAY_AUTH_MODE.name, mode)
    why = ray_node.check_token_auth(version)
    assert (why is not None) == refused
    if why:
        assert version in why and "ray>=2.52" in why


def test_ray_start_exits_before_starting_when_its_ray_cannot_enforce_the_token(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The pod's `ray start` (through `main`) stops with its own exit code and the reason, before
    Ray's CLI runs: nothing listens unauthenticated."""
    import ray

    monkeypatch.setenv(contract.ENV_RAY_AUTH_MODE.name, "token")
    monkeypatch.setattr(ray, "__version__", "2.51.0")
    started: list[str] = []
    import ray.scripts.scripts as ray_scripts

    monkeypatch.setattr(ray_scripts, "main", lambda: started.append("ray"))
    assert ray_node.main(["start", "--head"]) == ray_node.EXIT_NO_TOKEN_AUTH
    assert not started
    assert "2.51.0" in capsys.readouterr().err


def test_the_token_auth_floor_is_the_trainer_extras_lower_bound() -> None:
    """One fact in two places: the Ray floor `ray_node` enforces and pyproject's `ray>=` bound."""
    import tomllib
    from packaging.requirements import Requirement

    pyproject = tomllib.loads((Path(__file__).parents[3] / "pyproject.toml").read_text())
    (ray_req,) = [
        Requirement(r)
        for r in pyproject["project"]["optional-dependencies"]["trainer"]
        if Requirement(r).name == "ray"
    ]
    (lower,) = [s.version for s in ray_req.specifier if s.operator == ">="]
    assert tuple(int(p) for p in lower.split(".")[:2]) == ray_node.MIN_TOKEN_AUTH_RAY
