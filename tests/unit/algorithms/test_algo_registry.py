"""Registries: lookup, unknown names, and user components registered by import path."""

from __future__ import annotations

import textwrap

import pytest
import torch

from rlhf_trainer.algorithms import (
    ADVANTAGE_ESTIMATORS,
    ALGORITHMS,
    KL_CONTROLLERS,
    KL_ESTIMATORS,
    LOSS_AGGREGATIONS,
    POLICY_LOSSES,
    PREFERENCE_LOSSES,
    Registry,
    UnknownNameError,
    build_algorithm,
)

ALL = {
    "advantage estimator": (
        ADVANTAGE_ESTIMATORS,
        ["gae", "grpo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "remax", "rloo"],
    ),
    "policy loss": (POLICY_LOSSES, ["gspo", "ppo"]),
    "KL estimator": (KL_ESTIMATORS, ["abs", "k1", "k2", "k3", "low_var_kl", "mse"]),
    "KL controller": (KL_CONTROLLERS, ["adaptive", "fixed"]),
    "loss aggregation mode": (
        LOSS_AGGREGATIONS,
        ["seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm", "token-mean", "token-sum"],
    ),
    "preference loss": (PREFERENCE_LOSSES, ["dpo", "ipo"]),
    "algorithm": (
        ALGORITHMS,
        [
            "dr_grpo",
            "dynamic_kl_ppo",
            "grpo",
            "gspo",
            "online_dpo",
            "ppo",
            "reinforce_plus_plus",
            "remax",
            "rloo",
        ],
    ),
}


@pytest.mark.parametrize("kind", list(ALL))
def test_builtin_names(kind):
    registry, names = ALL[kind]
    assert registry.names() == names
    assert registry.kind == kind


@pytest.mark.parametrize("kind", list(ALL))
def test_unknown_name_lists_every_valid_name(kind):
    registry, names = ALL[kind]
    with pytest.raises(UnknownNameError) as info:
        registry.get("nope")
    message = str(info.value)
    assert f"unknown {kind} 'nope'" in message
    for name in names:
        assert name in message
    assert isinstance(info.value, ValueError) and isinstance(info.value, KeyError)
    assert info.value.valid == names


def test_build_algorithm_unknown_name():
    with pytest.raises(
        ValueError,
        match="unknown algorithm 'ppo2'; valid: dr_grpo, dynamic_kl_ppo, grpo, gspo, online_dpo, ppo, "
        "reinforce_plus_plus, remax, rloo",
    ):
        build_algorithm("ppo2", {})


def test_register_and_duplicates():
    registry: Registry[object] = Registry("widget")

    @registry.register("a")
    def a() -> None: ...

    assert registry.get("a") is a and "a" in registry and len(registry) == 1
    registry.add("a", a)  # re-adding the same object is harmless
    with pytest.raises(ValueError, match="widget 'a' is already registered"):
        registry.add("a", object())
    with pytest.raises(ValueError, match="without ':'"):
        registry.add("x:y", object())


@pytest.fixture
def user_module(tmp_path, monkeypatch, request):
    """A tiny user package on sys.path, as `pip install my-pkg` would provide."""
    name = f"user_algos_{request.node.name.replace('[', '_').replace(']', '_').replace('-', '_')}"
    (tmp_path / f"{name}.py").write_text(
        textwrap.dedent(
            """
            import dataclasses
            from typing import ClassVar

            import torch

            from rlhf_trainer.algorithms import Algorithm, AlgorithmParams, param


            def constant_advantage(response_mask, *, gamma=1.0, offset=0.5):
                advantages = response_mask * (offset + gamma)
                return advantages, advantages


            def mean_log_prob_loss(log_probs, response_mask, *, loss_agg_mode="token-mean"):
                loss = -(log_probs * response_mask).sum() / response_mask.sum().clamp(min=1)
                return loss, {"actor/custom": float(loss.detach())}


            @dataclasses.dataclass(frozen=True)
            class MyParams(AlgorithmParams):
                scale: float = param(2.0, "Multiplies the loss.")


            class MyAlgo(Algorithm):
                name: ClassVar[str] = "my_algo"
                Params: ClassVar[type] = MyParams

                def compute_advantages(self, batch):
                    return {**batch, "advantages": batch["response_mask"] * 0}

                def compute_loss(self, batch):
                    loss = -self.params.scale * (batch["log_probs"] * batch["response_mask"]).sum()
                    return {"loss": loss, "actor/scale": self.params.scale}


            class Nested:
                class Inner:
                    value = 42


            NOT_AN_ALGORITHM = 3
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    return name


def test_import_path_lookup(user_module):
    fn = ADVANTAGE_ESTIMATORS.get(f"{user_module}:constant_advantage")
    mask = torch.ones(2, 3)
    assert fn(mask)[0].tolist() == [[1.5] * 3] * 2
    assert ALGORITHMS.get(f"{user_module}:Nested.Inner").value == 42
    assert f"{user_module}:constant_advantage" not in ADVANTAGE_ESTIMATORS  # looked up, not registered


def test_import_path_errors(user_module):
    with pytest.raises(
        UnknownNameError, match=r"cannot import module 'no_such_module_xyz'.*valid: gae, grpo"
    ):
        ADVANTAGE_ESTIMATORS.get("no_such_module_xyz:fn")
    with pytest.raises(UnknownNameError, match=f"module '{user_module}' has no attribute 'missing'"):
        ADVANTAGE_ESTIMATORS.get(f"{user_module}:missing")
    with pytest.raises(ValueError, match="is 3, not a subclass of rlhf_trainer.algorithms.Algorithm"):
        build_algorithm(f"{user_module}:NOT_AN_ALGORITHM", {})


def test_custom_algorithm_by_import_path(user_module):
    algo = build_algorithm(f"{user_module}:MyAlgo", {"scale": 3})
    assert algo.params.scale == 3.0
    log_probs = torch.ones(2, 2, requires_grad=True)
    out = algo.compute_loss({"log_probs": log_probs, "response_mask": torch.ones(2, 2)})
    assert out["loss"].item() == -12.0 and out["actor/scale"] == 3.0
    assert algo.state_dict() == {"algorithm": "my_algo"}
    with pytest.raises(ValueError, match="unknown param 'scal' for MyParams; valid: scale"):
        build_algorithm(f"{user_module}:MyAlgo", {"scal": 3})


def test_builtin_algorithm_with_custom_estimator_and_loss(user_module):
    algo = build_algorithm(
        "grpo",
        {
            "advantageEstimator": f"{user_module}:constant_advantage",
            "policyLoss": f"{user_module}:mean_log_prob_loss",
            "klCoef": 0.0,
        },
    )
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    batch = algo.compute_advantages({"response_mask": mask, "scores": torch.tensor([1.0])})
    assert batch["advantages"].tolist() == [[1.5, 1.5, 0.0]]  # offset default, gamma not a GRPO param
    log_probs = torch.tensor([[-1.0, -3.0, -100.0]], requires_grad=True)
    out = algo.compute_loss({**batch, "log_probs": log_probs})
    assert out["loss"].item() == pytest.approx(2.0) and out["actor/custom"] == pytest.approx(2.0)
