"""What a GPU vllm engine holds while weights go in, checked without vLLM or CUDA: the CUDA IPC
update streams the given (host) tensors one at a time through `_Stream` (vLLM's packed IPC then
copies each into its one staging buffer, `ipc_bucket` bytes), and torch's cached CUDA blocks go
back to the driver before the engine wakes and after every update. The same source built over
the installed vLLM's `WeightSource` is checked in the vLLM env (tests/vllm_engine)."""

from __future__ import annotations

import gc
import weakref
from typing import Any

import pytest
import torch

from rlhf_trainer.rollout import vllm as vllm_engine
from rlhf_trainer.rollout.vllm import VLLMRolloutEngine, _Stream, engine_kwargs, ipc_bucket

PARAMS = [
    ("model.embed_tokens.weight", torch.bfloat16, (64, 16)),
    ("model.layers.0.mlp.up_proj.weight", torch.bfloat16, (32, 16)),
    ("model.norm.weight", torch.bfloat16, (16,)),
]


class RecordingLLM:
    """Stands in for vllm.LLM (sleep mode and IPC need CUDA): records the calls the engine makes."""

    def __init__(self, calls: list[Any]) -> None:
        self.calls = calls

    def sleep(self, level: int) -> None:
        self.calls.append(("sleep", level))

    def wake_up(self, tags: list[str] | None = None) -> None:
        self.calls.append(("wake_up", tags))

    def reset_prefix_cache(self) -> None:
        self.calls.append(("reset_prefix_cache", None))


class CountingSender:
    """Stands in for vLLM's `IPCTrainerWeightTransferEngine.send_weights` (CUDA only): iterates
    the source the way it does, keeping each tensor only until the next, and records the bytes
    of yielded tensors still alive at every step."""

    def __init__(self, source: _Stream, calls: list[Any]) -> None:
        self.source, self.calls = source, calls
        self.alive: list[int] = []
        self.devices: set[str] = set()

    def send_weights(self) -> None:
        self.calls.append(("send_weights", None))
        refs: list[Any] = []
        for _, tensor in self.source._tensors():
            refs.append(weakref.ref(tensor))
            self.devices.add(str(tensor.device))
            self.alive.append(sum(r().numel() * r().element_size() for r in refs if r() is not None))
            del tensor
            gc.collect()


def ipc_engine(calls: list[Any]) -> tuple[VLLMRolloutEngine, CountingSender]:
    e = VLLMRolloutEngine(RecordingLLM(calls), type("Tok", (), {"pad_token_id": 0})(), max_new_tokens=4)
    e.weight_transfer = "ipc"
    e.dtype = torch.bfloat16
    e._ipc_source = _Stream(PARAMS)
    e._ipc = sender = CountingSender(e._ipc_source, calls)
    return e, sender


def test_an_ipc_update_streams_one_tensor_at_a_time_and_keeps_them_on_the_host(monkeypatch) -> None:
    calls: list[Any] = []
    monkeypatch.setattr(vllm_engine, "release_cached_gpu_memory", lambda: calls.append(("empty_cache", None)))
    e, sender = ipc_engine(calls)
    update = [(n, torch.randn(shape)) for n, _, shape in PARAMS]  # fp32, as the receiver holds them
    assert e.load_weights(update) == len(PARAMS)
    sizes = [2 * torch.Size(shape).numel() for _, _, shape in PARAMS]  # bf16 bytes
    assert sender.alive == sizes  # while one is sent, no earlier one is held
    assert sender.devices == {"cpu"}  # no device copy of the model before vLLM's staging buffer
    assert calls == [("send_weights", None), ("empty_cache", None), ("reset_prefix_cache", None)]
    assert e._ipc_source._pending == []  # the update's tensors are not kept by the source
    name, t = update[1]
    assert torch.equal(dict(e.named_weights([name]))[name], t.to(torch.bfloat16))


def test_an_ipc_update_with_an_unknown_name_or_shape_sends_nothing() -> None:
    calls: list[Any] = []
    e, _ = ipc_engine(calls)
    with pytest.raises(KeyError, match="'lm_head.weight' is not a parameter"):
        e.load_weights([("model.norm.weight", torch.ones(16)), ("lm_head.weight", torch.ones(64, 16))])
    with pytest.raises(ValueError, match=r"has shape \(8,\), the rollout model expects \(16,\)"):
        e.load_weights([("model.norm.weight", torch.ones(8))])
    assert ("send_weights", None) not in calls
    with pytest.raises(KeyError, match="never loaded"):
        e.named_weights(["model.norm.weight"])


def test_cached_blocks_go_back_before_a_colocated_engine_wakes(monkeypatch) -> None:
    calls: list[Any] = []
    monkeypatch.setattr(vllm_engine, "release_cached_gpu_memory", lambda: calls.append(("empty_cache", None)))
    e, _ = ipc_engine(calls)
    e.sleep_mode = True
    e.sleep()
    e.load_weights([("model.norm.weight", torch.ones(16))])
    assert calls[1:3] == [("empty_cache", None), ("wake_up", ["weights"])]
    calls.clear()
    e._wake({"weights", "kv_cache"})  # what generate does first
    assert calls == [("empty_cache", None), ("wake_up", ["kv_cache"])]
    calls.clear()
    e._wake({"weights", "kv_cache"})  # awake: nothing to release for
    assert calls == []


def test_release_is_a_no_op_without_cuda() -> None:
    if torch.cuda.is_available():
        pytest.skip("checks the CPU behaviour; on a GPU it empties the cache (tests/gpu)")
    vllm_engine.release_cached_gpu_memory()  # must not initialise CUDA
    assert not torch.cuda.is_initialized()


def test_the_ipc_bucket_fits_the_largest_parameter() -> None:
    assert ipc_bucket(PARAMS, 1 << 20) == 1 << 20
    assert ipc_bucket(PARAMS, 100) == 64 * 16 * 2  # the embedding, bf16
    with pytest.raises(ValueError, match="ipc_bucket_bytes: 0 is not valid"):
        ipc_bucket(PARAMS, 0)


def test_engine_kwargs_pick_the_transfer_per_path() -> None:
    gpu, transfer = engine_kwargs("m", "t", dtype="bfloat16", seed=1, on_cpu=False, sleep_mode=True)
    assert transfer == "ipc" and gpu["weight_transfer_config"] == {"backend": "ipc"}
    assert gpu["enable_sleep_mode"] is True and "enforce_eager" not in gpu
    tp2, transfer = engine_kwargs("m", "t", dtype="bfloat16", seed=1, on_cpu=False, tensor_parallel_size=2)
    assert transfer == "reload" and "weight_transfer_config" not in tp2
    cpu, transfer = engine_kwargs("m", "t", dtype="float32", seed=1, on_cpu=True, kv_cache_bytes=1 << 20)
    assert transfer == "reload" and cpu["kv_cache_memory_bytes"] == 1 << 20 and cpu["enforce_eager"]
    assert "gpu_memory_utilization" not in cpu
    with pytest.raises(ValueError, match="tensorParallelSize: 2 needs GPUs"):
        engine_kwargs("m", "t", dtype="float32", seed=1, on_cpu=True, tensor_parallel_size=2)
