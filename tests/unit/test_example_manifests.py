"""Every example manifest works before step 0: `rlhf validate` accepts it (with `--cluster` for
the cluster examples), and its algorithm and reward functions build. No GPU, no cluster."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = sorted((Path(__file__).resolve().parents[2] / "manifests" / "examples").glob("*.yaml"))
#: Examples written for a cluster (their storage must be right there, too).
CLUSTER = {"first-job", "grpo-h100", "grpo-pvc", "ppo-two-pools", "grpo-7b-8xh100"}


def _job(path: Path):
    from rlhf_api.loader import load_manifest

    return load_manifest(path)


def test_the_examples_are_all_here():
    assert {p.stem for p in EXAMPLES} >= CLUSTER | {"quickstart", "grpo", "ppo"}


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_rlhf_validate_accepts_the_example(path: Path):
    args = ["validate", str(path)] + (["--cluster"] if path.stem in CLUSTER else [])
    done = subprocess.run(
        [sys.executable, "-m", "rlhf_trainer.cli", *args], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert f"{path}: valid" in done.stdout


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_the_examples_algorithm_and_rewards_build(path: Path):
    """What the trainer builds at step 0 from the manifest: the algorithm with its params (an
    unknown param is an error there) and every reward function by import path."""
    from rlhf_trainer.algorithms import build_algorithm
    from rlhf_trainer.rewards import FunctionReward

    spec = _job(path).spec
    algorithm = build_algorithm(spec.algorithm.name, spec.algorithm.params)
    assert algorithm is not None
    for fn in spec.reward.functions:
        reward = FunctionReward(fn.path, fn.kwargs)
        assert callable(reward.compute_reward)


def test_final_answer_reads_gsm8k_answers():
    from rlhf_trainer.rewards.builtin import final_answer, final_number

    assert final_number("She pays 3 * 4 = 12 dollars.\n#### 1,200") == "1200"
    assert final_number("so the answer is 7.50") == "7.5"
    assert final_number("no number") is None
    scores = final_answer(
        ["q"] * 4,
        ["... so 18 in all. #### 18", "The answer is 18.", "I think 17", "eighteen"],
        answer=["Janet ... = 18\n#### 18"] * 4,
    )
    assert scores == [1.0, 1.0, 0.0, 0.0]
