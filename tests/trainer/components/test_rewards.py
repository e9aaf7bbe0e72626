"""Rewards: function and class rewards by import path, weights, the reward-model scorer, and the
error policy (a reward that raises or returns NaN is named with its sample, never a silent zero)."""

from __future__ import annotations

import math
import sys
import types
from pathlib import Path
from typing import Any

import pytest

from rlhf_api.sections import RewardFunctionSpec, RewardModelSpec, RewardSpec
from rlhf_trainer.rewards import (
    CombinedReward,
    FunctionReward,
    RewardCalculator,
    RewardFailure,
    RewardModelScorer,
)
from rlhf_trainer.rewards.builtin import arithmetic_exact, arithmetic_partial

PROMPTS = ["1+1=", "2+2=", "3+3=", "4+4="]
RESPONSES = ["2", "5", "6.", "boom"]
ANSWERS = ["2", "4", "6", "8"]


class LengthBonus:
    """A RewardCalculator class with constructor kwargs."""

    def __init__(self, scale: float = 1.0):
        self.scale = scale

    def compute_reward(self, prompts: list[str], responses: list[str], **kw: Any) -> list[float]:
        return [self.scale * len(r) for r in responses]


def explode_on_boom(prompts: list[str], responses: list[str], **kw: Any) -> list[float]:
    if any(r == "boom" for r in responses):
        raise ValueError("cannot score 'boom'")
    return [1.0] * len(responses)


def nan_on_five(prompts: list[str], responses: list[str], **kw: Any) -> list[float]:
    return [math.nan if r == "5" else 0.5 for r in responses]


def inf_and_text(prompts: list[str], responses: list[str], **kw: Any) -> list[Any]:
    return [math.inf, "high", 1.0, 2.0]


def too_few(prompts: list[str], responses: list[str], **kw: Any) -> list[float]:
    return [1.0] if len(responses) > 1 else [3.0]


def only_answer(prompts: list[str], responses: list[str], answer: list[str]) -> list[float]:
    return [float(r == a) for r, a in zip(responses, answer)]


@pytest.fixture
def reward_module(monkeypatch: pytest.MonkeyPatch) -> str:
    """These test rewards importable as `rlhf_test_rewards:<name>`."""
    mod = types.ModuleType("rlhf_test_rewards")
    for obj in (LengthBonus, explode_on_boom, nan_on_five, inf_and_text, too_few, only_answer):
        setattr(mod, obj.__name__, obj)
    monkeypatch.setitem(sys.modules, "rlhf_test_rewards", mod)
    return "rlhf_test_rewards"


def _spec(paths: list[str], on_error: str = "skip", **kw: Any) -> RewardSpec:
    return RewardSpec(functions=[RewardFunctionSpec(path=p) for p in paths], on_error=on_error, **kw)  # type: ignore[arg-type]


def test_builtin_arithmetic_rewards() -> None:
    assert arithmetic_exact(PROMPTS, RESPONSES, answer=ANSWERS) == [1.0, 0.0, 0.0, 0.0]
    partial = arithmetic_partial(PROMPTS, RESPONSES, answer=ANSWERS)
    assert partial[0] == 1.0 and partial[1] == pytest.approx(0.1 + 0.4 / 2) and partial[2:] == [0.0, 0.0]
    with pytest.raises(ValueError, match="answer"):
        arithmetic_exact(PROMPTS, RESPONSES)


def test_function_and_class_rewards_by_import_path(reward_module: str) -> None:
    fn = FunctionReward("rlhf_trainer.rewards.builtin:arithmetic_exact")
    assert fn.name == "arithmetic_exact"
    assert fn.compute_reward(PROMPTS, RESPONSES, answer=ANSWERS, other=[0] * 4) == [1.0, 0.0, 0.0, 0.0]
    cls = FunctionReward(f"{reward_module}:LengthBonus", {"scale": 2.0})
    assert isinstance(cls, RewardCalculator)
    assert cls.compute_reward(PROMPTS, RESPONSES) == [2.0, 2.0, 4.0, 8.0]
    # a function without **kwargs only receives the columns it names
    strict = FunctionReward(f"{reward_module}:only_answer")
    assert strict.compute_reward(PROMPTS, RESPONSES, answer=ANSWERS, unrelated=[1] * 4) == [
        1.0,
        0.0,
        0.0,
        0.0,
    ]
    with pytest.raises(ValueError, match="cannot import module 'no_such_module'"):
        FunctionReward("no_such_module:f")
    with pytest.raises(ValueError, match="has no attribute 'missing'"):
        FunctionReward(f"{reward_module}:missing")


