"""`spec.rollout.multiTurn`: parsed, defaulted and refused by field; `rlhf validate` agrees; the
example's environment builds."""

from __future__ import annotations

import copy
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

EXAMPLE = Path(__file__).resolve().parents[2] / "manifests" / "examples" / "multiturn-calculator.yaml"


def _doc(**multi_turn: object) -> dict:
    doc = yaml.safe_load(EXAMPLE.read_text())
    doc = copy.deepcopy(doc)
    doc["spec"]["rollout"]["multiTurn"] = {**doc["spec"]["rollout"]["multiTurn"], **multi_turn}
    return doc


def test_the_example_parses_and_its_engines_hold_the_whole_episode():
    from rlhf_api.job import max_model_length
    from rlhf_api.loader import parse_job

    spec = parse_job(_doc()).spec
    mt = spec.rollout.multi_turn
    assert (mt.environment, mt.max_turns, mt.max_total_tokens) == (
        "rlhf_trainer.environments.calculator:CalculatorEnv",
        2,
        48,
    )
    # the longest context of an episode and a whole turn (maxNewTokens 20) from it
    assert max_model_length(spec) == spec.data.max_prompt_length + 48 + 20
    single = parse_job({**_doc(), "spec": {**_doc()["spec"], "rollout": {"maxNewTokens": 20}}}).spec
    assert single.rollout.multi_turn is None
    assert max_model_length(single) == single.data.max_prompt_length + 20


def test_the_defaults():
    from rlhf_api.loader import parse_job

    doc = _doc()
    doc["spec"]["rollout"]["multiTurn"] = {"environment": "pkg.mod:Env"}
    mt = parse_job(doc).spec.rollout.multi_turn
    assert (mt.kwargs, mt.max_turns, mt.max_total_tokens) == ({}, 4, 256)


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        (
            "environment",
            "calculator",
            "spec.rollout.multiTurn.environment: 'calculator' is not valid; valid: an import path",
        ),
        ("maxTurns", 0, "spec.rollout.multiTurn.maxTurns: 0 is below the minimum 1"),
        ("maxTotalTokens", 0, "spec.rollout.multiTurn.maxTotalTokens: 0 is below the minimum 1"),
        ("maxturns", 3, "spec.rollout.multiTurn.maxturns"),
    ],
)
def test_a_bad_field_is_refused_by_name(field, value, message):
    from rlhf_api.fields import SpecError
    from rlhf_api.loader import parse_job

    with pytest.raises(SpecError) as err:
        parse_job(_doc(**{field: value}))
    assert message in str(err.value)


def test_rlhf_validate_refuses_a_bad_multi_turn_block(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(_doc(maxTurns=0, environment="no path")))
    done = subprocess.run(
        [sys.executable, "-m", "rlhf_trainer.cli", "validate", str(bad)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode != 0
    out = done.stdout + done.stderr
    assert "spec.rollout.multiTurn.maxTurns" in out and "spec.rollout.multiTurn.environment" in out


def test_the_examples_environment_builds():
    from rlhf_api.loader import parse_job
    from rlhf_trainer.environments import build_environment

    mt = parse_job(_doc()).spec.rollout.multi_turn
    env = build_environment(mt.environment, mt.kwargs)
    assert callable(env.step)


def test_rlhf_run_refuses_an_environment_that_does_not_import_before_starting_workers(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(_doc(environment="no_such_pkg.tools:Env")))
    done = subprocess.run(
        [sys.executable, "-m", "rlhf_trainer.cli", "run", str(bad)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert done.returncode != 0
    assert "spec.rollout.multiTurn.environment" in done.stderr and "no_such_pkg" in done.stderr
    assert "Ray" not in done.stderr  # refused before a worker (or Ray) started


def test_the_planner_sizes_a_micro_batch_for_the_whole_episode():
    from rlhf_api.loader import parse_job
    from rlhf_trainer import planner

    spec = parse_job(_doc()).spec
    per_token = spec.training.micro_batch_size
    assert planner._tokens_per_micro_batch(spec) == per_token * (spec.data.max_prompt_length + 48)
