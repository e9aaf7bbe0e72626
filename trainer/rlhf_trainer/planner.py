"""The resource planner: each role's memory per GPU, estimated from the model's config and the
manifest, against the GPU its node pool has, before any pod starts (torch-free).

Users otherwise learn these from an OOM an hour into a job. `rlhf validate` (and `rlhf run`)
call `plan_job`: its `errors` are shapes that cannot start, its `warnings` GPUs that are paid
for and never used, its `notes` what could not be checked (a model config that is not on this
machine, a pool whose GPU is unknown). A job without GPUs gets an empty plan.

What each rank holds (bytes; P parameters, c the compute dtype's size, W the role's ranks):

| role | resident | transient |
|---|---|---|
| actor, critic | fp32 master weights 4P, fp32 gradients 4P' and AdamW's two fp32 moments 8P' (P' the trained parameters: P, or LoRA's adapters), all sharded over W by FSDP2 | the gathered layers in c (FSDP2) or a whole c copy (autocast on one rank); the larger of activations + logits of one micro-batch and the optimizer step's temporaries 4P'/W (they never coexist) |
| reference | the model in c, whole on every rank | one block's transients of a micro-batch's forward (no grad: about 4 hidden-size and 2 intermediate-size values per token, `FWD_*`), the logits |
| reward | the reward model in its dtype, whole on every rank | one block's transients of a scoring batch |
| rollout (vllm) | `gpuMemoryUtilization` x the GPU: weights / TP, an allowance for vLLM's profile run, and the KV cache, which must hold one sequence of `maxModelLength` | |
| rollout (hf) | the model in c | the KV cache of its rows at `maxModelLength` |

Activations follow the usual count for a transformer block (per token: about 10 hidden-size and
4 intermediate-size values kept for the backward, `ACT_HIDDEN`/`ACT_INTERMEDIATE`); activation
checkpointing keeps one hidden-size value per layer and one block's worth. These are
estimates, not measurements: the refusals rest on the resident figures (weights, optimizer,
the engine's fraction, the KV cache), which are exact up to allocator slack; activations only
warn. tests/unit/test_planner.py holds the resident figures to measured ones within 15%.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rlhf_api.job import max_response_length, roles_in_use

GIB = 1024**3
MIB = 1024**2
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
#: Dtype of the trained roles' master weights, gradients and AdamW moments (`modeling.MASTER_DTYPE`).
MASTER_BYTES = 4
#: AdamW keeps two fp32 moments per trained parameter.
ADAM_MOMENTS = 2
#: Per token and layer, values kept for the backward pass (multiples of hidden and intermediate size).
ACT_HIDDEN = 10
ACT_INTERMEDIATE = 4
#: Per token, values alive at once in one block of a no-grad forward (nothing is kept for a backward).
FWD_HIDDEN = 4
FWD_INTERMEDIATE = 2
#: Per GPU, outside what the estimate counts: CUDA context, NCCL buffers, allocator slack.
RUNTIME_BYTES = 1 * GIB
#: Tokens of vLLM's profile forward (its default `max_num_batched_tokens` for offline engines)
#: and sequences of its sampler: the transient memory it reserves inside the engine's fraction.
VLLM_PROFILE_TOKENS = 8192
VLLM_PROFILE_SEQS = 256
#: The linear layers of a Llama-like block, with (input, output) in units the config gives.
_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

#: GPUs known by their `nvidia.com/gpu.product` label (tokens that must all appear) -> memory in
#: MiB as the driver reports it (`nvidia.com/gpu.memory`). A100 needs its size: both exist.
KNOWN_GPUS: tuple[tuple[tuple[str, ...], int], ...] = (
    (("H200",), 143771),
    (("H100",), 81559),
    (("A100", "80GB"), 81920),
    (("A100", "40GB"), 40960),
    (("L40S",), 46068),
    (("L4",), 23034),
    (("A10G",), 23028),
)


# --------------------------------------------------------------------------------------------
# Inputs: the model's shape and the GPU's memory
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelShape:
    """What the planner needs of a decoder-only transformer's `config.json` (Llama, Qwen2,
    Mistral and their kin: attention q/k/v/o and a gated MLP of three matrices per layer)."""

    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied: bool
    qkv_bias: bool
    source: str

    @classmethod
    def from_config(cls, config: Mapping[str, Any], source: str = "config.json") -> ModelShape:
        config = config.get("text_config", config)
        missing = [
            k
            for k in ("num_hidden_layers", "hidden_size", "num_attention_heads", "vocab_size")
            if k not in config
        ]
        if missing:
            raise ValueError(f"{source}: no {', '.join(missing)}: not a decoder config the planner reads")
        hidden, heads = int(config["hidden_size"]), int(config["num_attention_heads"])
        return cls(
            layers=int(config["num_hidden_layers"]),
            hidden=hidden,
            intermediate=int(config.get("intermediate_size") or 4 * hidden),
            heads=heads,
            kv_heads=int(config.get("num_key_value_heads") or heads),
            head_dim=int(config.get("head_dim") or hidden // heads),
            vocab=int(config["vocab_size"]),
            tied=bool(config.get("tie_word_embeddings", False)),
            # Qwen2 has biases on q, k and v without saying so in its config.
            qkv_bias=bool(config.get("attention_bias", config.get("model_type") == "qwen2")),
            source=source,
        )

    def linear_shapes(self) -> dict[str, tuple[int, int]]:
        """(in, out) features of each linear layer of one block."""
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        h, i = self.hidden, self.intermediate
        return {
            "q_proj": (h, q),
            "k_proj": (h, kv),
            "v_proj": (h, kv),
            "o_proj": (q, h),
            "gate_proj": (h, i),
            "up_proj": (h, i),
            "down_proj": (i, h),
        }

    def block_params(self) -> int:
        bias = (self.heads + 2 * self.kv_heads) * self.head_dim if self.qkv_bias else 0
        return sum(a * b for a, b in self.linear_shapes().values()) + bias + 2 * self.hidden  # + 2 norms

    def params(self, head: str = "lm") -> int:
        """Parameters of the causal LM (`head="lm"`), of a 1-label sequence classifier (`"score"`,
        the reward model) or of the backbone with a value head (`"value"`, the critic)."""
        body = self.vocab * self.hidden + self.layers * self.block_params() + self.hidden
        if head == "lm":
            return body + (0 if self.tied else self.vocab * self.hidden)
        return body + self.hidden + (1 if head == "value" else 0)

    def lora_params(self, rank: int, targets: Iterable[str]) -> int:
        """Trained parameters of LoRA adapters of `rank` on `targets` (`all-linear` or names)."""
        names = set(targets)
        chosen = _LINEARS if "all-linear" in names else [n for n in _LINEARS if n in names]
        shapes = self.linear_shapes()
        return self.layers * sum(rank * (shapes[n][0] + shapes[n][1]) for n in chosen)

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """K and V of every layer for one token."""
        return 2 * self.layers * self.kv_heads * self.head_dim * dtype_bytes

    def activation_bytes(self, tokens: int, dtype_bytes: int, checkpointing: bool) -> int:
        """Activations one training forward keeps for its backward, over `tokens` tokens."""
        per_layer = tokens * (ACT_HIDDEN * self.hidden + ACT_INTERMEDIATE * self.intermediate) * dtype_bytes
        if checkpointing:
            return self.layers * tokens * self.hidden * dtype_bytes + per_layer
        return self.layers * per_layer


def hub_cache_dirs() -> list[Path]:
    """Where the Hugging Face hub cache is: huggingface_hub's own answer (HF_HUB_CACHE, HF_HOME,
    the default; it owns that rule), else its documented default where the library is absent."""
    try:
        from huggingface_hub import constants
    except ImportError:
        return [Path("~/.cache/huggingface/hub").expanduser()]
    return [Path(constants.HF_HUB_CACHE).expanduser()]


def find_config(path: str) -> Path | None:
    """`config.json` of the model at `path`: a local directory, else a hub id in the local hub
    cache (its `refs/main` snapshot, or any snapshot). Never downloads."""
    local = Path(path).expanduser() / "config.json"
    if local.is_file():
        return local
    if path.startswith(("/", ".", "~")) or path.count("/") != 1:
        return None
    for cache in hub_cache_dirs():
        repo = cache / ("models--" + path.replace("/", "--"))
        ref = repo / "refs" / "main"
        snapshots = [repo / "snapshots" / ref.read_text().strip()] if ref.is_file() else []
        snapshots += sorted((repo / "snapshots").glob("*")) if (repo / "snapshots").is_dir() else []
        for snap in snapshots:
            if (snap / "config.json").is_file():
                return snap / "config.json"
    return None


def local_shape(path: str) -> ModelShape | None:
    """The shape of the model at `path` when its config is on this machine, else None."""
    found = find_config(path)
    if found is None:
        return None
    return ModelShape.from_config(json.loads(found.read_text()), source=str(found))


@dataclass(frozen=True)
class Gpu:
    """One GPU of a pool: its product name (when known) and its memory, and where that came from."""

    product: str | None
    memory: int
    source: str

    def __str__(self) -> str:
        return f"{self.product or 'GPU'} ({gib(self.memory)})"


def known_gpu_memory(product: str) -> int | None:
    """Memory in bytes of a GPU named by its `nvidia.com/gpu.product` label, if it is known."""
    tokens = set(re.split(r"[-_ ]+", product.upper()))
    for needed, mib in KNOWN_GPUS:
        if all(t in tokens for t in needed):
            return mib * MIB
    return None


_QUANTITY_UNITS = {
    "": 1,
    "k": 10**3,
    "M": 10**6,
    "G": 10**9,
    "T": 10**12,
    "Ki": 2**10,
    "Mi": 2**20,
    "Gi": 2**30,
    "Ti": 2**40,
}


def quantity_bytes(quantity: str) -> int:
    """A Kubernetes memory quantity in bytes: "80Gi" -> 85899345920."""
    m = re.fullmatch(r"([0-9.]+)([a-zA-Z]*)", quantity.strip())
    if not m or m.group(2) not in _QUANTITY_UNITS:
        raise ValueError(f"not a memory quantity: {quantity!r}; valid: e.g. 80Gi, 24Gi, 81559Mi")
    return int(float(m.group(1)) * _QUANTITY_UNITS[m.group(2)])


def pool_gpu(pool: Any, where: str, nodes: list[Mapping[str, Any]] | None = None) -> Gpu | None:
    """The GPU of `pool` (a `NodePoolSpec`): its `gpuMemory`, else the memory label of its nodes
    (`nodes`: `kubectl get nodes -o json` items, when given), else the memory known for its
    product (`gpuProduct`, the nodeSelector's `nvidia.com/gpu.product`, or the nodes' label)."""
    labels = [n.get("metadata", {}).get("labels", {}) for n in nodes or []]
    mine = [lab for lab in labels if all(lab.get(k) == v for k, v in pool.node_selector.items())]
    product = pool.gpu_product or pool.node_selector.get("nvidia.com/gpu.product")
    products = {lab["nvidia.com/gpu.product"] for lab in mine if lab.get("nvidia.com/gpu.product")}
    product = product or (min(products) if products else None)
    if pool.gpu_memory:
        return Gpu(product, quantity_bytes(pool.gpu_memory), f"{where}.gpuMemory")
    memories = [
        int(lab["nvidia.com/gpu.memory"])
        for lab in mine
        if str(lab.get("nvidia.com/gpu.memory", "")).isdigit()
    ]
    if memories:
        return Gpu(product, min(memories) * MIB, f"label nvidia.com/gpu.memory of {len(mine)} node(s)")
    known = known_gpu_memory(product) if product else None
    if known:
        return Gpu(product, known, f"known memory of {product}")
    return None


def gib(n: float) -> str:
    return f"{n / GIB:.1f} GiB"


# --------------------------------------------------------------------------------------------
# The plan
# --------------------------------------------------------------------------------------------


@dataclass
class RoleEstimate:
    """One role's memory on one of its GPUs: named parts (bytes) and the GPU it runs on."""

    role: str
    parts: dict[str, int]
    gpu: Gpu | None

    @property
    def total(self) -> int:
        return sum(self.parts.values())


