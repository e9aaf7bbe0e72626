"""The GPU pods' start-up check (`rlhf_trainer.gpu_preflight`): driver versions as nvidia-smi and
/proc write them, the floor of each CUDA major version, the verdict's words, the image-label check,
and the wiring into `rlhf worker` (a GPU pod on an old driver stops before Ray starts)."""

from __future__ import annotations

from pathlib import Path

import pytest

from rlhf_trainer import gpu_preflight as g
from rlhf_trainer import worker_cli

PROC_580 = (
    "NVRM version: NVIDIA UNIX x86_64 Kernel Module  580.65.06  Sun Jul 27 07:09:39 UTC 2025\n"
    "GCC version:  gcc version 12.2.0 (Debian 12.2.0-14)\n"
)
PROC_570_OPEN = (
    "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  570.124.06  Release Build  "
    "(dvs-builder@U16-I3-D08-1-2)  Wed Feb 26 00:34:22 UTC 2025\nGCC version:  gcc version 13.3.0\n"
)


@pytest.mark.parametrize(
    ("text", "want"),
    [
        ("580.65.06\n", (580, 65, 6)),
        ("550.54\n", (550, 54)),
        (PROC_580, (580, 65, 6)),
        (PROC_570_OPEN, (570, 124, 6)),
        ("580", (580,)),
        ("", None),
        ("NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver.", None),
    ],
)
def test_driver_versions_as_nvidia_smi_and_proc_write_them(text: str, want: tuple[int, ...] | None) -> None:
    assert g.parse_driver_version(text) == want


@pytest.mark.parametrize(
    ("found", "needed", "ok"),
    [
        ("580.65.06", "580", True),
        ("590.10", "580", True),
        ("579.99.99", "580", False),
        ("570.124.06", "580", False),
        ("580.65.06", "580.65.06", True),
        ("580.65.05", "580.65.06", False),
        ("580", "580.65.06", False),
        ("1000.1", "580", True),
    ],
)
def test_compare(found: str, needed: str, ok: bool) -> None:
    assert g.compare(found, needed) is ok


def test_a_bad_floor_is_named() -> None:
    with pytest.raises(ValueError, match="RLHF_CUDA_DRIVER_MIN='r580'"):
        g.compare("580.65.06", "r580")


@pytest.mark.parametrize(
    ("cuda", "floor"),
    [("13.0", "580"), ("13.2", "580"), ("12.8", "525"), ("11.8", "450"), ("14.0", None), (None, None)],
)
def test_floor_of_each_cuda_major(cuda: str | None, floor: str | None) -> None:
    assert g.floor_for_cuda(cuda) == floor


def test_the_verdict_names_the_driver_found_and_the_one_needed() -> None:
    old = g.judge("570.124.06", "nvidia-smi", "580", "13.0")
    assert not old.ok
    assert "570.124.06" in old.message and ">= 580" in old.message and "CUDA 13.0" in old.message
    new = g.judge("580.65.06", "/proc/driver/nvidia/version", "580", "13.0")
    assert new.ok and new.message.endswith(": ok") and "580.65.06" in new.message
    unread = g.judge(None, "nvidia-smi: not on PATH", "580", "13.0")
    assert unread.ok and "could not read" in unread.message and "not checked" in unread.message


def test_the_driver_is_read_from_proc_then_from_nvidia_smi(tmp_path: Path) -> None:
    proc = tmp_path / "version"
    proc.write_text(PROC_570_OPEN)
    assert g.read_driver_version(proc, run=lambda cmd: "999.0") == ("570.124.06", str(proc))
    missing = tmp_path / "absent"
    assert g.read_driver_version(missing, run=lambda cmd: "580.65.06\n580.65.06\n") == (
        "580.65.06",
        "nvidia-smi",
    )
    found, why = g.read_driver_version(missing, run=lambda cmd: "No devices were found")
    assert found is None and str(missing) in why and "No devices were found" in why


def test_the_floor_comes_from_the_environment_first(tmp_path: Path) -> None:
    proc = tmp_path / "version"
    proc.write_text(PROC_580)
    assert g.preflight({}, proc=proc).ok == (
        g.floor_for_cuda(g.torch_cuda_version()) in (None, "580", "525", "450")
    )
    strict = g.preflight({g.ENV_DRIVER_MIN: "590"}, proc=proc)
    assert not strict.ok and ">= 590" in strict.message


@pytest.mark.parametrize(
    ("labels", "torch_cuda", "problem"),
    [
        (("13", "580"), "13.0", None),
        (("13.2", "580"), "13.2", None),
        (("13.0", "580"), "13.2", "carries CUDA 13.2"),
        (("12", "525"), "13.0", "carries CUDA 13.0"),
        (("13", "525"), "13.0", "needs >= 580"),
        (("13", "580"), None, "CPU build"),
    ],
)
def test_image_labels_must_say_what_torch_carries(
    labels: tuple[str, str], torch_cuda: str | None, problem: str | None
) -> None:
    got = g.label_problem(*labels, torch_cuda)
    assert (got is None) if problem is None else (got is not None and problem in got)


def test_a_gpu_pod_on_an_old_driver_stops_before_waiting_for_ray(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    proc = tmp_path / "version"
    proc.write_text(PROC_570_OPEN)
    monkeypatch.setattr(g, "PROC_VERSION", proc)
    monkeypatch.setenv(g.ENV_DRIVER_MIN, "580")
    lines: list[str] = []
    # An address nobody listens on: the pod must not get as far as waiting for it.
    rc = worker_cli.run_worker("127.0.0.1:9", 1, "{}", wait_timeout=0.1, run=lambda c, a: 0, log=lines.append)
    assert rc == 1
    assert len(lines) == 1 and "570.124.06 found" in lines[0] and ">= 580" in lines[0], lines
    lines.clear()
    assert worker_cli.run_worker("127.0.0.1:9", 0, "{}", wait_timeout=0.1, log=lines.append) == 1
    assert not any("GPU preflight" in ln for ln in lines), "a CPU pod does not check the driver"


def test_the_real_driver_read() -> None:
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU (reads this machine's NVIDIA driver)")
    found, where = g.read_driver_version()
    assert found is not None, where
    assert g.preflight().ok, g.preflight().message