def test_weighted_sum_and_per_reward_scores(reward_module: str) -> None:
    spec = RewardSpec(
        functions=[
            RewardFunctionSpec(path="rlhf_trainer.rewards.builtin:arithmetic_exact", weight=2.0),
            RewardFunctionSpec(path=f"{reward_module}:LengthBonus", weight=0.5, kwargs={"scale": 1.0}),
        ]
    )
    result = CombinedReward.from_spec(spec).compute(PROMPTS, RESPONSES, {"answer": ANSWERS})
    assert result.scores == [2.5, 0.5, 1.0, 2.0]
    assert result.valid == [True] * 4 and result.errors == []
    assert result.per_reward == {
        "arithmetic_exact": [1.0, 0.0, 0.0, 0.0],
        "LengthBonus": [1.0, 1.0, 2.0, 4.0],
    }
    # columns may also come one dict per sample (PromptItem.columns)
    rows = CombinedReward.from_spec(spec).compute(PROMPTS, RESPONSES, [{"answer": a} for a in ANSWERS])
    assert rows.scores == result.scores


def test_a_raising_reward_is_retried_per_sample_and_skips_only_the_offender(reward_module: str) -> None:
    combined = CombinedReward.from_spec(_spec([f"{reward_module}:explode_on_boom"], on_error="skip"))
    result = combined.compute(PROMPTS, RESPONSES)
    assert result.valid == [True, True, True, False]
    assert result.scores[:3] == [1.0, 1.0, 1.0] and math.isnan(result.scores[3])
    (err,) = result.errors
    assert (err.index, err.prompt, err.response, err.reward_name) == (3, "4+4=", "boom", "explode_on_boom")
    assert "ValueError: cannot score 'boom'" in err.message
    assert result.mean() == 1.0 and result.num_valid == 3


def test_nan_inf_and_non_numbers_are_errors(reward_module: str) -> None:
    result = CombinedReward.from_spec(_spec([f"{reward_module}:nan_on_five"])).compute(PROMPTS, RESPONSES)
    assert result.valid == [True, False, True, True]
    assert [e.index for e in result.errors] == [1] and "nan" in result.errors[0].message
    mixed = CombinedReward.from_spec(
        _spec([f"{reward_module}:inf_and_text"], on_error="penalty", error_penalty=-3.0)
    )
    out = mixed.compute(PROMPTS, RESPONSES)
    assert out.scores == [-3.0, -3.0, 1.0, 2.0] and out.valid == [True] * 4
    assert [e.index for e in out.errors] == [0, 1]
    assert "inf" in out.errors[0].message and "non-number 'high'" in out.errors[1].message


def test_wrong_length_is_retried_per_sample(reward_module: str) -> None:
    result = CombinedReward.from_spec(_spec([f"{reward_module}:too_few"])).compute(PROMPTS, RESPONSES)
    assert result.scores == [3.0] * 4 and result.errors == []


def test_policy_penalty(reward_module: str) -> None:
    spec = _spec([f"{reward_module}:explode_on_boom"], on_error="penalty", error_penalty=-1.5)
    result = CombinedReward.from_spec(spec).compute(PROMPTS, RESPONSES)
    assert result.scores == [1.0, 1.0, 1.0, -1.5] and result.valid == [True] * 4 and len(result.errors) == 1


def test_policy_fail_names_the_sample(reward_module: str) -> None:
    combined = CombinedReward.from_spec(_spec([f"{reward_module}:explode_on_boom"], on_error="fail"))
    with pytest.raises(
        RewardFailure, match=r"'explode_on_boom' failed on sample 3 \(prompt '4\+4=', response 'boom'\)"
    ) as exc:
        combined.compute(PROMPTS, RESPONSES)
    assert [e.index for e in exc.value.errors] == [3]


def test_a_reward_that_fails_on_every_sample_is_never_a_silent_zero(reward_module: str) -> None:
    result = CombinedReward.from_spec(_spec([f"{reward_module}:explode_on_boom"])).compute(["p"], ["boom"])
    assert result.valid == [False] and math.isnan(result.scores[0]) and math.isnan(result.mean())


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="at least one"):
        CombinedReward([])
    with pytest.raises(ValueError, match="valid: skip, penalty, fail"):
        CombinedReward([("a", 1.0, FunctionReward(arithmetic_exact))], on_error="ignore")
    combined = CombinedReward([("a", 1.0, FunctionReward(arithmetic_exact))])
    with pytest.raises(ValueError, match="2 prompts for 1 responses"):
        combined.compute(["a", "b"], ["c"])
    with pytest.raises(ValueError, match="column 'answer' has 1 values for 2 responses"):
        combined.compute(["a", "b"], ["c", "d"], {"answer": ["1"]})