@dataclass
class Plan:
    errors: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    estimates: list[RoleEstimate] = field(default_factory=list)

    def table(self) -> str:
        """The estimates as text: one line per role, its parts, its total against its GPU."""
        lines = []
        for e in self.estimates:
            parts = ", ".join(f"{k} {gib(v)}" for k, v in e.parts.items())
            limit = f" of {e.gpu}" if e.gpu else " (GPU unknown)"
            lines.append(f"  {e.role:<10} {gib(e.total):>10}{limit}: {parts}")
        return "\n".join(lines)


ShapeOf = Callable[[str], "ModelShape | None"]


@dataclass
class _Ctx:
    spec: Any
    gpus: dict[str, Gpu | None]  # role -> GPU of its pool
    shape: ModelShape | None
    plan: Plan

    def gpu_of(self, role: str) -> Gpu | None:
        return self.gpus.get(role)


def shapes_from(folder: Path) -> ShapeOf:
    """`local_shape` of a manifest's model paths resolved against `folder` (`rlhf_api.loader.manifest_dir`,
    the manifest's folder), as the trainer reads them."""
    from rlhf_api.loader import resolve_path

    return lambda path: local_shape(resolve_path(path, folder))


def plan_job(
    spec: Any, *, shape_of: ShapeOf = local_shape, nodes: list[Mapping[str, Any]] | None = None
) -> Plan:
    """The plan of a `JobSpec`. `shape_of(path)` gives a model's shape (default: its local
    config.json, or the hub cache's; None: not available); `nodes`: the cluster's node objects."""
    plan = Plan()
    if not any(getattr(spec.roles, r).resources.gpus for r in _gpu_roles(spec)):
        return plan
    ctx = _Ctx(
        spec, _role_gpus(spec, nodes, plan), _shape(shape_of, spec.model.path, "spec.model.path", plan), plan
    )
    _check_rollout_shapes(ctx)
    in_use = roles_in_use(spec)  # the operator's own rule: no memory planned for pods never made
    _check_training(ctx, "actor")
    if "critic" in in_use:
        _check_training(ctx, "critic")
    if "reference" in in_use and spec.model.lora is None:
        _check_reference(ctx)
    _check_reward(ctx, shape_of)
    _check_engine(ctx)
    return plan


