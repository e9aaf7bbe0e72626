"""Checks of the `vllm` rollout engine, run INSIDE the vLLM test env (scripts/vllm_env.sh) by
tests/vllm_engine/test_vllm_engine.py, which asserts on the JSON this prints on its last line.

    python vllm_checks.py greedy   MODEL_DIR SCRATCH tied|untied
    python vllm_checks.py logprobs MODEL_DIR SCRATCH TEMPERATURE
    python vllm_checks.py ipc      MODEL_DIR SCRATCH BUCKET_BYTES
    python vllm_checks.py engine_args MODEL_DIR SCRATCH -
    python vllm_checks.py verify   MODEL_DIR SCRATCH -
    python vllm_checks.py multiturn MODEL_DIR SCRATCH -

One engine per process (vLLM's in-process engine is started once per process).

`greedy`: the quickstart's tiny model (tied embeddings) or an untied copy of it: the
hf and vllm engines decode the same prompts greedily before and after a weight update (new
weights made on the spot), then after a second, partial update (the output layer only) and
after restoring the original weights. Reports every engine's tokens per phase.

`logprobs`: after a weight update, vLLM samples at TEMPERATURE; the trainer's
`modeling.token_log_probs` scores the same tokens with a transformers model holding the same
weights (fp32). Reports the largest difference over response tokens.

`ipc` (no engine, no CUDA): the GPU path's CUDA IPC weight source, built as `_init_ipc` builds it
(`weight_source(param_metadata(...))`), driven through the installed vLLM's own source-side calls
(0.32: `iter_groups`, which reads `metadata()` and `__iter__` and checks they agree; 0.33+: the
checks `IPCTrainerWeightTransferEngine.trainer_init` makes, then `iter_full`), plus the init info
(packed, bucket) and one update payload through `_LLMClient`'s pickling into vLLM's worker-side
`IPCWeightTransferUpdateInfo`. Counts, per yielded tensor, the bytes of the update's tensors that
the source holds alive: at most one.

`engine_args` (no engine): the GPU path's `LLM` arguments (`engine_kwargs(on_cpu=False)`, TP 1
with and without sleep mode, TP 2) bound to `vllm.LLM.__init__`'s signature and built into
vLLM's `EngineArgs` (an unknown or renamed argument raises there), then configured by vLLM
(`create_engine_config`, which validates the values; sleep mode is refused on CPU, which has
none); the CPU path's as well.

`multiturn`: multi-turn episodes (`rollout.multiturn.rollout_episodes`) against a scripted
environment, greedily through the vllm and hf engines (the same tokens expected) and sampled
through vllm, scored by the trainer's `token_log_probs` over the environment's tokens.

`verify`: a CPU engine after an update returns, through `named_weights`, exactly the weights
it was given (the digest a weight sync's `verify` compares with the actor's).
"""

from __future__ import annotations

import json
import math
import random
import sys
from pathlib import Path
from typing import Any

import torch


def prompts(tokenizer: Any, n: int = 24, seed: int = 0) -> list[list[int]]:
    """Arithmetic prompts of the quickstart's kind and a few longer ones (uneven lengths)."""
    rng = random.Random(seed)
    texts = [f"{rng.randint(0, 9)}+{rng.randint(0, 9)}=" for _ in range(n)]
    texts += ["12+30=", "what is 7+8? 7+8=", "1+1=2, 2+2=4, 3+3="]
    return [tokenizer(t).input_ids for t in texts]


def perturbed(model: Any, scale: float, seed: int, only: str | None = None) -> dict[str, torch.Tensor]:
    """The model's full state dict (tied names included) after adding noise of `scale` x each
    parameter's std (to the parameters whose name contains `only`, if given) to the model."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if only is None or only in name:
                p.add_(torch.randn(p.shape, generator=g) * scale * (p.std() + 1e-3))
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def untied_copy(src: Path, dst: Path) -> Path:
    """`src` with its output layer untied from the embeddings (a copy of them)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    model.config.tie_word_embeddings = False
    untied = type(model)(model.config)
    state = model.state_dict()
    state["lm_head.weight"] = state["model.embed_tokens.weight"].clone()
    untied.load_state_dict(state)
    untied.generation_config = model.generation_config
    untied.save_pretrained(dst)
    AutoTokenizer.from_pretrained(src).save_pretrained(dst)
    return dst


