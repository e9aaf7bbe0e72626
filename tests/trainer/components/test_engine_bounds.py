"""The two spec fields the planner plans with, wired where the models are loaded:
`rollout.maxModelLength` bounds the hf engine as vLLM's `max_model_len` bounds vLLM (and
defaults to maxPromptLength + maxNewTokens), `reward.model.dtype` is the reward model's dtype
(default `model.dtype`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from rlhf_api.job import max_model_length, reward_model_dtype
from rlhf_api.loader import parse_job
from rlhf_trainer.rewards import CombinedReward
from rlhf_trainer.rollout import build_engine
from rlhf_trainer.rollout.hf import HFRolloutEngine

BASE: dict[str, Any] = {
    "apiVersion": "rlhf.dev/v1alpha1",
    "kind": "RLTrainingJob",
    "metadata": {"name": "bounds"},
    "spec": {
        "model": {"path": "m", "dtype": "bfloat16"},
        "data": {"path": "d.jsonl", "maxPromptLength": 100},
        "reward": {"model": {"path": "rm"}},
        "rollout": {"maxNewTokens": 28},
    },
}


def _spec(**rollout: Any) -> Any:
    doc = {**BASE, "spec": {**BASE["spec"], "rollout": {**BASE["spec"]["rollout"], **rollout}}}
    return parse_job(doc).spec


def test_max_model_length_defaults_to_the_longest_prompt_and_response() -> None:
    assert max_model_length(_spec()) == 128
    assert max_model_length(_spec(maxModelLength=4096)) == 4096


def test_the_reward_models_dtype_follows_the_policys_unless_given() -> None:
    spec = _spec()
    assert reward_model_dtype(spec, spec.reward.model) == "bfloat16"
    spec.reward.model.dtype = "float32"
    assert reward_model_dtype(spec, spec.reward.model) == "float32"


def test_the_hf_engine_stops_at_max_model_len(tiny_lm: tuple[Any, Any]) -> None:
    model, tok = tiny_lm
    prompt = tok("12+34=").input_ids
    bound = len(prompt) + 3
    engine = HFRolloutEngine(
        model, tok, max_new_tokens=20, temperature=1.0, seed=0, eos_token_ids=[], max_model_len=bound
    )
    batch = engine.generate([prompt], n=2)
    assert batch.response_ids.shape[1] == 3  # no EOS: it runs to the bound, not to max_new_tokens
    unbounded = HFRolloutEngine(model, tok, max_new_tokens=20, temperature=1.0, seed=0, eos_token_ids=[])
    assert unbounded.generate([prompt], n=2).response_ids.shape[1] == 20
    with pytest.raises(ValueError, match=f"maxModelLength = {bound}"):
        engine.generate([prompt + prompt], n=1)


def test_build_engine_passes_max_model_len(tiny_lm_dir: Path) -> None:
    spec = _spec(engine="hf")
    engine = build_engine(spec.rollout, str(tiny_lm_dir), max_model_len=max_model_length(spec))
    assert engine.max_model_len == 128


def test_the_default_length_never_passes_the_models_context(tiny_lm_dir: Path) -> None:
    """Unset, the bound is the longest prompt + response capped at the model's own context (vLLM
    refuses more: the rehearsal's vLLM quickstart asked 260 of a 128-position model); a length the
    manifest sets goes through as it is."""
    from rlhf_trainer.rollout import model_context

    context = model_context(str(tiny_lm_dir))
    assert context is not None
    spec = _spec(engine="hf")
    engine = build_engine(spec.rollout, str(tiny_lm_dir), max_model_len=context + 100)
    assert engine.max_model_len == context
    explicit = _spec(engine="hf", maxModelLength=context + 100)
    engine = build_engine(explicit.rollout, str(tiny_lm_dir), max_model_len=max_model_length(explicit))
    assert engine.max_model_len == context + 100


def test_the_reward_model_loads_in_its_dtype(tmp_path: Path) -> None:
    from transformers import LlamaConfig, LlamaForSequenceClassification

    from rlhf_trainer.tiny_model import build_char_tokenizer

    tok = build_char_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        num_labels=1,
        pad_token_id=tok.pad_token_id,
    )
    LlamaForSequenceClassification(config).save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    spec = _spec()
    spec.reward.model.path = str(tmp_path)
    combined = CombinedReward.from_spec(spec.reward, dtype=spec.model.dtype)
    scorer = combined.rewards[0].calc
    assert next(scorer.model.parameters()).dtype == torch.bfloat16
    assert len(scorer.compute_reward(["1+1="], ["2"])) == 1
