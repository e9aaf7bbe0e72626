"""scripts/image_requirements.py: an image's requirements from pyproject.toml, pinned by its
constraints file (`-c FILE` first) when that file exists, so two builds get the same packages."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "image_requirements.py"


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=60)


def test_a_present_constraints_file_pins_the_install(tmp_path: Path) -> None:
    pins = tmp_path / "trainer-gpu.txt"
    pins.write_text("torch==2.14.0\nvllm==0.34.1\n")
    done = _run(str(ROOT / "pyproject.toml"), "--constraints", str(pins), "trainer", "operator", "gpu")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == f"-c {pins}"
    assert (
        any(ln.startswith("torch") for ln in lines)
        and any(ln.startswith("vllm") for ln in lines)
        and any(ln.startswith("kopf") for ln in lines)
    )


def test_an_absent_constraints_file_is_said_and_skipped(tmp_path: Path) -> None:
    done = _run(str(ROOT / "pyproject.toml"), "operator", "--constraints", str(tmp_path / "operator.txt"))
    assert done.returncode == 0, done.stderr
    assert not any(ln.startswith("-c") for ln in done.stdout.splitlines())
    assert "versions are not pinned" in done.stderr and not any(
        "torch" in ln for ln in done.stdout.splitlines()
    )


def test_an_unknown_extra_is_named() -> None:
    done = _run(str(ROOT / "pyproject.toml"), "gpux")
    assert done.returncode != 0 and "unknown extras ['gpux']" in done.stderr


def test_the_dockerfile_pins_every_image_with_its_file() -> None:
    text = (ROOT / "Dockerfile").read_text()
    for target, pins, extras in (
        ("operator", "operator", "operator"),
        ("trainer-cpu", "trainer-cpu", "trainer operator"),
        ("trainer", "trainer-gpu", "trainer operator gpu"),
    ):
        # The requirements stage makes the image's list with its pin file; the image installs that
        # list (and no other), with the pin file beside it.
        requirements = text.split(" AS requirements\n", 1)[1].split("\nFROM ", 1)[0]
        assert f"--constraints /opt/requirements/constraints/{pins}.txt {extras} >{pins}.txt" in requirements
        stage = text.split(f" AS {target}\n", 1)[1].split("\nFROM ", 1)[0]
        assert f"COPY --from=requirements /opt/requirements/{pins}.txt " in stage, target
        assert f"COPY --from=requirements /opt/requirements/constraints/{pins}.txt " in stage, target
        assert f"pip install -r /opt/requirements/{pins}.txt" in stage, target
        assert "COPY pyproject.toml" not in stage, target
    trainer = text.split(" AS trainer\n", 1)[1]
    for needed in ("gcc", "libibverbs1", "dev.rlhf.cuda.driver-min", "gpu_preflight --labels"):
        assert needed in trainer, needed
