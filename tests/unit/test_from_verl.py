"""docs/from-verl.md: every counterpart of a seed tutorial's example works. Each YAML block passes
`rlhf validate` (a block holding part of a `spec` merged into the quickstart manifest first); each
Python block is executed and what it defines is used as the page says. The seeds' names that are
errors here (`x["reward"]`, `DPOUpdateOperator`) fail naming the project's."""

from __future__ import annotations

import copy
import dataclasses
import re
import types
import typing
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from rlhf_api.loader import load_manifest, parse_job
from rlhf_trainer.cli import main

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "from-verl.md"
QUICKSTART = ROOT / "manifests" / "examples" / "quickstart.yaml"


def blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", DOC.read_text(), flags=re.S)


def _merge(base: Any, part: Any) -> Any:
    if isinstance(base, dict) and isinstance(part, dict):
        out = dict(base)
        for key, value in part.items():
            out[key] = _merge(base.get(key), value) if key in base else value
        return out
    return copy.deepcopy(part)


def manifest(block: str) -> dict[str, Any]:
    """The block's whole job, or the quickstart with the block's part of `spec` merged in."""
    doc = yaml.safe_load(block)
    if "apiVersion" in doc:
        return doc
    return _merge(yaml.safe_load(QUICKSTART.read_text()), doc)


def python_block(defines: str, which: int = 0) -> dict[str, Any]:
    """The namespace of the `which`-th Python block that defines `defines`, executed."""
    code = [b for b in blocks("python") if re.search(rf"^(def|class) {defines}\b", b, flags=re.M)][which]
    namespace: dict[str, Any] = {}
    exec(compile(code, str(DOC), "exec"), namespace)  # noqa: S102 - the project's own doc
    return namespace


def test_the_page_has_a_counterpart_of_every_seed_example_and_the_readme_links_it() -> None:
    assert len(blocks("yaml")) >= 9 and len(blocks("python")) == 4
    assert "(docs/from-verl.md)" in (ROOT / "README.md").read_text()


@pytest.mark.parametrize("index", range(len(blocks("yaml"))))
def test_every_manifest_block_passes_rlhf_validate(index: int, tmp_path: Path, capsys: Any) -> None:
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(manifest(blocks("yaml")[index])))
    # --no-import: the blocks name modules the reader writes (`my_rewards`), not files of this repo.
    rc = main(["validate", "--no-import", str(path)])
    out = capsys.readouterr()
    assert rc == 0, blocks("yaml")[index] + out.out + out.err


def _spec(title: str) -> Any:
    (block,) = [b for b in blocks("yaml") if f"name: {title}\n" in b]
    return parse_job(manifest(block)).spec


def test_the_seed_spellings_in_the_manifests_set_the_projects_params() -> None:
    from rlhf_api.algorithm_params import BUILTIN_PARAMS

    dyn = _spec("dynamic-kl-ppo").algorithm
    p = BUILTIN_PARAMS[dyn.name].from_dict(dyn.params)
    assert (p.target_kl, p.kl_coef, p.beta_min, p.beta_max) == (0.1, 0.5, 0.01, 1.0)
    first = _spec("first-ppo-flow")
    p = BUILTIN_PARAMS["grpo"].from_dict(first.algorithm.params)
    assert (p.clip_ratio_low, p.clip_ratio_high, p.kl_coef) == (0.2, 0.2, 0.1)
    assert (first.rollout.temperature, first.rollout.top_p, first.training.learning_rate) == (0.7, 0.95, 1e-6)
    (kl_block,) = [b for b in blocks("yaml") if "klPenalty: kl" in b]
    assert (
        BUILTIN_PARAMS["grpo"].from_dict(manifest(kl_block)["spec"]["algorithm"]["params"]).kl_estimator
        == "k1"
    )


def test_the_dynamic_kl_algorithm_moves_beta_as_the_seed_does() -> None:
    cls = python_block("MyDynamicKLPPO")["MyDynamicKLPPO"]
    algo = cls(klTarget=0.1, betaInit=0.5, betaMax=1.0, betaMin=0.01)  # the seed's keywords
    algo.update_step({"actor/kl": 0.5})  # > 1.5 x target: x1.5
    assert algo.kl_coef == pytest.approx(0.75)
    algo.update_step({"actor/kl": 0.5})
    assert algo.kl_coef == pytest.approx(1.0)  # capped at betaMax
    algo.update_step({"actor/kl": 0.01})  # < 0.5 x target: halved
    assert algo.kl_coef == pytest.approx(0.5)
    # ... and it is the built-in's schedule
    from rlhf_trainer.algorithms import build_algorithm

    builtin = build_algorithm("dynamic_kl_ppo", {"targetKl": 0.1, "klCoef": 0.5})
    for kl in (0.5, 0.5, 0.01):
        builtin.update_step({"actor/kl": kl})
    assert builtin.kl_coef == pytest.approx(algo.kl_coef)


def _ctx() -> Any:
    spec = load_manifest(QUICKSTART).spec
    return types.SimpleNamespace(spec=spec, algorithm=None)