def _gpu_roles(spec: Any) -> list[str]:
    roles = ["actor", "critic", "reference", "reward"]
    return roles + (["rollout"] if spec.roles.placement == "disaggregated" else [])


def _shape(shape_of: ShapeOf, path: str, where: str, plan: Plan) -> ModelShape | None:
    try:
        shape = shape_of(path)
    except (OSError, ValueError) as err:
        plan.notes.append(f"{where}: {err}; memory not checked")
        return None
    if shape is None:
        plan.notes.append(f"{where}: model config of {path} not available locally; memory not checked")
    return shape


def _role_gpus(spec: Any, nodes: list[Mapping[str, Any]] | None, plan: Plan) -> dict[str, Gpu | None]:
    """The GPU of each GPU role's node pool (None: no pool, or a pool whose GPU is unknown)."""
    pools = {p.name: (i, p) for i, p in enumerate(spec.node_pools)}
    out: dict[str, Gpu | None] = {}
    unknown: dict[str, list[str]] = {}
    for role in _gpu_roles(spec):
        role_spec = getattr(spec.roles, role)
        if not role_spec.resources.gpus or not role_spec.replicas:
            continue
        out[role] = None
        if role_spec.node_pool in pools:
            i, pool = pools[role_spec.node_pool]
            out[role] = pool_gpu(pool, f"spec.nodePools[{i}]", nodes)
        if out[role] is None:
            unknown.setdefault(role_spec.node_pool or "", []).append(role)
    for pool_name, roles in unknown.items():
        which = f"node pool {pool_name!r}" if pool_name else "no node pool"
        plan.notes.append(
            f"spec.roles.{'/'.join(roles)}: the GPU of {which} is unknown (set the pool's gpuProduct or "
            "gpuMemory, or give rlhf validate --nodes); memory not checked"
        )
    return out


