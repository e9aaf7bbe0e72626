"""tests/gpu/device_check.sh runs anywhere: on a machine without a GPU it runs to the end, reports
the machine, and skips every GPU stage with "needs a GPU", writing its three small files."""

from __future__ import annotations

import json
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

GPU = Path(__file__).resolve().parents[1] / "gpu"
SCRIPT = GPU / "device_check.sh"


def _stage_names() -> list[str]:
    sys.path.insert(0, str(GPU))
    try:
        from device_check import STAGES
    finally:
        sys.path.remove(str(GPU))
    return [s.name for s in STAGES]


def test_every_stage_has_its_module() -> None:
    names = _stage_names()
    assert names[0] == "machine" and len(names) == len(set(names))
    missing = [n for n in names if not (GPU / "stages" / f"{n}.py").is_file()]
    assert not missing, f"stages without a module under tests/gpu/stages/: {missing}"


def test_device_check_skips_every_gpu_stage_without_a_gpu(tmp_path: Path) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: device_check.sh would run the GPU stages (run it directly)")
    out = tmp_path / "out"
    scratch_parent = tmp_path / "tmp"
    scratch_parent.mkdir()
    done = subprocess.run(
        ["bash", str(SCRIPT), str(out)],
        env={"PATH": "/usr/bin:/bin", "PYTHON": sys.executable, "TMPDIR": str(scratch_parent)},
        capture_output=True,
        text=True,
        timeout=170,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert sorted(p.name for p in out.iterdir()) == ["device_check.log", "device_check.xml", "figures.json"]
    assert list(scratch_parent.iterdir()) == [], "the scratch directory is removed at the end"
    figures = json.loads((out / "figures.json").read_text())["stages"]
    names = _stage_names()
    assert list(figures) == names
    assert figures["machine"]["status"] == "passed"
    assert figures["machine"]["figures"]["cuda_available"] is False
    assert "torch" in figures["machine"]["figures"]
    for name in names[1:]:
        assert figures[name]["status"] == "skipped", (name, figures[name])
        assert "needs a GPU" in figures[name]["reason"], (name, figures[name])
    suite = ET.parse(out / "device_check.xml").getroot().find("testsuite")
    assert suite is not None
    assert (suite.get("tests"), suite.get("failures"), suite.get("skipped")) == (
        str(len(names)),
        "0",
        str(len(names) - 1),
    )
    skipped = {c.get("name"): c.find("skipped") for c in suite.iter("testcase")}
    assert all("needs a GPU" in (skipped[n].get("message") or "") for n in names[1:])  # type: ignore[union-attr]
    log = (out / "device_check.log").read_text()
    assert "== machine: PASSED" in log and log.count("SKIPPED: needs a GPU") == len(names) - 1


@pytest.mark.parametrize("stage", ["grpo", "ipc"])
def test_a_gpu_stage_run_alone_without_a_gpu_says_needs_a_gpu(tmp_path: Path, stage: str) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    result = tmp_path / "r.json"
    done = subprocess.run(
        [
            sys.executable,
            str(GPU / "stages" / f"{stage}.py"),
            "--scratch",
            str(tmp_path / "s"),
            "--result",
            str(result),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    got = json.loads(result.read_text())
    assert got["status"] == "skipped" and "needs a GPU" in got["reason"], got