def greedy(model_dir: Path, scratch: Path, label: str) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM

    from rlhf_trainer.rollout.hf import HFRolloutEngine
    from rlhf_trainer.rollout.vllm import VLLMRolloutEngine

    path = model_dir if label == "tied" else untied_copy(model_dir, scratch / "untied")
    kw = {"max_new_tokens": 8, "temperature": 1.0, "seed": 0}
    hf = HFRolloutEngine.from_pretrained(str(path), **kw)
    vl = VLLMRolloutEngine.from_pretrained(str(path), max_model_len=64, **kw)
    ps = prompts(hf.tokenizer)
    original = {k: v.clone() for k, v in hf.state_dict().items()}
    trainer_model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    phases: dict[str, dict[str, list[list[int]]]] = {}

    def decode(phase: str, hf: Any = hf, vl: Any = vl, ps: Any = ps, phases: Any = phases) -> None:
        phases[phase] = {
            name: [
                row[: int(m.sum())] for row, m in zip(b.response_ids.tolist(), b.response_mask, strict=True)
            ]
            for name, b in (("hf", hf.generate(ps, greedy=True)), ("vllm", vl.generate(ps, greedy=True)))
        }

    decode("before")
    new = perturbed(trainer_model, 0.5, seed=1)
    assert hf.load_weights(new.items()) == vl.load_weights(new.items()) == len(new)
    decode("updated")
    head = "lm_head" if label == "untied" else "embed_tokens"
    part = perturbed(trainer_model, 0.5, seed=2, only=head)
    partial = [(k, v) for k, v in part.items() if head in k]
    hf.load_weights(partial)
    vl.load_weights(partial)
    decode("partial")
    hf.load_weights(original.items())
    vl.load_weights(original.items())
    decode("restored")
    return {"phases": phases, "partial_names": [k for k, _ in partial]}


def logprobs(model_dir: Path, scratch: Path, temperature_arg: str) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM

    from rlhf_trainer.rollout.vllm import VLLMRolloutEngine
    from rlhf_trainer.workers.modeling import token_log_probs

    trainer_model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    new = perturbed(trainer_model, 0.3, seed=3)
    trainer_model.eval()
    temperature = float(temperature_arg)
    vl = VLLMRolloutEngine.from_pretrained(
        str(model_dir), max_new_tokens=8, temperature=temperature, seed=0, max_model_len=64
    )
    vl.load_weights(new.items())
    batch = vl.generate(prompts(vl.tokenizer), n=4)
    with torch.no_grad():
        ref, _ = token_log_probs(trainer_model, batch.to_dict(), temperature=temperature)
    mask = batch.response_mask > 0
    diff = (ref - batch.log_probs).abs()[mask]
    return {
        "tokens": int(mask.sum()),
        "max_abs_diff": float(diff.max()),
        "mean_log_prob": float(batch.log_probs[mask].mean()),
        "distinct_responses": len({tuple(r) for r in batch.response_ids.tolist()}),
    }


def _alive_bytes(refs: list[Any]) -> int:
    return sum(r().numel() * r().element_size() for r in refs if r() is not None)


