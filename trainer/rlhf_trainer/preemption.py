"""SIGTERM in the controller: finish the step in progress, checkpoint it, stop.

A preempted, drained or deleted pod gets SIGTERM and `terminationGracePeriodSeconds` before
SIGKILL. Without a handler the controller (PID 1 of its container, where the kernel ignores a
signal that has no handler) trains on until the SIGKILL, and the steps since the last periodic
checkpoint are lost. With `Preemption` installed the signal only sets a flag; the loop checks it
at each step boundary (`controller.run`), writes a checkpoint of the step just done (unless the
periodic one just did) and raises `Preempted`, which the controller pod turns into exit code 143
(128 + SIGTERM). The gang's restart resumes at that step: no step is lost.

The role pods keep their Ray nodes up meanwhile (`worker_cli.supervise_ray_start` holds a SIGTERM
until the job's Ray head is gone), so the step and its checkpoint can finish; the kubelet's
SIGKILL at the end of the grace period bounds every wait.

`install` must run after `ray.init` (which sets its own SIGTERM handler in the driver) and in the
main thread (Python runs signal handlers there only).
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from typing import Any

log = logging.getLogger(__name__)

#: The controller's exit code after a checkpoint written on SIGTERM (the shell's 128 + 15).
EXIT_CODE = 128 + signal.SIGTERM


class Preempted(Exception):
    """The run stopped on SIGTERM after checkpointing step `step` (the next run resumes there)."""

    def __init__(self, step: int, checkpoint: Any, seconds: float):
        self.step, self.checkpoint, self.seconds = step, checkpoint, seconds
        super().__init__(
            f"stopped on SIGTERM after step {step}: checkpoint {checkpoint} written "
            f"{seconds:.1f} s after the signal; the next attempt resumes there"
        )


class Preemption:
    """Whether SIGTERM arrived (`requested`), and when (`since`, monotonic seconds)."""

    def __init__(self, signals: tuple[int, ...] = (signal.SIGTERM,)):
        self.signals = signals
        self.since: float | None = None

    @property
    def requested(self) -> bool:
        return self.since is not None

    def install(self) -> bool:
        """Handle `signals` from now on; False (and nothing changed) outside the main thread."""
        if threading.current_thread() is not threading.main_thread():
            log.warning("SIGTERM checkpointing is off: the run is not in the main thread")
            return False
        for sig in self.signals:
            signal.signal(sig, self._on_signal)
        return True

    def _on_signal(self, signum: int, _frame: Any) -> None:
        if self.since is None:  # a second SIGTERM changes nothing: the first one's checkpoint is coming
            self.since = time.monotonic()
            log.warning(
                "%s received: checkpointing at the end of the step in progress, then stopping",
                signal.Signals(signum).name,
            )

    def elapsed(self) -> float:
        return 0.0 if self.since is None else time.monotonic() - self.since
