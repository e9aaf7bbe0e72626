"""Stage `gpu_tests`: the project's GPU tests (marker `gpu`) that need neither Ray nor vLLM, with
pytest, in one process group. The tests that need Ray or vLLM skip themselves, naming what is
missing (`pytest.importorskip`). Their own JUnit XML goes to the check's output directory
(`gpu-tests.xml`); the counts are this stage's figures.
"""

from __future__ import annotations

import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

from common import ROOT, Stage, main, require

FILES = [
    "tests/gpu/test_gpu_paths.py",
    "tests/trainer/sync/test_sync_threads.py",
    "tests/trainer/components/test_rollout_hf.py",
]


def body(stage: Stage) -> None:
    require("pytest", "the project's GPU tests are pytest tests")
    require("transformers", "the tests build transformers models")
    out = Path(os.environ.get("DEVICE_CHECK_OUT") or stage.scratch)
    xml = out / "gpu-tests.xml"
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-m",
        "gpu",
        *FILES,
        "-p",
        "no:cacheprovider",
        f"--junitxml={xml}",
    ]
    env = {
        **os.environ,
        "PYTHONPATH": f"{ROOT / 'api'}:{ROOT / 'trainer'}:{ROOT / 'operator'}:{os.environ.get('PYTHONPATH', '')}",
    }
    done = subprocess.run(cmd, cwd=ROOT, env=env, timeout=140)
    counts = _counts(xml)
    stage.figures.update({f"tests_{k}": v for k, v in counts.items()})
    print(f"figure: gpu tests = {counts}", flush=True)
    stage.check("pytest -m gpu passes", done.returncode in (0, 5), f"exit {done.returncode}, {counts}")
    stage.check("some GPU test ran", counts.get("passed", 0) > 0, str(counts))


def _counts(xml: Path) -> dict[str, int]:
    if not xml.is_file():
        return {}
    suite = ET.parse(xml).getroot()
    suite = suite.find("testsuite") if suite.tag == "testsuites" else suite
    assert suite is not None
    total = int(suite.get("tests", 0))
    failed = int(suite.get("failures", 0)) + int(suite.get("errors", 0))
    skipped = int(suite.get("skipped", 0))
    return {"passed": total - failed - skipped, "failed": failed, "skipped": skipped}


if __name__ == "__main__":
    sys.exit(main("gpu_tests", body))