def ipc(model_dir: Path, scratch: Path, bucket_arg: str) -> dict[str, Any]:
    import gc
    import inspect
    import weakref

    import vllm
    from vllm.distributed.weight_transfer import base
    from vllm.distributed.weight_transfer.ipc_engine import (
        IPCTrainerWeightTransferEngine,
        IPCWeightTransferUpdateInfo,
    )

    from rlhf_trainer.rollout.vllm import (
        _LLMClient,
        ipc_bucket,
        ipc_init_info,
        param_metadata,
        weight_source,
    )

    params = param_metadata(str(model_dir), "bfloat16")  # a bf16 engine
    source = weight_source(params)  # as `_init_ipc` builds it
    assert isinstance(source, base.WeightSource), type(source).__mro__
    expected: dict[str, torch.Tensor] = {}
    refs: list[Any] = []
    alive: list[int] = []

    def updates() -> Any:  # the update as the receiver holds it: fp32 host tensors
        for name, _, shape in params:
            t = torch.randn(shape)
            expected[name] = t.to(torch.bfloat16)
            yield name, t

    source.stream(source.check(updates()), torch.bfloat16)
    new_api = hasattr(base.WeightSource, "iter_full")  # vLLM 0.33's interface
    if new_api:  # what trainer_init checks, then what IPC's _send iterates
        assert source.implements_iter_full()
        assert len(source.owned_names(0)) == len(source.metadata)
        metadata = source.metadata
        stream = source.iter_full()
    else:  # vLLM's own pass over both channels (raises when they disagree), then IPC's
        metadata = source.metadata()
        grouped = [n for names, _ in source.iter_groups() for n in names]
        assert grouped == [m.name for m in metadata], grouped
        stream = iter(source)
    gc.collect()
    got = {}
    for name, tensor in stream:
        refs.append(weakref.ref(tensor))
        got[name] = tensor.clone()
        alive.append(_alive_bytes(refs))  # the yielded tensors still alive, this one included
        del tensor
        gc.collect()
    source.stream([], torch.bfloat16)
    names = [m.name for m in metadata]
    sig = inspect.signature(IPCTrainerWeightTransferEngine.trainer_init)
    bucket = ipc_bucket(params, int(bucket_arg))
    info = ipc_init_info(bucket)
    # One update as the packed producer emits it, through the client's pickling, parsed by the
    # worker side (vLLM refuses pickled handles without this variable; `from_pretrained` sets it).
    import os

    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    payload = {
        "names": names[:2],
        "dtype_names": ["bfloat16", "bfloat16"],
        "shapes": [list(s) for _, _, s in params[:2]],
        "ipc_handles": {"GPU-uuid": (0, 1, 2, 3, 4, 5, 6, 7)},
        "tensor_sizes": [4, 4],
    }
    sent: list[Any] = []

    class Recorder:
        def update_weights(self, request: dict[str, Any]) -> None:
            sent.append(request["update_info"])

    client = _LLMClient(Recorder())
    client.update_weights(payload)
    parsed = IPCWeightTransferUpdateInfo(**sent[0])
    largest = max(2 * math.prod(s) for _, _, s in params)  # bf16
    return {
        "vllm": vllm.__version__,
        "interface": "iter_full" if new_api else "__iter__",
        "metadata_names": names,
        "metadata_dtypes": sorted({str(m.dtype) for m in metadata}),
        "param_names": [n for n, _, _ in params],
        "yielded": list(got),
        "yielded_dtypes": sorted({str(t.dtype) for t in got.values()}),
        "yielded_devices": sorted({str(t.device) for t in got.values()}),
        "exact": all(torch.equal(got[n], expected[n]) for n in got),
        "alive_bytes": alive,
        "tensor_bytes": [2 * math.prod(s) for _, _, s in params],
        "largest_param_bytes_bf16": largest,
        "trainer_init_params": list(sig.parameters),
        "init_info": {"rank": info.rank, "packed": info.packed, "bucket": info.packed_buffer_size_bytes},
        "bucket": bucket,
        "client_is_protocol": isinstance(client, base.VLLMWeightSyncClient),
        "parsed_handles": parsed.ipc_handles == payload["ipc_handles"],
        "parsed_sizes": parsed.tensor_sizes,
    }


def engine_args(model_dir: Path, scratch: Path, _: str) -> dict[str, Any]:
    import inspect

    from vllm import LLM, EngineArgs
    from vllm.config.weight_transfer import WeightTransferConfig
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    from rlhf_trainer.rollout.vllm import engine_kwargs

    cases = {
        "gpu_tp1": {"on_cpu": False},
        "gpu_tp1_sleep": {"on_cpu": False, "sleep_mode": True},
        "gpu_tp2": {"on_cpu": False, "tensor_parallel_size": 2},
        "cpu": {"on_cpu": True},
    }
    out: dict[str, Any] = {}
    llm_sig = inspect.signature(LLM.__init__)
    for label, case in cases.items():
        kwargs, transfer = engine_kwargs(
            str(model_dir), str(model_dir), dtype="bfloat16", seed=3, max_model_len=64, **case
        )
        llm_sig.bind(None, **kwargs)  # TypeError on an argument LLM does not take
        args = EngineArgs(**kwargs)  # TypeError on one EngineArgs lacks
        config = ""
        if label != "gpu_tp2":  # (TP 2 needs 2 devices to be configured)
            try:  # vLLM's own validation of every value (model, dtype, logprobs mode, backend)
                built = args.create_engine_config()
                config = f"ok: {built.weight_transfer_config}"
            except ValueError as err:  # pydantic's ValidationError is one
                config = f"refused: {err}"
        wt = args.weight_transfer_config
        out[label] = {
            "transfer": transfer,
            "keys": sorted(kwargs),
            "weight_transfer": wt.backend if isinstance(wt, WeightTransferConfig) else None,
            "sleep": bool(args.enable_sleep_mode),
            "gpu_memory_utilization": args.gpu_memory_utilization,
            "logprobs_mode": str(args.logprobs_mode),
            "tp": args.tensor_parallel_size,
            "config": config,
        }
    out["ipc_registered"] = "ipc" in WeightTransferEngineFactory._registry
    return out


