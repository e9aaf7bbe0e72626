"""The start-up check of a GPU process: is the node's NVIDIA driver new enough for the CUDA this
image's torch was built with? Said in one line before anything else runs, naming the driver found
and the one needed, instead of a CUDA error at the first kernel an hour into a gang start.

CUDA minor-version compatibility (NVIDIA's "CUDA Compatibility" guide, table "Minimum Required
Driver Version"): an application built with CUDA 13.x runs on drivers >= 580 (R580), one built
with 12.x on >= 525, 11.x on >= 450. The PyPI wheels of torch 2.13+ carry CUDA 13 (`cuda-toolkit
13`), so the trainer image needs R580 on every GPU node.

The floor: `RLHF_CUDA_DRIVER_MIN` when set (the image sets it, beside its OCI label
`dev.rlhf.cuda.driver-min`), else the table below for `torch.version.cuda`. The driver: read from
`/proc/driver/nvidia/version` (no CUDA initialisation: a rank may still choose its device after
this), else `nvidia-smi`. Importing this module is cheap (stdlib only); torch is imported only
to read its build's CUDA version, which initialises nothing.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlhf_api import contract

#: The minimum Linux driver branch for each CUDA major version (minor-version compatibility).
DRIVER_FLOOR_BY_CUDA_MAJOR = {13: "580", 12: "525", 11: "450"}
#: Overrides the floor (the image sets it to the floor of the CUDA its wheels carry).
ENV_DRIVER_MIN = contract.ENV_CUDA_DRIVER_MIN.name
#: The image's OCI label with the same floor (for `scripts/check_gpu_image.sh` and registries).
LABEL_DRIVER_MIN = "dev.rlhf.cuda.driver-min"
LABEL_CUDA = "dev.rlhf.cuda.version"
PROC_VERSION = Path("/proc/driver/nvidia/version")

_VERSION_RE = re.compile(r"\b(\d{3,4})\.(\d{1,3})(?:\.(\d{1,3}))?\b")


class DriverTooOld(RuntimeError):
    """The node's NVIDIA driver is older than the floor of this image's CUDA."""


def driver_version_text(text: str) -> str | None:
    """The driver version in `text`, as written: `580.65.06` from nvidia-smi's `driver_version`,
    or from the `NVRM version: NVIDIA UNIX x86_64 Kernel Module  580.65.06  ...` line of /proc.
    None when there is none. A bare branch (`580`) counts too, as the floor is written."""
    text = text.strip()
    if re.fullmatch(r"\d{3,4}", text):
        return text
    line = next((ln for ln in text.splitlines() if "NVRM" in ln), text)
    m = _VERSION_RE.search(line)
    return m.group(0) if m else None


def parse_driver_version(text: str) -> tuple[int, ...] | None:
    """`driver_version_text` as numbers (`(580, 65, 6)`), for comparing."""
    found = driver_version_text(text)
    return None if found is None else tuple(int(p) for p in found.split("."))


def floor_for_cuda(cuda: str | None) -> str | None:
    """The driver floor for a CUDA version string (`13.0`); None for a CPU build or an unknown
    major (nothing is claimed then)."""
    if not cuda:
        return None
    try:
        major = int(cuda.split(".")[0])
    except ValueError:
        return None
    return DRIVER_FLOOR_BY_CUDA_MAJOR.get(major)


def compare(found: str, needed: str) -> bool:
    """True when driver `found` is at least `needed` (both as nvidia-smi writes them)."""
    have, want = parse_driver_version(found), parse_driver_version(needed)
    if have is None:
        raise ValueError(f"driver version {found!r}: not a version like 580.65.06")
    if want is None:
        raise ValueError(f"{ENV_DRIVER_MIN}={needed!r}: not a driver version like 580 or 580.65.06")
    width = max(len(have), len(want))
    return have + (0,) * (width - len(have)) >= want + (0,) * (width - len(want))


def read_driver_version(
    proc: Path | None = None, run: Callable[[list[str]], str] | None = None
) -> tuple[str | None, str]:
    """`(version, where it was read)`; version None with the reasons when nothing could be read.
    `proc` (default `PROC_VERSION`) and `run` (runs nvidia-smi) are for tests."""
    proc = PROC_VERSION if proc is None else proc
    tried = []
    try:
        found = driver_version_text(proc.read_text())
        if found is not None:
            return found, str(proc)
        tried.append(f"{proc}: no version in it")
    except OSError as err:
        tried.append(f"{proc}: {err.strerror or err}")
    cmd = ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]
    if run is None and shutil.which(cmd[0]) is None:
        tried.append("nvidia-smi: not on PATH")
        return None, "; ".join(tried)
    try:
        out = (run or _run)(cmd)
        found = driver_version_text(out.splitlines()[0] if out.strip() else "")
        if found is not None:
            return found, "nvidia-smi"
        tried.append(f"nvidia-smi: printed {out.strip()[:80]!r}")
    except (OSError, subprocess.SubprocessError) as err:
        tried.append(f"nvidia-smi: {err}")
    return None, "; ".join(tried)


def _run(cmd: list[str]) -> str:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=20, check=True).stdout


def torch_cuda_version() -> str | None:
    """The CUDA version torch was built with (`torch.version.cuda`), read from torch's
    `version.py` without importing torch (a pod's entry point stays fast), else by importing it."""
    import importlib.util

    spec = importlib.util.find_spec("torch")
    if spec is None:
        return None
    for root in spec.submodule_search_locations or []:
        try:
            text = (Path(root) / "version.py").read_text()
        except OSError:
            continue
        m = re.search(r"^cuda\b[^=\n]*=\s*(?:'([^']*)'|\"([^\"]*)\"|None)", text, re.M)
        if m:
            return m.group(1) or m.group(2) or None
    import torch

    return torch.version.cuda  # type: ignore[no-any-return]


@dataclass(frozen=True)
class Verdict:
    ok: bool
    message: str


def judge(found: str | None, where: str, needed: str | None, cuda: str | None) -> Verdict:
    """The one line a GPU process prints at start-up (pure: the parts are read elsewhere)."""
    built = f"torch's CUDA {cuda}" if cuda else "torch (a CPU build: no CUDA)"
    if needed is None:
        return Verdict(True, f"GPU preflight: {built}; no driver floor to check")
    if found is None:
        return Verdict(
            True,
            f"GPU preflight: could not read the NVIDIA driver version ({where}); {built} needs "
            f"driver >= {needed}: not checked",
        )
    if compare(found, needed):
        return Verdict(
            True, f"GPU preflight: NVIDIA driver {found} found ({where}); {built} needs >= {needed}: ok"
        )
    return Verdict(
        False,
        f"GPU preflight: NVIDIA driver {found} found ({where}), but {built} needs driver >= {needed} "
        f"(R{needed.split('.')[0]} or newer). Upgrade the node's driver, or run an image built for "
        f"this driver's CUDA (docs/operator.md, 'GPU driver floor')",
    )


def preflight(environ: Any = None, **read: Any) -> Verdict:
    """Read the driver, the floor and torch's CUDA, and judge them."""
    cuda = torch_cuda_version()
    needed = contract.ENV_CUDA_DRIVER_MIN.get(environ) or floor_for_cuda(cuda)
    found, where = read_driver_version(**read)
    return judge(found, where, needed, cuda)


def exit_code(log: Callable[[str], None] | None = None) -> int:
    """For an entry point that was asked for GPUs: 0 to go on, 1 (said why) when the driver is
    older than the floor. Called before anything else runs."""
    verdict = preflight()
    (log or _stderr)(verdict.message)
    return 0 if verdict.ok else 1


def job_gpus(spec: Any) -> int:
    """GPUs the job's roles ask for (`spec.roles.<role>.resources.gpus`, summed)."""
    roles = spec.roles
    total = 0
    for name in ("actor", "critic", "reference", "reward", "rollout"):
        role = getattr(roles, name, None)
        total += int(getattr(getattr(role, "resources", None), "gpus", 0) or 0)
    return total


def exit_code_for_job(spec: Any, log: Callable[[str], None] | None = None) -> int:
    """`exit_code` when the job asks for GPUs; 0 without a word otherwise."""
    return exit_code(log) if job_gpus(spec) > 0 else 0


def label_problem(cuda_label: str, driver_min_label: str, torch_cuda: str | None) -> str | None:
    """What is wrong with an image's labels (`dev.rlhf.cuda.version`, `dev.rlhf.cuda.driver-min`)
    for the torch it holds, or None: the label's CUDA must be torch's (`13` matches `13.0`, `13.0`
    only `13.0`), and its driver floor the one this module's table gives for that CUDA."""
    if not torch_cuda:
        return f"torch is a CPU build, but the image's label says CUDA {cuda_label}"
    parts, have = cuda_label.split("."), torch_cuda.split(".")
    if have[: len(parts)] != parts:
        return f"torch carries CUDA {torch_cuda}, but the image's label {LABEL_CUDA} says {cuda_label}"
    want = floor_for_cuda(torch_cuda)
    if want != driver_min_label:
        return (
            f"the image's label {LABEL_DRIVER_MIN} says driver >= {driver_min_label}, but CUDA "
            f"{torch_cuda} needs >= {want} (gpu_preflight.DRIVER_FLOOR_BY_CUDA_MAJOR)"
        )
    return None


def _stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    """`python -m rlhf_trainer.gpu_preflight`: the start-up check alone; with `--labels CUDA
    DRIVER_MIN` (the image build, scripts/check_gpu_image.sh): do the labels fit this torch?"""
    import argparse

    ap = argparse.ArgumentParser(prog="python -m rlhf_trainer.gpu_preflight", description=main.__doc__)
    ap.add_argument("--labels", nargs=2, metavar=("CUDA", "DRIVER_MIN"), help="check an image's labels")
    a = ap.parse_args(argv)
    if a.labels is None:
        return exit_code()
    problem = label_problem(a.labels[0], a.labels[1], torch_cuda_version())
    _stderr(
        problem
        or f"image labels: CUDA {a.labels[0]}, driver >= {a.labels[1]}: match torch's CUDA {torch_cuda_version()}"
    )
    return 1 if problem else 0


if __name__ == "__main__":
    sys.exit(main())
