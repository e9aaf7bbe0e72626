"""Lint, format and type checks run as part of the test suite (the same tools a contributor runs)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PY_DIRS = ["api", "operator", "trainer", "tests", "benchmarks"]


def _run(*cmd: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", *cmd], cwd=ROOT, capture_output=True, text=True)


def test_ruff_check():
    res = _run("ruff", "check", *PY_DIRS)
    assert res.returncode == 0, res.stdout + res.stderr


def test_ruff_format():
    res = _run("ruff", "format", "--check", *PY_DIRS)
    assert res.returncode == 0, res.stdout + res.stderr


def test_mypy_both_packages():
    res = _run("mypy", "api/rlhf_api", "operator/rlhf_operator", "trainer/rlhf_trainer")
    assert res.returncode == 0, res.stdout + res.stderr


def test_no_merge_conflict_markers():
    """A merge committed with its conflict unresolved (two branches' `<<<<<<<`/`=======`/`>>>>>>>`
    left in the file) breaks whatever imports it; in YAML, Markdown or the chart nothing else
    would notice."""
    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True)
    found = []
    for rel in files.stdout.splitlines():
        path = ROOT / rel
        try:
            lines = path.read_text().splitlines()
        except (OSError, UnicodeDecodeError):
            continue  # binary, or listed but absent
        for i, line in enumerate(lines, 1):
            if line.startswith(("<<<<<<< ", ">>>>>>> ")) or line == "=======" and rel.endswith(".py"):
                found.append(f"{rel}:{i}: {line}")
    assert not found, "unresolved merge conflicts:\n" + "\n".join(found)