def verify(model_dir: Path, scratch: Path, _: str) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM

    from rlhf_trainer.rollout.vllm import VLLMRolloutEngine
    from rlhf_trainer.sync import tensor_digest

    trainer_model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    params = dict(trainer_model.named_parameters())  # the names a sync streams (tied ones once)
    actor_before = tensor_digest(params.items())
    vl = VLLMRolloutEngine.from_pretrained(str(model_dir), max_new_tokens=4, seed=0, max_model_len=64)
    before = tensor_digest(vl.named_weights(params))
    new = perturbed(trainer_model, 0.3, seed=4)
    vl.load_weights(new.items())
    after = tensor_digest(vl.named_weights(params))
    unknown = ""
    try:
        vl.named_weights(["no.such.weight"])
    except KeyError as err:
        unknown = str(err)
    return {
        "before_equals_actor": before == actor_before,
        "after_equals_actor": after == tensor_digest(params.items()),
        "changed": before != after,
        "unknown_error": unknown,
    }


class _ScriptedEnv:
    """Answers `|ok<k>|` to the first `2 - (prompt length % 2)` model turns, then ends."""

    def step(self, episode: Any) -> Any:
        from rlhf_trainer.environments import EnvStep

        k = episode.state.get("k", 0)
        if k >= 2 - len(episode.prompt_ids) % 2:
            return EnvStep(done=True)
        episode.state["k"] = k + 1
        return EnvStep(observation=f"|ok{k}|", reward=0.5)


def multiturn(model_dir: Path, scratch: Path, _: str) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM

    from rlhf_trainer.rollout.hf import HFRolloutEngine
    from rlhf_trainer.rollout.multiturn import observation_counts, rollout_episodes
    from rlhf_trainer.rollout.vllm import VLLMRolloutEngine
    from rlhf_trainer.workers.modeling import token_log_probs

    kw = {"max_new_tokens": 6, "temperature": 1.0, "seed": 0}
    vl = VLLMRolloutEngine.from_pretrained(str(model_dir), max_model_len=64, **kw)
    hf = HFRolloutEngine.from_pretrained(str(model_dir), **kw)
    ps = prompts(vl.tokenizer, n=8)
    run = {"max_turns": 3, "max_total_tokens": 40}
    greedy = {
        name: rollout_episodes(engine, engine.tokenizer, _ScriptedEnv(), ps, 1, greedy=True, **run)
        for name, engine in (("vllm", vl), ("hf", hf))
    }
    sampled = rollout_episodes(vl, vl.tokenizer, _ScriptedEnv(), ps, 2, **run)
    trainer_model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        ref, _ = token_log_probs(
            trainer_model, {k: v for k, v in sampled.to_dict().items() if isinstance(v, torch.Tensor)}
        )
    model_tokens = sampled.response_mask > 0
    env_tokens = sampled.observation_mask > 0

    def rows(b: Any) -> list[list[int]]:
        real = (b.response_mask + b.observation_mask) > 0
        return [r[m].tolist() for r, m in zip(b.response_ids, real)]

    return {
        "greedy_equal": rows(greedy["vllm"]) == rows(greedy["hf"]),
        "observations": observation_counts(sampled.observation_mask).tolist(),
        "expected_observations": [2 - len(p) % 2 for p in ps for _ in range(2)],
        "overlap": int((model_tokens & env_tokens).sum()),
        "env_log_prob_abs_sum": float(sampled.log_probs[env_tokens].abs().sum()),
        "max_abs_diff": float((ref - sampled.log_probs).abs()[model_tokens].max()),
        "env_tokens": int(env_tokens.sum()),
    }


def main() -> int:
    what, model_dir, scratch, arg = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3]), sys.argv[4]
    checks = {
        "greedy": greedy,
        "logprobs": logprobs,
        "ipc": ipc,
        "engine_args": engine_args,
        "verify": verify,
        "multiturn": multiturn,
    }
    result = checks[what](model_dir, scratch, arg)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