def _check_rollout_shapes(ctx: _Ctx) -> None:
    """What Ray and vLLM refuse or waste whatever the model: TP against the GPUs a rank sees."""
    spec, r = ctx.spec, ctx.spec.rollout
    if not spec.reward.reward_models() and spec.roles.reward.replicas and spec.roles.reward.resources.gpus:
        ctx.plan.warnings.append(
            f"spec.roles.reward.resources.gpus: {spec.roles.reward.resources.gpus} GPUs per reward pod, but "
            "the job has no reward model (reward functions run on the CPU): all idle; valid: gpus 0"
        )
    tp = r.tensor_parallel_size
    if spec.roles.placement == "colocated":
        if r.engine == "vllm" and tp > 1 and spec.roles.actor.resources.gpus:
            ctx.plan.errors.append(
                f"spec.rollout.tensorParallelSize: {tp} with placement colocated: each actor rank sees one GPU "
                "(one rank per GPU), so its engine cannot span more; valid: 1, or placement disaggregated"
            )
        return
    gpus = spec.roles.rollout.resources.gpus
    if r.engine == "vllm" and gpus > tp:
        ctx.plan.warnings.append(
            f"spec.roles.rollout.resources.gpus: {gpus} GPUs per rollout pod, but one engine at "
            f"tensorParallelSize {tp} uses {tp}: {gpus - tp} idle; valid: gpus {tp}, or tensorParallelSize {gpus}"
        )
    if r.engine == "hf" and gpus > 1:
        ctx.plan.warnings.append(
            f"spec.roles.rollout.resources.gpus: {gpus} GPUs per rollout pod, but the hf engine uses 1: "
            f"{gpus - 1} idle; valid: gpus 1 (more replicas), or engine vllm with tensorParallelSize {gpus}"
        )
    shape = ctx.shape
    if shape is not None and r.engine == "vllm":
        for what, n in (("attention heads", shape.heads), ("key/value heads", shape.kv_heads)):
            if n % tp and tp % n:
                ctx.plan.errors.append(
                    f"spec.rollout.tensorParallelSize: {tp} does not divide the model's {n} {what} "
                    f"({shape.source}); vLLM refuses it; valid: a divisor of {n}"
                )


