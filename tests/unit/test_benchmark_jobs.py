"""The benchmarks' jobs stay valid manifests of this checkout (a renamed spec field would break
them silently: they are not run by the suite), and their argument errors name the flag."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


def _ppo_module() -> Any:
    sys.path.insert(0, str(BENCH))
    try:
        import ppo_vs_before
    finally:
        sys.path.remove(str(BENCH))
    return ppo_vs_before


def test_the_ppo_benchmark_job_is_a_valid_ppo_job_with_a_critic_trained_twice_per_batch(
    tmp_path: Path,
) -> None:
    from rlhf_trainer.spec import parse_job

    bench = _ppo_module()
    a = argparse.Namespace(group=8, prompts=8, max_new_tokens=4, steps=8, lr=3e-4)
    job = parse_job(bench.job_document(tmp_path / "model", tmp_path / "prompts.jsonl", a))
    assert job.spec.algorithm.name == "ppo"
    assert job.spec.roles.critic.replicas == 1 and job.spec.roles.reference.replicas == 1
    assert job.spec.training.epochs_per_batch == 2
    assert job.spec.training.mini_batch_size == 64  # one mini-batch: the old-log-prob pass is needed twice


@pytest.mark.parametrize(
    "args, named",
    [
        ([], "--before"),
        (["--before", "/nonexistent"], "--before /nonexistent"),
        (["--before", str(BENCH.parent)], "--steps"),
    ],
)
def test_the_ppo_benchmark_refuses_bad_arguments_naming_them(args: list[str], named: str) -> None:
    extra = ["--steps", "2", "--warmup", "2"] if named == "--steps" else []
    res = subprocess.run(
        [sys.executable, str(BENCH / "ppo_vs_before.py"), *args, *extra],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 2, res.stderr
    assert named in res.stderr, res.stderr
