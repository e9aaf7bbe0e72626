"""Helpers for tests and benchmarks that run the real operator against a real API server.

`OperatorProcess` runs `rlhf operator` as a subprocess (so it can be SIGKILLed and restarted like
a crashed pod), with a given kubeconfig (a ServiceAccount's, to test under the chart's RBAC),
and waits for its liveness endpoint. Not imported by the operator itself.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import IO, Any

from rlhf_api import contract
from rlhf_operator import images

#: The default trainer image of an operator the tests start (never pulled: kwok runs no pods).
TEST_TRAINER_IMAGE = "registry.invalid/rlhf-operator/trainer:test"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class OperatorProcess:
    def __init__(
        self,
        kubeconfig: str | Path,
        namespaces: list[str] | None = None,
        log_path: str | Path | None = None,
        env: dict[str, str] | None = None,
        metrics: bool = False,
        peering: str | None = None,
    ) -> None:
        self.kubeconfig = str(kubeconfig)
        self.namespaces = namespaces or []
        self.log_path = Path(log_path) if log_path else None
        self.env = env or {}
        self.health_port = free_port()
        self.metrics_port = free_port() if metrics else 0
        self.peering = peering
        self.proc: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None

    def start(self, timeout: float = 60) -> OperatorProcess:
        args = [sys.executable, "-m", "rlhf_operator", "operator"]
        args += [f"--namespace={ns}" for ns in self.namespaces] or ["--all-namespaces"]
        args += [f"--liveness=http://127.0.0.1:{self.health_port}{contract.HEALTHZ_PATH}"]
        if self.metrics_port:
            args += [f"--metrics-port={self.metrics_port}"]
        if self.peering:
            args += [f"--peering={self.peering}"]
        env = {
            **os.environ,
            "KUBECONFIG": self.kubeconfig,
            "RLHF_OPERATOR_DEBOUNCE_SECONDS": "0.05",
            # As the chart sets it (trainerImage): jobs of the tests need not name an image.
            images.ENV_TRAINER_IMAGE: os.environ.get(images.ENV_TRAINER_IMAGE, TEST_TRAINER_IMAGE),
            **self.env,
        }
        if self.log_path:
            self._log = open(self.log_path, "ab")  # noqa: SIM115 (closed in stop)
        self.proc = subprocess.Popen(
            args,
            env=env,
            stdout=self._log or subprocess.DEVNULL,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"rlhf operator exited with {self.proc.returncode}; log: {self.log_tail()}"
                )
            try:
                with urllib.request.urlopen(
                    f"http://127.0.0.1:{self.health_port}{contract.HEALTHZ_PATH}", timeout=1
                ):
                    return self
            except OSError:
                time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"rlhf operator not healthy within {timeout}s; log: {self.log_tail()}")

    def log_tail(self, chars: int = 4000) -> str:
        if self.log_path and self.log_path.exists():
            return self.log_path.read_text(errors="replace")[-chars:]
        return "(no log)"

    def kill(self) -> None:
        """SIGKILL: no cleanup, no finalizer removal, as when a node dies under the operator pod."""
        if self.proc and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def stop(self, timeout: float = 10) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()
        if self._log:
            self._log.close()
            self._log = None

    def __enter__(self) -> OperatorProcess:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def peak_rss_bytes(self) -> int:
        """Peak resident memory of the operator process so far (VmHWM), Linux only."""
        assert self.proc is not None
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
        return 0