def _tokens_per_micro_batch(spec: Any) -> int:
    t = spec.training
    seq = spec.data.max_prompt_length + max_response_length(spec)  # a multi-turn episode: every turn
    return t.max_tokens_per_micro_batch or t.micro_batch_size * seq


def training_parts(
    shape: ModelShape,
    *,
    world: int,
    compute: str,
    tokens: int,
    checkpointing: bool,
    head: str = "lm",
    lora: Any = None,
) -> dict[str, int]:
    """Bytes on one rank of a trained role (see the module docstring)."""
    params = shape.params(head)
    trained = shape.lora_params(lora.rank, lora.target_modules) if lora is not None else params
    cb = DTYPE_BYTES[compute]
    parts = {
        "weights": math.ceil(params * MASTER_BYTES / world),
        "grads": math.ceil(trained * MASTER_BYTES / world),
        "optimizer": math.ceil(trained * MASTER_BYTES * ADAM_MOMENTS / world),
    }
    if cb != MASTER_BYTES:
        # FSDP2 gathers a block (and prefetches the next) in c; one rank's autocast caches all of it.
        parts["compute copy"] = params * cb if world == 1 else 2 * shape.block_params() * cb
    out_width = shape.vocab if head == "lm" else 1
    forward = {
        "activations": shape.activation_bytes(tokens, cb, checkpointing),
        "logits": tokens * out_width * (cb + 2 * 4),  # c, then fp32 log-softmax and its gradient
    }
    # AdamW's multi-tensor step allocates temporaries the size of the rank's trained shard, after
    # the backward has freed the activations: the larger of the two is the transient peak.
    step = math.ceil(trained * MASTER_BYTES / world)
    return {**parts, **(forward if sum(forward.values()) >= step else {"step temporaries": step})}


