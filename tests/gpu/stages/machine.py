"""Stage `machine`: what this machine is, before anything runs on it. GPUs, the NVIDIA driver and
whether it meets the floor of torch's CUDA (`rlhf_trainer.gpu_preflight`), torch's CUDA and NCCL
versions, the C compiler and Python headers (Triton builds its launchers with them at run time),
and which optional packages are here (each later stage skips, naming what it lacks).

Runs on any machine (no GPU needed); `figures.cuda_available` tells the driver which GPU stages
can run at all.
"""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

from common import Stage, main

OPTIONAL = [
    "transformers",
    "safetensors",
    "yaml",
    "peft",
    "pytest",
    "ray",
    "vllm",
    "celpy",
    "triton",
    "numpy",
]


def _first_line(cmd: list[str]) -> str:
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError) as err:
        return f"unavailable ({err})"
    text = (out.stdout or out.stderr).strip()
    return text.splitlines()[0] if text else f"exit {out.returncode}"


def _versions(stage: Stage) -> None:
    from importlib.metadata import PackageNotFoundError, version

    present, missing = {}, []
    for mod in OPTIONAL:
        if importlib.util.find_spec(mod) is None:
            missing.append(mod)
            continue
        dist = {"yaml": "pyyaml", "celpy": "cel-python"}.get(mod, mod)
        try:
            present[mod] = version(dist)
        except PackageNotFoundError:
            present[mod] = "?"
    stage.figure("packages", present)
    stage.figure("packages_missing", missing)


def _compiler(stage: Stage) -> None:
    cc = next((c for c in ("cc", "gcc", "clang") if shutil.which(c)), None)
    stage.figure("c_compiler", _first_line([cc, "--version"]) if cc else "none on PATH")
    header = Path(sysconfig.get_paths()["include"]) / "Python.h"
    stage.figure("python_h", str(header) if header.is_file() else f"missing ({header})")


def _gpus(stage: Stage) -> None:
    from rlhf_trainer import gpu_preflight

    stage.figure("python", sys.version.split()[0])
    if importlib.util.find_spec("torch") is None:
        stage.figure("torch", "missing")
        stage.figure("cuda_available", False)
        stage.figure("cuda_reason", f"torch is not installed in {sys.executable}")
        found, where = gpu_preflight.read_driver_version()
        stage.figure("driver", found or f"unread ({where})")
        return
    import torch

    stage.figure("torch", torch.__version__)
    stage.figure("torch_cuda", torch.version.cuda or "none (CPU build)")
    verdict = gpu_preflight.preflight()
    stage.figure("driver_preflight", verdict.message)
    found, where = gpu_preflight.read_driver_version()
    stage.figure("driver", found or f"unread ({where})")
    available = bool(torch.cuda.is_available())
    stage.figure("cuda_available", available)
    if not available:
        stage.figure("cuda_reason", f"torch {torch.__version__}: torch.cuda.is_available() is False")
        return
    stage.figure("gpu_count", torch.cuda.device_count())
    props = torch.cuda.get_device_properties(0)
    stage.figure("gpu_name", props.name)
    stage.figure("gpu_memory_gib", round(props.total_memory / 2**30, 1))
    stage.figure("gpu_capability", f"{props.major}.{props.minor}")
    stage.figure("bf16_supported", bool(torch.cuda.is_bf16_supported()))
    try:
        stage.figure("nccl", ".".join(str(v) for v in torch.cuda.nccl.version()))
    except Exception as err:  # a build without NCCL says so
        stage.figure("nccl", f"unavailable ({err})")
    if shutil.which("nvidia-smi"):
        stage.figure(
            "nvidia_smi",
            _first_line(
                [
                    "nvidia-smi",
                    "--query-gpu=name,memory.total,driver_version,compute_cap",
                    "--format=csv,noheader",
                ]
            ),
        )
    stage.check("driver meets the floor of torch's CUDA", verdict.ok, verdict.message)


def body(stage: Stage) -> None:
    _versions(stage)
    _compiler(stage)
    _gpus(stage)


if __name__ == "__main__":
    sys.exit(main("machine", body, needs_gpu=False))