@pytest.fixture(scope="module")
def tiny_rm_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForSequenceClassification

    from rlhf_trainer.tiny_model import build_char_tokenizer

    path = tmp_path_factory.mktemp("tiny-rm")
    tok = build_char_tokenizer()
    config = LlamaConfig(  # type: ignore[call-arg]
        vocab_size=len(tok),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        num_labels=1,
        pad_token_id=tok.pad_token_id,
    )
    torch.manual_seed(0)
    LlamaForSequenceClassification(config).save_pretrained(path)
    tok.save_pretrained(path)
    return path


def test_reward_model_scorer_on_a_tiny_saved_model(tiny_rm_dir: Path) -> None:
    responses = ["2", "a longer response", "x", "4"]
    one = RewardModelScorer(str(tiny_rm_dir), batch_size=1).compute_reward(PROMPTS, responses)
    batched = RewardModelScorer(str(tiny_rm_dir), batch_size=3).compute_reward(PROMPTS, responses)
    assert len(one) == 4 and all(math.isfinite(s) for s in one)
    assert len(set(one)) > 1  # scores depend on the text
    assert batched == pytest.approx(one, abs=1e-5)  # padding inside a batch does not change a score
    spec = RewardSpec(
        functions=[RewardFunctionSpec(path="rlhf_trainer.rewards.builtin:arithmetic_exact")],
        model=RewardModelSpec(path=str(tiny_rm_dir), weight=0.5, batch_size=2),
    )
    result = CombinedReward.from_spec(spec).compute(PROMPTS, responses, {"answer": ANSWERS})
    assert result.per_reward["reward_model"] == pytest.approx(one, abs=1e-5)
    assert result.scores[0] == pytest.approx(1.0 + 0.5 * one[0], abs=1e-5)
    with pytest.raises(ValueError, match="cannot be loaded"):
        RewardModelScorer(str(tiny_rm_dir / "missing"))


RM_TEMPLATE = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"


@pytest.fixture(scope="module")
def chat_rm_dir(tiny_rm_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny reward model with a tokenizer whose chat template marks each turn's role."""
    import shutil

    from transformers import AutoTokenizer

    path = tmp_path_factory.mktemp("chat-rm")
    shutil.copytree(tiny_rm_dir, path, dirs_exist_ok=True)
    tok = AutoTokenizer.from_pretrained(tiny_rm_dir)
    tok.chat_template = RM_TEMPLATE
    tok.save_pretrained(path)
    return path


def _logit(scorer: RewardModelScorer, text: str, special: bool) -> float:
    import torch

    enc = scorer.tokenizer([text], return_tensors="pt", add_special_tokens=special)
    with torch.no_grad():
        return float(scorer.model(**enc).logits[0, 0])


def test_reward_model_scores_through_its_chat_template(chat_rm_dir: Path) -> None:
    """The old scorer read `prompt + response`; a chat reward model reads the conversation."""
    scorer = RewardModelScorer(str(chat_rm_dir), batch_size=2)
    texts, special = scorer.texts(PROMPTS[:2], ["2", "5"])
    assert texts == ["<user>1+1=<assistant>2", "<user>2+2=<assistant>5"] and special is False
    scores = scorer.compute_reward(PROMPTS[:2], ["2", "5"])
    assert scores == pytest.approx([_logit(scorer, t, False) for t in texts], abs=1e-5)
    assert scores[0] != pytest.approx(
        _logit(scorer, "1+1=2", True), abs=1e-4
    )  # the raw string scores differently
    # the data's chat messages (system turn included) instead of the policy-rendered prompt
    messages = [[{"role": "system", "content": "S"}, {"role": "user", "content": "1+1="}], None]
    assert scorer.texts(["<policy-rendered>", "2+2="], ["2", "5"], messages)[0] == [
        "<system>S<user>1+1=<assistant>2",
        "<user>2+2=<assistant>5",
    ]
    spec = RewardSpec(model=RewardModelSpec(path=str(chat_rm_dir), batch_size=2))
    result = CombinedReward.from_spec(spec).compute(
        ["<policy-rendered>", "2+2="], ["2", "5"], messages=messages
    )
    assert result.per_reward["reward_model"] == pytest.approx(
        [_logit(scorer, "<system>S<user>1+1=<assistant>2", False), scores[1]], abs=1e-5
    )


def test_reward_model_without_a_chat_template_scores_the_plain_text(tiny_rm_dir: Path) -> None:
    scorer = RewardModelScorer(str(tiny_rm_dir))
    scorer.tokenizer.chat_template = None
    assert scorer.texts(PROMPTS[:1], ["2"]) == (["1+1=2"], True)
    assert scorer.compute_reward(PROMPTS[:1], ["2"]) == pytest.approx(
        [_logit(scorer, "1+1=2", True)], abs=1e-5
    )


def test_prompt_messages_reach_only_rewards_that_name_them(reward_module: str) -> None:
    seen: dict[str, Any] = {}

    def wants(prompts: list[str], responses: list[str], prompt_messages: list[Any]) -> list[float]:
        seen["wants"] = prompt_messages
        return [0.0] * len(responses)

    def anything(prompts: list[str], responses: list[str], **kw: Any) -> list[float]:
        seen["anything"] = sorted(kw)
        return [0.0] * len(responses)

    combined = CombinedReward(
        [("wants", 1.0, FunctionReward(wants)), ("anything", 1.0, FunctionReward(anything))]
    )
    messages = [[{"role": "user", "content": "q"}]]
    combined.compute(["q"], ["a"], {"answer": ["1"]}, messages=messages)
    assert seen == {"wants": messages, "anything": ["answer"]}


# -- reward model maxLength and several weighted reward models ---------------------------------


def _second_rm(tiny_rm_dir: Path, path: Path) -> Path:
    """Another tiny reward model: the same tokenizer, other weights (so other scores)."""
    import torch
    from transformers import AutoTokenizer, LlamaForSequenceClassification

    model = LlamaForSequenceClassification.from_pretrained(tiny_rm_dir)
    torch.manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.2)
    model.save_pretrained(path)
    AutoTokenizer.from_pretrained(tiny_rm_dir).save_pretrained(path)
    return path


