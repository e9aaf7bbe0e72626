"""The vllm engine's sleep-mode sequence (colocated on a GPU). vLLM's sleep mode exists only on
CUDA (its CPU backend has none), so this drives the engine over a recording stand-in for vLLM's
`LLM` and checks the order of calls that vLLM's sleep-mode guide prescribes for RL: sleep(level=1)
while training, wake the weights alone for an update, the KV cache at the next generate. The real
sequence runs only on a GPU (tests/gpu/run.sh)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from rlhf_trainer.rollout.vllm import VLLMRolloutEngine


class RecordingLLM:
    """Stands in for vllm.LLM (sleep mode needs CUDA): records the calls the engine makes."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []

    def sleep(self, level: int) -> None:
        self.calls.append(("sleep", level))

    def wake_up(self, tags: list[str] | None = None) -> None:
        self.calls.append(("wake_up", tags))

    def collective_rpc(self, method: str, kwargs: dict[str, Any] | None = None) -> list[Any]:
        self.calls.append(("collective_rpc", method))
        return [None]

    def reset_prefix_cache(self) -> None:
        self.calls.append(("reset_prefix_cache", None))


class Tok:
    pad_token_id = 0
    eos_token_id = 1


def engine(sleep_mode: bool) -> tuple[VLLMRolloutEngine, RecordingLLM]:
    llm = RecordingLLM()
    e = VLLMRolloutEngine(llm, Tok(), max_new_tokens=4, host_weights={"w": torch.zeros(2, 2)})
    e.sleep_mode = sleep_mode
    return e, llm


def test_an_update_wakes_the_weights_only_and_generate_wakes_the_rest() -> None:
    e, llm = engine(sleep_mode=True)
    e.sleep()
    e.sleep()  # already asleep: one call
    assert llm.calls == [("sleep", 1)]
    assert e.asleep == {"weights", "kv_cache"}
    e.load_weights([("w", torch.ones(2, 2))])
    assert llm.calls[1:] == [
        ("wake_up", ["weights"]),  # before the reload: the weights must be resident to be replaced
        ("collective_rpc", "reload_weights"),
        ("reset_prefix_cache", None),
    ]
    assert e.asleep == {"kv_cache"}  # not reallocated beside the training state
    e._wake({"weights", "kv_cache"})  # what generate does first
    assert llm.calls[-1] == ("wake_up", ["kv_cache"]) and not e.asleep


def test_without_sleep_mode_nothing_sleeps() -> None:
    e, llm = engine(sleep_mode=False)
    e.sleep()
    e.load_weights([("w", torch.ones(2, 2))])
    assert [c[0] for c in llm.calls] == ["collective_rpc", "reset_prefix_cache"]


def test_a_bad_update_is_refused_before_anything_changes() -> None:
    e, llm = engine(sleep_mode=False)
    with pytest.raises(KeyError, match="'v' is not a parameter"):
        e.load_weights([("v", torch.ones(2, 2))])
    assert llm.calls == [] and torch.equal(e.host_weights["w"], torch.zeros(2, 2))
