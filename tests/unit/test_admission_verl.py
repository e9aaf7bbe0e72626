"""verl's spellings, as the seed tutorials write them (docs/from-verl.md): each alias of
`algorithm_params.PARAM_ALIASES` / `VALUE_ALIASES` is accepted by the CRD's own rules (what the
API server evaluates) and by `rlhf validate` alike, and sets the project's params; each setting of
`MOVED_PARAMS` is refused by both, the message naming the field to use. The refusals also run
through a real API server with the rest of tests/admission_cases.py."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import yaml
from admission_cases import base

from rlhf_api import admission, algorithm_params
from rlhf_api.algorithm_params import BUILTIN_PARAMS
from rlhf_api.loader import parse_job
from rlhf_trainer.cli import main


def _job(algorithm: str, params: dict[str, Any]) -> dict[str, Any]:
    doc = base()
    doc["spec"]["algorithm"] = {"name": algorithm, "params": params}
    if BUILTIN_PARAMS[algorithm].USES_CRITIC:
        doc["spec"]["roles"].setdefault("critic", {})["replicas"] = 1
    return doc


def _validate(doc: dict[str, Any], tmp_path: Path, capsys: Any) -> tuple[int, str]:
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(doc))
    rc = main(["validate", str(path)])
    out = capsys.readouterr()
    return rc, out.out + out.err


#: (algorithm, the seed's params, the project's params they mean)
ACCEPTED = [
    ("grpo", {"clipRange": 0.3}, {"clip_ratio_low": 0.3, "clip_ratio_high": 0.3}),
    ("ppo", {"clipRange": 0.1, "klCoef": 0.01}, {"clip_ratio_low": 0.1, "clip_ratio_high": 0.1}),
    ("ppo", {"klPenalty": "kl"}, {"kl_estimator": "k1"}),
    ("grpo", {"klEstimator": "kl"}, {"kl_estimator": "k1"}),
    ("ppo", {"klPenalty": "low_var_kl"}, {"kl_estimator": "low_var_kl"}),
    (
        "dynamic_kl_ppo",
        {"klTarget": 0.1, "betaInit": 0.5, "betaMax": 1.0, "betaMin": 0.01},
        {"target_kl": 0.1, "kl_coef": 0.5, "beta_max": 1.0, "beta_min": 0.01},
    ),
    (
        "ppo",
        {"klController": "adaptive", "klTarget": 0.1, "betaInit": 0.01},
        {"target_kl": 0.1, "kl_coef": 0.01},
    ),
]


@pytest.mark.parametrize("algorithm,params,means", ACCEPTED, ids=[f"{a}-{sorted(p)}" for a, p, _ in ACCEPTED])
def test_a_verl_spelling_is_accepted_by_both_and_sets_the_param(
    algorithm: str, params: dict[str, Any], means: dict[str, Any], tmp_path: Path, capsys: Any
) -> None:
    doc = _job(algorithm, params)
    assert admission.admit(doc)[1] == []  # the API server's verdict
    rc, out = _validate(doc, tmp_path, capsys)
    assert rc == 0, out
    for key in params:  # each deprecated spelling is noted, naming the preferred one
        if key in ("clipRange", "klTarget", "betaInit", "klPenalty"):
            assert f"note: spec.algorithm.params.{key}: deprecated alias of" in out, out
    if "kl" in params.values():
        assert "'kl' is verl's name of 'k1'" in out, out
    job = parse_job(doc)
    built = BUILTIN_PARAMS[algorithm].from_dict(job.spec.algorithm.params)
    assert {k: getattr(built, k) for k in means} == means


#: The seeds' settings that are not algorithm params here: where each lives.
MOVED = {
    "lr": "spec.training.learningRate",
    "learningRate": "spec.training.learningRate",
    "vfCoef": "spec.training.criticLearningRate",
    "batchSize": "spec.training.promptsPerStep",
    "miniBatchSize": "spec.training.miniBatchSize",
}


@pytest.mark.parametrize("key,field", sorted(MOVED.items()))
def test_a_moved_setting_is_refused_by_both_naming_the_field(
    key: str, field: str, tmp_path: Path, capsys: Any
) -> None:
    doc = _job("grpo", {key: 1e-6})
    errs = admission.admit(doc)[1]
    assert any(e.startswith(f"spec.algorithm.params.{key}:") and field in e for e in errs), errs
    rc, out = _validate(doc, tmp_path, capsys)
    assert rc == 1 and f"- spec.algorithm.params.{key}:" in out and field in out, out


def test_an_alias_beside_its_param_is_refused_by_both(tmp_path: Path, capsys: Any) -> None:
    doc = _job("dynamic_kl_ppo", {"betaInit": 0.5, "klCoef": 0.5})
    errs = admission.admit(doc)[1]
    assert any(e.startswith("spec.algorithm.params.betaInit:") and "klCoef" in e for e in errs), errs
    rc, out = _validate(doc, tmp_path, capsys)
    assert rc == 1 and "- spec.algorithm.params.betaInit:" in out, out


def test_python_takes_the_seed_keywords_and_names_the_field_of_a_moved_one() -> None:
    """`PPOUpdateOperator(ctx, clip_range=0.2, kl_coef=0.1)` builds its algorithm through
    `from_dict`, so the seed's keywords are the manifest's aliases in snake_case."""
    from rlhf_trainer.algorithms import build_algorithm

    algo = build_algorithm("ppo", {"clip_range": 0.2, "kl_coef": 0.1, "kl_penalty": "kl"})
    assert (algo.params.clip_ratio_low, algo.params.clip_ratio_high, algo.params.kl_estimator) == (
        0.2,
        0.2,
        "k1",
    )
    algo = build_algorithm(
        "dynamic_kl_ppo", {"kl_target": 0.1, "beta_init": 0.5, "beta_max": 1.0, "beta_min": 0.01}
    )
    assert (algo.params.target_kl, algo.params.kl_coef) == (0.1, 0.5)
    with pytest.raises(
        ValueError,
        match=r"param 'lr' is not a parameter of PPOParams; the setting is spec\.training\.learningRate",
    ):
        build_algorithm("ppo", {"clip_range": 0.2, "lr": 1e-6})
    with pytest.raises(ValueError, match="given twice"):
        build_algorithm("ppo", {"clip_range": 0.2, "clip_ratio_high": 0.28})

    # A field of that name wins over the table: a custom algorithm may own a param called lr.
    @dataclasses.dataclass(frozen=True)
    class OwnLR(algorithm_params.AlgorithmParams):
        lr: float = algorithm_params.param(1e-3, "The custom algorithm's own step size.")

    assert OwnLR.from_dict({"lr": 0.5}).lr == 0.5


def test_the_reference_lists_every_spelling() -> None:
    from rlhf_api.algorithm_params import MOVED_PARAMS, PARAM_ALIASES
    from rlhf_api.algorithm_schema import reference_markdown

    assert set(MOVED_PARAMS) == set(MOVED)

    section = reference_markdown().split("### verl's spellings", 1)[1]
    for key in [*PARAM_ALIASES, *MOVED_PARAMS, "klEstimator: kl"]:
        assert f"| `{key}`" in section, key
