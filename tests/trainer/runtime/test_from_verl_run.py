"""docs/from-verl.md's counterpart of the seed's first PPO flow (GRPO with a reward model, the
seed's clipRange and sampling settings) runs two steps with `rlhf run`'s controller."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
import yaml

from .conftest import read_metrics
from .test_examples import _tiny_reward_model

DOC = Path(__file__).resolve().parents[3] / "docs" / "from-verl.md"


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_first_ppo_flow_of_the_page_runs_two_steps(tiny_model, ray_session, tmp_path):
    from rlhf_api.loader import parse_job
    from rlhf_trainer.controller import run

    (block,) = [
        b
        for b in re.findall(r"```yaml\n(.*?)```", DOC.read_text(), flags=re.S)
        if "name: first-ppo-flow\n" in b
    ]
    job = parse_job(yaml.safe_load(block))
    rm = tmp_path / "reward-model"
    _tiny_reward_model(rm, tiny_model)
    spec = job.spec
    spec = dataclasses.replace(
        spec,
        reward=dataclasses.replace(spec.reward, model=dataclasses.replace(spec.reward.model, path=str(rm))),
        output=dataclasses.replace(spec.output, progress=False, report=False),
    )
    summary = run(
        dataclasses.replace(job, spec=spec), manifest_dir=tmp_path, steps=2, run_dir=tmp_path / "run"
    )
    rows = read_metrics(tmp_path / "run")
    assert summary.steps == 2 and [r["step"] for r in rows] == [0, 1]
    assert all("reward/mean" in r and "actor/loss" in r for r in rows), rows  # what the seed prints
    assert rows[-1]["actor/policy_version"] >= 1
