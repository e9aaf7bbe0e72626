"""What the operator fills in and leaves out: the trainer image of a job without `spec.image` (the
operator's default, the chart's `trainerImage`), and no pods for the roles an algorithm never uses
(`spec.unused_roles`: a critic-free algorithm's critic, klCoef 0's reference). Whole plans, no
cluster; tests/cluster/test_operator_install.py runs the same on kwok."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from operator_helpers import BASE_SPEC, at, job

from rlhf_operator import images, pass_state, reconcile
from rlhf_operator.status import get_condition

NO_IMAGE = {k: v for k, v in BASE_SPEC.items() if k != "image"}
#: Every role with one replica (the spec's defaults), disaggregated so rollout pods exist too.
ALL_ROLES = {
    **NO_IMAGE,
    "image": "trainer:test",
    "roles": {
        "placement": "disaggregated",
        **{r: {"replicas": 1} for r in ("actor", "critic", "reference", "reward", "rollout")},
    },
}


def _roles(plan: pass_state.Plan) -> list[str]:
    return sorted({p["metadata"]["labels"]["rlhf.dev/role"] for p in plan.create if p["kind"] == "Pod"})


def _images(plan: pass_state.Plan) -> set[str]:
    return {c["image"] for p in plan.create if p["kind"] == "Pod" for c in p["spec"]["containers"]}


@pytest.mark.parametrize(
    ("spec_image", "default", "want"),
    [
        ("registry.example/trainer:1", "", "registry.example/trainer:1"),
        ("registry.example/trainer:1", "registry.example/default:2", "registry.example/trainer:1"),
        ("", "registry.example/default:2", "registry.example/default:2"),
    ],
)
def test_pods_run_the_jobs_image_else_the_operators_default(
    monkeypatch: pytest.MonkeyPatch, spec_image: str, default: str, want: str
) -> None:
    monkeypatch.setenv(images.ENV_TRAINER_IMAGE, default)
    spec = {**NO_IMAGE, **({"image": spec_image} if spec_image else {})}
    plan = reconcile.plan(job(spec=spec), [], at(0))
    assert plan.invalid is None
    assert plan.create and _images(plan) == {want}


def test_no_image_and_no_default_is_an_invalid_spec_naming_the_field_and_the_chart_value(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(images.ENV_TRAINER_IMAGE, raising=False)
    plan = reconcile.plan(job(spec=NO_IMAGE), [], at(0))
    assert plan.create == [] and plan.job is None and plan.status["phase"] == "Failed"
    failed = get_condition(plan.status, "Failed")
    assert failed is not None and failed["reason"] == "InvalidSpec"
    for said in ("spec.image", "trainerImage.repository", images.ENV_TRAINER_IMAGE):
        assert said in failed["message"], failed["message"]


def _algo(name: str, **params: Any) -> dict[str, Any]:
    return {"name": name, "params": params} if params else {"name": name}


@pytest.mark.parametrize(
    ("algorithm", "extra", "want"),
    [
        # GRPO with klCoef 0 and every role's default replicas: no critic, no reference.
        (_algo("grpo", klCoef=0), {}, ["actor", "controller", "reward", "rollout"]),
        (_algo("grpo"), {}, ["actor", "controller", "reference", "reward", "rollout"]),
        (_algo("rloo", klCoef=0.0), {}, ["actor", "controller", "reward", "rollout"]),
        (_algo("ppo"), {}, ["actor", "controller", "critic", "reference", "reward", "rollout"]),
        (_algo("ppo", klCoef=0), {}, ["actor", "controller", "critic", "reward", "rollout"]),
        (
            _algo("online_dpo"),
            {"rollout": {"samplesPerPrompt": 2}},
            ["actor", "controller", "reference", "reward", "rollout"],
        ),
        # LoRA: the actor's base model is the reference.
        (
            _algo("ppo"),
            {"model": {"path": "/m", "lora": {}}},
            ["actor", "controller", "critic", "reward", "rollout"],
        ),
        # A custom algorithm is never imported by the operator: every role is kept.
        (
            _algo("my_pkg.algos:Mine", klCoef=0),
            {},
            ["actor", "controller", "critic", "reference", "reward", "rollout"],
        ),
    ],
)
def test_a_role_the_algorithm_never_uses_gets_no_pod(
    algorithm: dict[str, Any], extra: dict[str, Any], want: list[str]
) -> None:
    spec = {**copy.deepcopy(ALL_ROLES), "algorithm": algorithm, **extra}
    plan = reconcile.plan(job(spec=spec), [], at(0))
    assert plan.invalid is None, plan.invalid
    assert _roles(plan) == want
