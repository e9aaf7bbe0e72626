"""`rlhf validate` reads a manifest from standard input (`-`) and notes the roles the job will not
run (the same `spec.unused_roles` the operator and `rlhf run` follow)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import yaml

JOB = {
    "apiVersion": "rlhf.dev/v1alpha1",
    "kind": "RLTrainingJob",
    "metadata": {"name": "notes"},
    "spec": {
        "model": {"path": "m"},
        "data": {"path": "d.jsonl"},
        "reward": {"functions": [{"path": "rlhf_trainer.rewards.builtin:arithmetic_exact"}]},
        "algorithm": {"name": "grpo", "params": {"klCoef": 0}},
    },
}


def _validate(text: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "rlhf_trainer.cli", "validate", "-"],
        input=text,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.parametrize(
    ("algorithm", "dropped"),
    [
        ({"name": "grpo", "params": {"klCoef": 0}}, {"critic", "reference"}),
        ({"name": "grpo"}, {"critic"}),
        ({"name": "ppo"}, set()),
    ],
)
def test_stdin_and_the_notes_of_dropped_roles(algorithm: dict, dropped: set[str]) -> None:
    doc = {**JOB, "spec": {**JOB["spec"], "algorithm": algorithm}}
    out = _validate(yaml.safe_dump(doc))
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("<stdin>: valid (notes, algorithm ")
    noted = {
        line.split("spec.roles.")[1].split(":")[0] for line in out.stderr.splitlines() if ": note: " in line
    }
    assert noted == dropped, out.stderr


def test_stdin_errors_are_named() -> None:
    out = _validate("kind: Pod\n")
    assert (
        out.returncode == 1 and "<stdin>: expected exactly one RLTrainingJob document, found 0" in out.stderr
    )