def _batch(scores: list[float]) -> Any:
    from rlhf_trainer.dataflow import StepBatch

    n = len(scores)
    return StepBatch(
        tensors={
            "response_mask": torch.ones(n, 2),
            "scores": torch.tensor(scores),
            "group_index": torch.arange(n) // 2,
        },
        prompts=[f"p{i}" for i in range(n)],
    )


def test_the_filter_stream_builds_with_the_seed_update_keywords() -> None:
    from rlhf_trainer.dataflow import FilterOperator, RewardOperator, RolloutOperator

    stream = python_block("build", 0)["build"](_ctx())  # the first `build`: the filter stream
    rollout, scorer, keep, update = stream.operators
    assert isinstance(rollout, RolloutOperator) and isinstance(scorer, RewardOperator)
    assert isinstance(keep, FilterOperator) and keep(_batch([0.2, 0.5, 0.9, 0.4])).prompts == ["p1", "p2"]
    p = update.algorithm.params
    assert (update.algorithm.name, p.clip_ratio_low, p.clip_ratio_high, p.kl_coef) == ("ppo", 0.2, 0.2, 0.1)


def test_the_conditional_stream_routes_by_scores() -> None:
    from rlhf_trainer.dataflow import ConditionalUpdateOperator

    stream = python_block("build", 1)["build"](_ctx())  # the second: PPO or online DPO
    conditional = stream.operators[-1]
    assert isinstance(conditional, ConditionalUpdateOperator)
    assert [a.name for a in conditional.algorithms()] == ["ppo", "online_dpo"]
    assert conditional.condition(_batch([0.9, 0.1, 0.85, 0.8])).tolist() == [True, False, True, False]


def test_the_seeds_batch_key_and_class_name_fail_naming_the_projects() -> None:
    with pytest.raises(KeyError, match=r"'reward' is verl's name; here it is 'scores'"):
        (lambda x: x["reward"] > 0.8)(_batch([0.9, 0.1]))
    with pytest.raises(
        KeyError, match=r"'rewardz' is not in this batch; keys: group_index, response_mask, scores"
    ):
        _batch([0.9])["rewardz"]
    with pytest.raises(ImportError, match="it is OnlineDPOUpdateOperator"):
        from rlhf_trainer.dataflow import DPOUpdateOperator  # noqa: F401


def test_the_customer_service_reward_scores_as_the_seed_describes() -> None:
    from rlhf_trainer.rewards import RewardCalculator

    cls = python_block("CustomerServiceReward")["CustomerServiceReward"]
    reward = cls()
    assert isinstance(reward, RewardCalculator)
    got = reward.compute_reward(
        ["我的订单还没发货，急！"] * 4,
        [
            "亲，您的订单ABCD12345678已发货",  # order number 0.4, short and dense 0.3, greeting 0.2
            "亲 好的",  # short, 3 of 4 characters not spaces 0.3, greeting 0.2
            "滚",  # short and dense 0.3, the insult -0.5: clamped at 0
            "x" * 100,  # 12+ letters read as an order number 0.4; too long for the 0.3
        ],
    )
    assert got == pytest.approx([0.9, 0.5, 0.0, 0.4])


def test_the_seeds_operator_arguments_fail_naming_the_manifest_fields() -> None:
    """RolloutOperator(model=..., max_new_tokens=256, ...) and the seed's others: the manifest
    holds those settings, and each field the error names exists."""
    from rlhf_api.fields import camel
    from rlhf_api.job import JobSpec
    from rlhf_trainer.dataflow import PPOUpdateOperator, RewardModelScorer, RolloutOperator
    from rlhf_trainer.dataflow.operators import SEED_SETTINGS

    ctx = _ctx()
    with pytest.raises(
        TypeError,
        match=r"max_new_tokens: spec\.rollout\.maxNewTokens; temperature: spec\.rollout\.temperature",
    ):
        RolloutOperator(ctx, model=object(), max_new_tokens=256, temperature=0.7, top_p=0.95)
    with pytest.raises(
        TypeError, match=r"rm_model: spec\.reward\.model\.path; use_vllm: spec\.rollout\.engine"
    ):
        RewardModelScorer(ctx, rm_model=object(), use_vllm=False)
    with pytest.raises(TypeError, match=r"actor: spec\.model\.path; critic: spec\.roles\.critic"):
        PPOUpdateOperator(ctx, actor=object(), critic=None, kl_coef=0.1, clip_range=0.2)
    with pytest.raises(TypeError, match="unexpected arguments: modle"):
        RolloutOperator(ctx, modle=object())
    for field in SEED_SETTINGS.values():  # spec.rollout.maxNewTokens names a field of the JobSpec
        cls: Any = JobSpec
        for part in field.split(" ")[0].split(".")[1:]:
            names = {camel(f.name): f for f in dataclasses.fields(cls)}
            assert part in names, field
            cls = typing.get_type_hints(cls)[names[part].name]
            cls = next((a for a in typing.get_args(cls) if dataclasses.is_dataclass(a)), cls)