def _check_training(ctx: _Ctx, role: str) -> None:
    spec, shape = ctx.spec, ctx.shape
    role_spec = getattr(spec.roles, role)
    gpu = ctx.gpu_of(role)
    if role == "critic" and spec.model.critic_path:
        shape = None  # another model; its config is not looked up here
    if shape is None or not role_spec.resources.gpus:
        return
    world = role_spec.replicas * role_spec.resources.gpus
    parts = training_parts(
        shape,
        world=world,
        compute=spec.model.dtype,
        tokens=_tokens_per_micro_batch(spec),
        checkpointing=spec.training.activation_checkpointing,
        head="lm" if role == "actor" else "value",
        lora=spec.model.lora if role == "actor" else None,
    )
    parts["runtime"] = RUNTIME_BYTES
    colocated_engine = (
        role == "actor" and spec.roles.placement == "colocated" and spec.rollout.engine == "vllm"
    )
    if colocated_engine and gpu is not None:
        parts["vllm engine"] = int(spec.rollout.gpu_memory_utilization * gpu.memory)
    est = RoleEstimate(role, parts, gpu)
    ctx.plan.estimates.append(est)
    if gpu is None:
        return
    resident = (
        parts["weights"]
        + parts["grads"]
        + parts["optimizer"]
        + parts["runtime"]
        + parts.get("vllm engine", 0)
    )
    where = f"spec.roles.{role}"
    if resident > gpu.memory:
        engine = (
            f" + the colocated vLLM engine's gpuMemoryUtilization {spec.rollout.gpu_memory_utilization} x "
            f"{gib(gpu.memory)} = {gib(parts['vllm engine'])} (vLLM reserves it while the actor's state stays resident)"
            if colocated_engine
            else ""
        )
        ctx.plan.errors.append(
            f"{where}: fp32 weights, gradients and AdamW state need {gib(resident - parts.get('vllm engine', 0))} per GPU "
            f"sharded over {world} GPU(s){engine}: more than the {gib(gpu.memory)} of its {gpu.product or 'GPU'}; "
            "valid: more GPUs (replicas or resources.gpus), LoRA (model.lora), a larger GPU"
            + (", or a smaller gpuMemoryUtilization" if colocated_engine else "")
        )
    elif est.total > gpu.memory:
        ctx.plan.warnings.append(
            f"{where}: about {gib(est.total)} per GPU with activations ({gib(est.total - resident)} for "
            f"{_tokens_per_micro_batch(spec)} tokens per micro-batch), more than the {gib(gpu.memory)} of its "
            f"{gpu.product or 'GPU'}; consider a smaller training.microBatchSize or training.activationCheckpointing"
        )


def _forward_parts(shape: ModelShape, dtype: str, tokens: int, head: str) -> dict[str, int]:
    """Bytes of a no-grad forward of `tokens` tokens: weights in `dtype` and one block's transients."""
    cb = DTYPE_BYTES[dtype]
    return {
        "weights": shape.params(head) * cb,
        "activations": tokens * (FWD_HIDDEN * shape.hidden + FWD_INTERMEDIATE * shape.intermediate) * cb,
        "logits": tokens * (shape.vocab if head == "lm" else 1) * (cb + 4),
        "runtime": RUNTIME_BYTES,
    }


def _check_fits(ctx: _Ctx, role: str, parts: dict[str, int], what: str, valid: str) -> None:
    gpu = ctx.gpu_of(role)
    ctx.plan.estimates.append(RoleEstimate(role, parts, gpu))
    if gpu is not None and sum(parts.values()) > gpu.memory:
        ctx.plan.errors.append(
            f"spec.roles.{role}: {what} needs {gib(sum(parts.values()))} per GPU ({gib(parts['weights'])} of "
            f"weights): more than the {gib(gpu.memory)} of its {gpu.product or 'GPU'}; valid: {valid}"
        )


def _check_reference(ctx: _Ctx) -> None:
    spec = ctx.spec
    if ctx.shape is None or not spec.roles.reference.resources.gpus:
        return
    parts = _forward_parts(ctx.shape, spec.model.dtype, _tokens_per_micro_batch(spec), "lm")
    _check_fits(
        ctx,
        "reference",
        parts,
        f"the reference policy in {spec.model.dtype}",
        "model.dtype bfloat16, or a larger GPU",
    )


