"""A spec the operator cannot run is failed before any child exists: `Failed` / `InvalidSpec`, the
message naming the field, no pod (and no Service, ConfigMap, Secret).

Two ways such a spec reaches the operator: it slipped past the API server (created before the CRD
was upgraded, or by a client that skipped strict field validation), so the operator evaluates the
whole rule set again (`rlhf_api.loader.parse_job`: the CRD's schema and CEL rules; the loader then only converts types);
or the server cannot check it at all: a custom algorithm's free-form `customParams`, which the
operator checks without importing the user's class (`algorithm_params.check_custom_params`)."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from operator_helpers import at, job, names
from test_operator_executor import FakeKube

from rlhf_operator import reconcile
from rlhf_operator.executor import Executor
from rlhf_operator.status import get_condition

CUSTOM = "my_pkg.algos:MyAlgo"
ALL = ["j-actor-0", "j-actor-1", "j-controller", "j-reference-0", "j-rollout-0", "j-rollout-1"]

# (case, spec.algorithm, text the InvalidSpec message must contain)
INVALID: list[tuple[str, dict[str, Any], str]] = [
    (
        "built-in param typo past the server",
        {"name": "grpo", "params": {"klCoeff": 0.01}},
        "spec.algorithm.params.klCoeff: unknown",
    ),
    (
        "built-in param out of bounds past the server",
        {"name": "grpo", "params": {"epsilon": -0.2}},
        "spec.algorithm.params.epsilon",
    ),
    (
        "customParams with a built-in past the server",
        {"name": "grpo", "customParams": {"myCoef": 1}},
        "spec.algorithm.customParams",
    ),
    (
        "custom key that can never be a param",
        {"name": CUSTOM, "customParams": {"my-coef": 0.5}},
        "spec.algorithm.customParams.my-coef: 'my-coef' can never be a param of an algorithm (value 0.5); "
        "valid: a name of letters, digits and '_'",
    ),
    (
        "custom param in params and customParams",
        {"name": CUSTOM, "params": {"klCoef": 0.1}, "customParams": {"klCoef": 0.2}},
        "spec.algorithm.customParams.klCoef: param 'kl_coef' is already given as spec.algorithm.params.klCoef",
    ),
    (
        "custom param in two spellings",
        {"name": CUSTOM, "customParams": {"myCoef": 1, "my_coef": 2}},
        "spec.algorithm.customParams.my_coef: param 'my_coef' is already given as "
        "spec.algorithm.customParams.myCoef",
    ),
]


@pytest.mark.parametrize("algorithm,message", [c[1:] for c in INVALID], ids=[c[0] for c in INVALID])
def test_invalid_params_fail_the_job_before_any_pod(algorithm: dict[str, Any], message: str) -> None:
    plan = reconcile.plan(job(algorithm=algorithm), [], at(0))
    assert plan.invalid is not None and message in plan.invalid, plan.invalid
    assert plan.create == [] and plan.job is None
    assert plan.status["phase"] == "Failed"
    failed = get_condition(plan.status, "Failed")
    assert failed is not None and failed["reason"] == "InvalidSpec" and message in failed["message"]
    assert [(e.type, e.reason) for e in plan.events] == [("Warning", "InvalidSpec")]


def test_a_custom_algorithms_free_form_params_are_not_second_guessed() -> None:
    """Any JSON under a valid key: the class checks the values when the trainer builds it."""
    algorithm = {
        "name": CUSTOM,
        "params": {"klCoef": 0.01},
        "customParams": {"myCoef": 0.5, "schedule": [1, 2, 3], "nested": {"a-b": None}, "_x": "s"},
    }
    plan = reconcile.plan(job(algorithm=algorithm), [], at(0))
    assert plan.invalid is None and names(plan.create) == ALL


def test_the_executor_creates_no_child_at_all_for_an_invalid_spec() -> None:
    body = job(algorithm={"name": CUSTOM, "customParams": {"my-coef": 0.5}})
    fake = FakeKube(body)
    out = Executor(fake).reconcile("ns", "j", now=at(0))  # type: ignore[arg-type]
    assert out.invalid and "spec.algorithm.customParams.my-coef" in out.invalid
    assert fake.objects == {}  # no pod, Service, ConfigMap, Secret, Role, ...
    assert fake.job is not None and fake.job["status"]["phase"] == "Failed"
    assert [(e[0], e[1]) for e in fake.events] == [("Warning", "InvalidSpec")]


def test_an_invalid_spec_found_later_creates_nothing_more() -> None:
    """A Pending job whose spec the (upgraded) operator now refuses: nothing more is created."""
    body = job(algorithm={"name": CUSTOM, "customParams": {"a b": 1}})
    body["status"] = {"phase": "Pending"}
    plan = reconcile.plan(copy.deepcopy(body), [], at(5))
    assert plan.create == [] and plan.status["phase"] == "Failed" and plan.invalid
