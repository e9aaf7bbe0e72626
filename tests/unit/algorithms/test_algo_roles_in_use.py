"""The roles a job runs are decided once, torch-free (`spec.unused_roles`, from what each built-in's
params declare), and the algorithm objects the trainer builds agree with it: an algorithm that
needs a critic or a reference policy is never left without one, and one that needs neither never
gets their workers (or, on a cluster, their pods)."""

from __future__ import annotations

from typing import Any

import pytest

from rlhf_api.algorithm_params import BUILTIN_PARAMS
from rlhf_api.job import roles_in_use, unused_roles
from rlhf_api.loader import parse_job
from rlhf_trainer.algorithms.base import build_algorithm

CASES = [(name, {}) for name in BUILTIN_PARAMS] + [
    (name, {"klCoef": 0})
    for name, cls in BUILTIN_PARAMS.items()
    if "kl_coef" in cls.__dataclass_fields__
    if name != "dynamic_kl_ppo"  # its klCoef lies in [betaMin, betaMax], betaMin > 0
]


def _spec(name: str, params: dict[str, Any]) -> Any:
    body = {
        "apiVersion": "rlhf.dev/v1alpha1",
        "kind": "RLTrainingJob",
        "metadata": {"name": "roles"},
        "spec": {
            "model": {"path": "m"},
            "data": {"path": "d.jsonl"},
            "reward": {"functions": [{"path": "a:b"}]},
            "algorithm": {"name": name, "params": params},
            "rollout": {"samplesPerPrompt": 2},
            "roles": {"placement": "disaggregated", **{r: {"replicas": 1} for r in ("critic", "reference")}},
        },
    }
    return parse_job(body).spec


@pytest.mark.parametrize(("name", "params"), CASES, ids=[f"{n}-{p}" for n, p in CASES])
def test_the_algorithm_and_the_roles_agree(name: str, params: dict[str, Any]) -> None:
    spec = _spec(name, params)
    algorithm = build_algorithm(name, params, job=spec)
    unused = unused_roles(spec)
    assert ("critic" not in unused) is bool(algorithm.needs_critic), unused
    assert ("reference" not in unused) is bool(algorithm.needs_reference), unused
    pods = roles_in_use(spec)
    assert ("critic" in pods) is bool(algorithm.needs_critic)
    assert ("reference" in pods) is bool(algorithm.needs_reference)


def test_grpo_without_kl_runs_neither_critic_nor_reference() -> None:
    spec = _spec("grpo", {"klCoef": 0})
    assert set(roles_in_use(spec)) == {"controller", "actor", "reward", "rollout"}
    assert "klCoef 0" in unused_roles(spec)["reference"]