def _check_reward(ctx: _Ctx, shape_of: ShapeOf) -> None:
    """Every reward worker holds all the reward models (`reward.model`, or each of
    `reward.models`) and scores with one at a time: their weights add up, the transients of the
    largest forward count once. A model's forward reads at most its `maxLength` tokens per row."""
    from rlhf_api.job import reward_model_dtype

    spec = ctx.spec
    models = spec.reward.reward_models()
    if not models or not spec.roles.reward.resources.gpus:
        return
    field = "reward.model" if spec.reward.model is not None else "reward.models[i]"
    combined: dict[str, int] = {}
    dtypes = []
    for i, (_, m) in enumerate(models):
        where = "spec.reward.model.path" if spec.reward.model is not None else f"spec.reward.models[{i}].path"
        shape = _shape(shape_of, m.path, where, ctx.plan)
        if shape is None:
            return
        dtype = reward_model_dtype(spec, m)
        dtypes.append(dtype)
        length = spec.data.max_prompt_length + max_response_length(spec)
        if m.max_length is not None:
            length = min(length, m.max_length)
        parts = _forward_parts(shape, dtype, m.batch_size * length, "score")
        for key, value in parts.items():
            # weights add up; a forward's transients (and the runtime) are there once, the largest
            combined[key] = (
                combined.get(key, 0) + value if key == "weights" else max(combined.get(key, 0), value)
            )
    valid = f"a smaller {field}.batchSize, or a larger GPU"
    if any(DTYPE_BYTES[d] > 2 for d in dtypes):
        valid = f"{field}.dtype bfloat16, " + valid
    if len(models) == 1:
        what = f"the reward model in {dtypes[0]}"
    else:
        what = f"the sum of its {len(models)} reward models (in {', '.join(dtypes)})"
        valid = "fewer reward models, " + valid
    _check_fits(ctx, "reward", combined, what, valid)


def _check_engine(ctx: _Ctx) -> None:
    """The rollout engine: vLLM's fraction must hold the weights, its profile run and the KV of
    one sequence of maxModelLength; an hf engine its weights and its rows' KV cache."""
    from rlhf_api.job import max_model_length

    spec, shape = ctx.spec, ctx.shape
    colocated = spec.roles.placement == "colocated"
    role = "actor" if colocated else "rollout"
    if shape is None or not getattr(spec.roles, role).resources.gpus:
        return
    gpu = ctx.gpu_of(role)
    r, dtype = spec.rollout, spec.model.dtype
    cb, length = DTYPE_BYTES[dtype], max_model_length(spec)
    if r.engine == "hf":
        if not colocated:
            # A step's rows, spread over the fleet's replicas.
            rows = -(
                -spec.training.prompts_per_step * r.samples_per_prompt // max(1, spec.roles.rollout.replicas)
            )
            parts = _forward_parts(shape, dtype, rows, "lm")
            parts["kv cache"] = rows * length * shape.kv_bytes_per_token(cb)
            _check_fits(
                ctx, "rollout", parts, "the hf engine with the KV cache of a step's rows", "a larger GPU"
            )
        return
    tp = 1 if colocated else r.tensor_parallel_size
    weights = shape.params("lm") * cb // tp
    kv_per_token = shape.kv_bytes_per_token(cb) // min(tp, shape.kv_heads)
    profile = (
        VLLM_PROFILE_TOKENS * (FWD_HIDDEN * shape.hidden + FWD_INTERMEDIATE * shape.intermediate // tp) * cb
    )
    profile += VLLM_PROFILE_SEQS * shape.vocab * 4 + RUNTIME_BYTES
    if not colocated:
        ctx.plan.estimates.append(
            RoleEstimate(
                "rollout", {"weights": weights, "profile": profile, "kv (1 seq)": length * kv_per_token}, gpu
            )
        )
    if gpu is None:
        return
    budget = int(r.gpu_memory_utilization * gpu.memory)
    where = f"spec.rollout (vLLM on spec.roles.{role}'s {gpu})"
    fraction = f"gpuMemoryUtilization {r.gpu_memory_utilization} x {gib(gpu.memory)} = {gib(budget)}"
    if weights + profile > budget:
        ctx.plan.errors.append(
            f"{where}: the weights need {gib(weights)} per GPU at tensorParallelSize {tp} (plus about {gib(profile)} "
            f"for vLLM's profile run), more than {fraction}; valid: a larger gpuMemoryUtilization"
            + ("" if colocated else ", a larger tensorParallelSize")
            + ", or a larger GPU"
        )
        return
    kv_left = budget - weights - profile
    if length * kv_per_token > kv_left:
        fits = kv_left // kv_per_token
        ctx.plan.errors.append(
            f"{where}: maxModelLength {length} needs {gib(length * kv_per_token)} of KV cache per GPU for one "
            f"sequence ({kv_per_token // 1024} KiB per token), but {fraction} leaves {gib(kv_left)} after the "
            f"weights ({gib(weights)}); valid: rollout.maxModelLength <= {fits}, a larger gpuMemoryUtilization"
            + ("" if colocated else " or tensorParallelSize")
        )
