"""What every stage of tests/gpu/device_check.sh shares: its arguments, its result file, and the
two ways a stage does not pass (a missing package or GPU: skipped, with the reason; a check that
does not hold: failed, naming the figure and the bound).

A stage is a script run in its own process by `device_check.py`:

    python tests/gpu/stages/<name>.py --scratch DIR --result FILE [--device cuda]

It writes FILE (JSON: `status`, `reason`, `figures`, `checks`) and prints what it does. `--device
cpu` rehearses a stage's code path on a machine without a GPU (a development aid: the device
check itself always asks for CUDA, and never reports a CPU rehearsal as a GPU result).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import socket
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[3]


class Skip(Exception):
    """The stage cannot run here (no GPU, a missing package): skipped, never failed."""


class Stage:
    """One stage's run: its device, scratch directory, figures and named checks."""

    def __init__(self, name: str, device: str, scratch: Path):
        self.name = name
        self.device = device
        self.scratch = scratch
        self.figures: dict[str, Any] = {}
        self.checks: list[dict[str, Any]] = []

    @property
    def shared(self) -> Path:
        """Scratch shared by the stages of one check (the tiny model is made once, under a lock)."""
        return self.scratch.parent / "shared"

    def figure(self, key: str, value: Any, unit: str = "") -> None:
        self.figures[key] = value
        shown = f"{value:.4g}" if isinstance(value, float) else value
        print(f"figure: {key} = {shown}{(' ' + unit) if unit else ''}", flush=True)

    def check(self, name: str, ok: bool, detail: str = "") -> None:
        """Record a check; a failed one ends the stage (failed), naming `detail`."""
        self.checks.append({"name": name, "ok": bool(ok), "detail": detail})
        print(
            f"check: {name}: {'ok' if ok else 'FAILED'}{(' (' + detail + ')') if detail else ''}", flush=True
        )
        if not ok:
            raise AssertionError(f"{name}: {detail}")

    def note(self, name: str, detail: str) -> None:
        """A part of the stage that could not run here (e.g. needs 2 GPUs): said, not failed."""
        self.checks.append({"name": name, "ok": None, "detail": detail})
        print(f"check: {name}: skipped ({detail})", flush=True)


def require(module: str, why: str) -> Any:
    """Import `module`, or skip the stage saying what is missing and what needs it."""
    if importlib.util.find_spec(module) is None:
        raise Skip(f"needs {module} ({why}); not installed in {sys.executable}")
    return importlib.import_module(module)


def require_cuda(device: str) -> None:
    """A GPU stage on a machine without CUDA: skipped with "needs a GPU"."""
    if not device.startswith("cuda"):
        return
    torch = require("torch", "every stage")
    if not torch.cuda.is_available():
        raise Skip(f"needs a GPU (torch {torch.__version__}: torch.cuda.is_available() is False)")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def synchronize(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def main(name: str, body: Callable[[Stage], None], *, needs_gpu: bool = True) -> int:
    """Parse the stage's arguments, run `body`, write the result file. Exit 0 unless it failed."""
    ap = argparse.ArgumentParser(description=f"device check stage {name}")
    ap.add_argument("--scratch", type=Path, required=True, help="scratch directory (big files)")
    ap.add_argument("--result", type=Path, required=True, help="the result JSON to write")
    ap.add_argument("--device", default="cuda", help="cuda (the check) or cpu (a rehearsal)")
    a = ap.parse_args()
    a.scratch.mkdir(parents=True, exist_ok=True)
    for path in (ROOT / "api", ROOT / "trainer", ROOT / "tests" / "gpu"):
        if str(path) not in sys.path:
            sys.path.insert(0, str(path))
    os.environ.setdefault("RLHF_TORCH_THREADS", "4")
    stage = Stage(name, a.device, a.scratch)
    t0 = time.perf_counter()
    status, reason = "passed", ""
    try:
        if needs_gpu:
            require_cuda(a.device)
        body(stage)
    except Skip as err:
        status, reason = "skipped", str(err)
    except Exception as err:  # a failed check or an error: the stage failed, with the traceback
        traceback.print_exc()
        status, reason = "failed", f"{type(err).__name__}: {err}"
    seconds = time.perf_counter() - t0
    print(f"stage {name}: {status}{(': ' + reason) if reason else ''} ({seconds:.1f} s)", flush=True)
    result = {
        "status": status,
        "reason": reason,
        "seconds": round(seconds, 2),
        "device": a.device,
        "figures": stage.figures,
        "checks": stage.checks,
    }
    a.result.write_text(json.dumps(result, indent=1, default=str))
    return 1 if status == "failed" else 0