def test_max_length_drops_prompt_tokens_from_the_left(tiny_rm_dir: Path) -> None:
    """The character tokenizer: <s> = 1, '1' = 22, '+' = 16, '=' = 34, '2' = 23 (no chat template)."""
    scorer = RewardModelScorer(str(tiny_rm_dir), max_length=4)
    scorer.tokenizer.chat_template = None
    full = RewardModelScorer(str(tiny_rm_dir), max_length=100)
    full.tokenizer.chat_template = None
    assert full.input_ids(["1+1="], ["2"]) == [[1, 22, 16, 22, 34, 23]]  # <s> 1 + 1 = 2
    # 6 tokens into 4: the BOS stays, the prompt's first two characters go, the response stays whole
    assert scorer.input_ids(["1+1="], ["2"]) == [[1, 22, 34, 23]]  # <s> 1 = 2
    assert scorer.input_ids(["1+1="], ["22"]) == [[1, 34, 23, 23]]  # <s> = 2 2
    assert scorer.input_ids(["1="], ["2"]) == [[1, 22, 34, 23]]  # short enough: untouched
    # what the model scores is the cut input
    assert scorer.compute_reward(["1+1="], ["2"]) == pytest.approx([_logit(scorer, "1=2", True)], abs=1e-5)
    # unset: the model's own max positions
    assert RewardModelScorer(str(tiny_rm_dir)).max_length == full.model.config.max_position_embeddings
    # from the spec
    spec = RewardSpec(model=RewardModelSpec(path=str(tiny_rm_dir), max_length=4))
    assert CombinedReward.from_spec(spec).rewards[0].calc.max_length == 4


def test_several_reward_models_add_up_with_their_weights(tiny_rm_dir: Path, tmp_path: Path) -> None:
    other = _second_rm(tiny_rm_dir, tmp_path / "rm-b")
    responses = ["2", "a longer response", "x", "4"]
    a = RewardModelScorer(str(tiny_rm_dir)).compute_reward(PROMPTS, responses)
    b = RewardModelScorer(str(other)).compute_reward(PROMPTS, responses)
    assert a != pytest.approx(b, abs=1e-4)  # two different models
    spec = RewardSpec(
        models=[
            RewardModelSpec(path=str(tiny_rm_dir), weight=0.3, batch_size=3),
            RewardModelSpec(path=str(other), weight=0.7, batch_size=2),
        ]
    )
    combined = CombinedReward.from_spec(spec)
    assert combined.names == ["reward_model_0", "reward_model_1"]
    result = combined.compute(PROMPTS, responses)
    assert result.per_reward["reward_model_0"] == pytest.approx(a, abs=1e-5)
    assert result.per_reward["reward_model_1"] == pytest.approx(b, abs=1e-5)
    assert result.scores == pytest.approx([0.3 * x + 0.7 * y for x, y in zip(a, b)], abs=1e-5)
