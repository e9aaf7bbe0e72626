"""Models of the training roles and the tensor plumbing around them.

The policy is a transformers causal LM; the critic is the same backbone with a scalar value
head. Both score a `(prompt, response)` batch laid out as in `rollout.RolloutBatch`: the
response token at sequence position `P + t` is predicted from position `P + t - 1`, so the
per-response-token quantities are read from positions `P - 1 .. P + T - 2`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def check_model_dir(path: str, what: str = "spec.model.path") -> None:
    """A clear error for a missing model directory (instead of a hub lookup failing offline)."""
    p = Path(path)
    if not p.is_dir() or not (p / "config.json").is_file():
        raise FileNotFoundError(
            f"{what}: {path!r} is not a model directory (no config.json there); give a local directory "
            "saved by `save_pretrained`, or set spec.model.bootstrap to create a tiny one"
        )


def disable_dropout(model: nn.Module) -> None:
    """RL updates assume the scoring forward equals the sampling forward: no dropout noise."""
    for m in model.modules():
        if isinstance(m, nn.Dropout):
            m.p = 0.0


def load_policy(path: str, dtype: str = "float32", meta: bool = False) -> nn.Module:
    """The policy of `path`. `meta`: its skeleton on the meta device (names, shapes, ties and no
    memory for the weights), which an FSDP2 rank other than 0 shards before rank 0 broadcasts
    the weights into it (`shard_from_rank0`)."""
    from transformers import AutoModelForCausalLM

    check_model_dir(path)
    if meta:
        model = _on_meta(lambda config: AutoModelForCausalLM.from_config(config, dtype=DTYPES[dtype]), path)
    else:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=DTYPES[dtype])
    disable_dropout(model)
    return model


def _on_meta(build: Any, path: str) -> nn.Module:
    """`build(config)` of `path`'s config on the meta device."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path)
    with torch.device("meta"):
        return build(config)  # type: ignore[no-any-return]


class ValueModel(nn.Module):
    """A transformers backbone with a linear value head: `(B, L)` values, one per position."""

    def __init__(self, path: str, dtype: str = "float32", meta: bool = False):
        super().__init__()
        from transformers import AutoModel

        check_model_dir(path, "spec.model.criticPath")
        backbone: Any = (  # meta: the skeleton of a rank that gets its weights by broadcast
            _on_meta(lambda config: AutoModel.from_config(config, dtype=DTYPES[dtype]), path)
            if meta
            else AutoModel.from_pretrained(path, dtype=DTYPES[dtype])
        )
        self.backbone = backbone
        disable_dropout(self.backbone)
        hidden = backbone.config.hidden_size
        device = torch.device("meta") if meta else None
        self.value_head = nn.Linear(hidden, 1, dtype=DTYPES[dtype], device=device)
        nn.init.zeros_(self.value_head.weight)  # start at V = 0: a neutral baseline
        nn.init.zeros_(self.value_head.bias)
        self._no_split_modules = getattr(self.backbone, "_no_split_modules", None) or []

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None, position_ids: Tensor) -> Tensor:
        out = self.backbone(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False
        )
        return self.value_head(out.last_hidden_state).squeeze(-1)  # (B, L)


def sequence_inputs(batch: dict[str, Tensor]) -> tuple[Tensor, Tensor, Tensor, int]:
    """`(input_ids, attention_mask, position_ids, P)` for prompt + response, all (B, P+T)."""
    prompt_ids, prompt_mask = batch["prompt_ids"], batch["prompt_mask"].long()
    # Multi-turn: the environment's tokens are attended to, though not trained on.
    response_ids, response_mask = batch["response_ids"], response_tokens(batch).long()
    input_ids = torch.cat([prompt_ids, response_ids], dim=1)  # (B, P+T)
    attention_mask = torch.cat([prompt_mask, response_mask], dim=1)  # (B, P+T)
    # Positions count from each row's first real token, as the rollout engine does.
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)  # (B, P+T)
    return input_ids, attention_mask, position_ids, prompt_ids.shape[1]


def response_tokens(batch: dict[str, Tensor]) -> Tensor:
    """(B, T) bool: the response's real tokens, the model's and (multi-turn) the environment's
    (`rollout.batch.real_response_mask`)."""
    from rlhf_trainer.rollout.batch import real_response_mask

    return real_response_mask(batch["response_mask"], batch.get("observation_mask"))


def token_log_probs(
    model: nn.Module,
    batch: dict[str, Tensor],
    temperature: float = 1.0,
    with_entropy: bool = False,
    layout: str = "padded",
) -> tuple[Tensor, Tensor | None]:
    """Log-prob of every response token under `model`, and optionally the entropy, both (B, T).

    Logits are divided by the sampling temperature so the trained distribution is the sampled one.
    Only the positions that predict response tokens reach the LM head (`response_logits`), the
    log-prob is `z_y - logsumexp(z)` (no (B, T, V) log-softmax kept for backward), and the
    entropy, when asked for, is the chunked `algorithms.entropy_from_logits`.

    `layout` (see `forward_layout`): `padded` runs the (B, P+T) batch as given; `trimmed` cuts
    the columns that are padding in every row first; `packed` runs the rows' real tokens as one
    row (`pack_sequences`) and scores the valid response tokens only. Either way the results are
    (B, T), the same at every valid response position; past them, 0 with `packed`, and with
    `trimmed` past the longest response of the batch.
    """
    from rlhf_trainer.algorithms.entropy import entropy_from_logits

    packed = pack_sequences(batch) if layout == "packed" and packable(batch) else None
    width = batch["response_ids"].shape[1]
    if packed is not None:
        logits = packed_response_logits(model, packed)  # (n, V) fp32
        targets = batch["response_ids"][packed.rows, packed.cols]  # (n,)
    else:
        view = trim_padding(batch)[0] if layout != "padded" else batch
        logits = response_logits(model, view)  # (B, T', V) fp32
        targets = view["response_ids"]  # (B, T')
    if temperature > 0:
        logits = logits / temperature
    picked = logits.gather(-1, targets[..., None]).squeeze(-1)  # (n,) or (B, T')
    logp = picked - torch.logsumexp(logits, dim=-1)  # (n,) or (B, T')
    entropy = entropy_from_logits(logits) if with_entropy else None  # (n,) or (B, T')
    if packed is not None:
        return _unpack(logp, packed, batch), (None if entropy is None else _unpack(entropy, packed, batch))
    return _pad_to(logp, width), (None if entropy is None else _pad_to(entropy, width))  # (B, T)


def response_logits(model: nn.Module, batch: dict[str, Tensor]) -> Tensor:
    """The fp32 logits of the positions `P - 1 .. P + T - 2`, (B, T, V): the ones that predict the
    response tokens. The LM head runs on those T positions alone where the model's forward takes
    `logits_to_keep` (the last T + 1 positions: the prompt is left-padded, so the response ends
    every row), instead of on all P + T."""
    input_ids, attention_mask, position_ids, p = sequence_inputs(batch)
    t = batch["response_ids"].shape[1]
    keep = _logits_to_keep_kwarg(model)
    kwargs = {keep: t + 1} if keep else {}
    # use_cache=False: a KV cache would grow again in activation checkpointing's recompute.
    logits = model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        use_cache=False,
        **kwargs,
    ).logits
    if logits.shape[1] == t + 1:  # (B, T+1, V): positions P-1 .. P+T-1
        return _fp32(logits[:, :t, :])  # (B, T, V)
    return _fp32(logits[:, p - 1 : p + t - 1, :])  # (B, T, V): position P+t-1 predicts token t


def _fp32(x: Tensor) -> Tensor:
    """At least fp32 (bf16/fp16 logits and values are upcast; fp64 stays fp64)."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def _logits_to_keep_kwarg(model: nn.Module) -> str | None:
    """The forward's keyword for computing only the last N positions' logits, if it has one
    (`logits_to_keep` in transformers 5, `num_logits_to_keep` before)."""
    import inspect

    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return None
    return next((k for k in ("logits_to_keep", "num_logits_to_keep") if k in params), None)


def token_values(model: nn.Module, batch: dict[str, Tensor], layout: str = "padded") -> Tensor:
    """Critic value of the state before each response token, (B, T). `layout`: as in
    `token_log_probs`."""
    if layout == "packed" and packable(batch):
        packed = pack_sequences(batch)
        # (1, L); no attention mask: the model masks the packed sequences from their position ids
        values = model(input_ids=packed.input_ids, attention_mask=None, position_ids=packed.position_ids)
        return _unpack(_fp32(values[0, packed.source]), packed, batch)  # (B, T)
    view, width = trim_padding(batch) if layout != "padded" else (batch, batch["response_ids"].shape[1])
    input_ids, attention_mask, position_ids, p = sequence_inputs(view)
    t = view["response_ids"].shape[1]
    values = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids)
    return _pad_to(_fp32(values[:, p - 1 : p + t - 1]), width)  # (B, T)


# -- padding removal (`spec.training.maxTokensPerMicroBatch`) ------------------------------------
#
# A micro-batch's rows run in one of three layouts (`forward_layout` picks one per model):
#   padded   the (B, P+T) tensors as the rollout laid them out (P and T: the whole batch's longest)
#   trimmed  the same, without the columns that are padding in every row of the micro-batch
#   packed   every row's real tokens one after the other in a single (1, L) row, L = the real
#            tokens of the micro-batch, with position ids restarting at 0 for each sequence and no
#            attention mask: transformers then masks attention block-diagonally (its packed-sequence
#            detection from position ids: sdpa and eager build the block mask, flash-attention runs
#            varlen). Each sequence sees exactly what it sees padded: the same tokens, positions
#            and causal context, so the results are the padded ones (to float rounding).


@dataclasses.dataclass(frozen=True)
class PackedRows:
    """A batch's real tokens packed into one row, and where its valid response tokens are."""

    input_ids: Tensor
    """(1, L) the rows' real tokens (prompt, then response), row after row."""
    position_ids: Tensor
    """(1, L) each token's position in its own sequence (0 at each sequence's first token)."""
    source: Tensor
    """(n,) the packed position predicting each valid response token (the token just before it)."""
    rows: Tensor
    """(n,) the batch row of each valid response token."""
    cols: Tensor
    """(n,) its response column."""


def packable(batch: dict[str, Tensor]) -> bool:
    """Whether packing reproduces the padded forward: every valid response token's predecessor is
    a real token of its row (a left-padded prompt of at least one token, a response mask without
    holes). The rollout's batches are; a batch with holes runs trimmed instead."""
    real = torch.cat([batch["prompt_mask"].gt(0), response_tokens(batch)], dim=1)  # (B, P+T)
    p, t = batch["prompt_mask"].shape[1], batch["response_mask"].shape[1]
    if p == 0:
        return False
    before = real[:, p - 1 : p + t - 1]  # (B, T): is the predecessor of response column t real?
    return bool((before | ~batch["response_mask"].gt(0)).all())


def pack_sequences(batch: dict[str, Tensor]) -> PackedRows:
    """The batch's real tokens as one packed row (see `PackedRows`)."""
    prompt = batch["prompt_mask"].gt(0)  # (B, P)
    response = batch["response_mask"].gt(0)  # (B, T): the tokens scored (the model's)
    p = prompt.shape[1]
    real = torch.cat([prompt, response_tokens(batch)], dim=1)  # (B, P+T): environment tokens too
    ids = torch.cat([batch["prompt_ids"], batch["response_ids"]], dim=1)  # (B, P+T)
    positions = real.long().cumsum(-1) - 1  # (B, P+T): as `sequence_inputs` numbers real tokens
    index = real.flatten().long().cumsum(0).view_as(real) - 1  # (B, P+T): packed index of each real token
    rows, cols = response.nonzero(as_tuple=True)  # (n,) each, row-major
    return PackedRows(
        input_ids=ids[real][None],  # (1, L)
        position_ids=positions[real][None],  # (1, L)
        source=index[rows, p + cols] - 1,  # (n,)
        rows=rows,
        cols=cols,
    )


def packed_response_logits(model: nn.Module, packed: PackedRows) -> Tensor:
    """The fp32 logits of the packed positions that predict the valid response tokens, (n, V); the LM
    head runs on those positions alone where the forward takes `logits_to_keep` as indices."""
    # Only transformers' `logits_to_keep` takes indices; the older `num_logits_to_keep` is an int
    # (the last N positions: `hidden[:, -N:]`), which a tensor of indices would misuse.
    keep = _logits_to_keep_kwarg(model)
    keep = keep if keep == "logits_to_keep" else None
    kwargs: dict[str, Any] = {keep: packed.source} if keep else {}
    logits = model(
        input_ids=packed.input_ids,
        attention_mask=None,
        position_ids=packed.position_ids,
        use_cache=False,
        **kwargs,
    ).logits  # (1, n, V) or (1, L, V)
    if keep:
        return _fp32(logits[0])  # (n, V)
    return _fp32(logits[0, packed.source])  # (n, V)


def _unpack(values: Tensor, packed: PackedRows, batch: dict[str, Tensor]) -> Tensor:
    """(n,) per valid response token -> (B, T), 0 elsewhere (differentiable)."""
    b, t = batch["response_mask"].shape
    return values.new_zeros(b, t).index_put((packed.rows, packed.cols), values)


def trim_padding(batch: dict[str, Tensor]) -> tuple[dict[str, Tensor], int]:
    """The batch without its all-padding columns: leading prompt columns and trailing response
    columns that are padding in every row; and the original response width T."""
    prompt = batch["prompt_mask"].gt(0).any(0)  # (P,)
    response = response_tokens(batch).any(0)  # (T,)
    t = response.shape[0]
    first = int(prompt.long().argmax()) if bool(prompt.any()) else prompt.shape[0] - 1
    first = min(first, max(prompt.shape[0] - 1, 0))  # keep at least one prompt column
    last = int(response.nonzero().max()) + 1 if bool(response.any()) else 1
    view = dict(batch)
    for key in ("prompt_ids", "prompt_mask"):
        view[key] = batch[key][:, first:]
    for key in ("response_ids", "response_mask", "observation_mask"):
        if key in batch:
            view[key] = batch[key][:, :last]
    return view, t


def _pad_to(values: Tensor, width: int) -> Tensor:
    """(B, T') -> (B, width): zeros after column T'."""
    if values.shape[1] == width:
        return values
    return torch.nn.functional.pad(values, (0, width - values.shape[1]))


def forward_layout(model: nn.Module, device: torch.device) -> str:
    """`packed` where `model` masks packed sequences from their position ids alone, else `trimmed`.

    A probe, run once (a collective under FSDP: every rank runs it): two sequences packed in one
    row, then again with the first sequence's tokens changed. With block-diagonal attention the
    second sequence's outputs do not move at all; with plain causal attention they do."""
    vocab = next(m.num_embeddings for m in model.modules() if isinstance(m, nn.Embedding))
    g = torch.Generator().manual_seed(0)
    first = torch.randint(0, vocab, (2, 6), generator=g)  # two versions of the first sequence
    second = torch.randint(0, vocab, (5,), generator=g)
    positions = torch.cat([torch.arange(6), torch.arange(5)])[None].to(device)  # (1, 11)
    was_training = model.training
    model.eval()
    outs: list[Tensor] = []
    # The critic's head starts at zero (all values 0): watch its backbone's hidden states instead,
    # through a hook (under FSDP2 only the root module's forward gathers the root's parameters).
    hidden: list[Tensor] = []
    hook = (
        model.backbone.register_forward_hook(lambda m, a, out: hidden.append(out.last_hidden_state))
        if isinstance(model, ValueModel)
        else None
    )
    try:
        with torch.no_grad():
            for version in first:
                ids = torch.cat([version, second])[None].to(device)  # (1, 11)
                kwargs = {} if isinstance(model, ValueModel) else {"use_cache": False}
                out = model(input_ids=ids, attention_mask=None, position_ids=positions, **kwargs)
                out = hidden.pop() if hook is not None else out.logits
                outs.append(out.float()[0])  # (11, H) or (11, V)
    finally:
        if hook is not None:
            hook.remove()
        model.train(was_training)
    moved_first = float((outs[0][:6] - outs[1][:6]).abs().max())
    moved_second = float((outs[0][6:] - outs[1][6:]).abs().max())
    return "packed" if moved_first > 0 and moved_second <= 1e-3 * moved_first else "trimmed"


#: Dtype of the trained roles' weights, gradients and optimizer state, whatever `spec.model.dtype`
#: says: that dtype is the *compute* dtype. Pure-bf16 AdamW rounds RL-sized updates away (a bf16
#: weight near 1 moves only in steps of 2^-8, far above lr 1e-6 × a unit Adam step).
MASTER_DTYPE = torch.float32


def compute_dtype(dtype: str) -> torch.dtype:
    """The dtype forward and backward run in for `spec.model.dtype`."""
    return DTYPES[dtype]


def mixed_precision(
    model: nn.Module, dtype: str, device: torch.device
) -> contextlib.AbstractContextManager[Any]:
    """The compute context of an unsharded trained model (one rank; FSDP2 ranks cast through their
    `MixedPrecisionPolicy` instead): autocast to `dtype` over fp32 master weights, so matmuls run
    in bf16 while the weights, their gradients and AdamW's moments stay fp32. float32: nothing."""
    compute = compute_dtype(dtype)
    if compute == MASTER_DTYPE or _is_fsdp(model):
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=compute)


def _is_fsdp(model: nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def enable_activation_checkpointing(model: nn.Module) -> None:
    """Recompute each transformer block's activations in the backward pass instead of keeping them:
    the block's `forward` runs under `torch.utils.checkpoint.checkpoint(use_reentrant=False)`
    (PyTorch's documented non-reentrant checkpoint, which composes with FSDP2: the block's
    parameters are gathered again for the recompute). The module tree and the parameter names
    are unchanged, so checkpoints and weight sync see the same names. Called before sharding."""
    from torch.utils.checkpoint import checkpoint

    names = set(getattr(model, "_no_split_modules", None) or [])
    blocks = [m for m in model.modules() if type(m).__name__ in names]
    if not blocks:
        raise ValueError(
            f"spec.training.activationCheckpointing: {type(model).__name__} names no transformer blocks "
            "(`_no_split_modules`) to checkpoint; set it to false"
        )
    for block in blocks:

        def checkpointed(*args: Any, _forward: Any = block.forward, **kwargs: Any) -> Any:
            if not torch.is_grad_enabled():  # scoring and generation keep nothing for backward
                return _forward(*args, **kwargs)
            return checkpoint(_forward, *args, use_reentrant=False, **kwargs)

        block.forward = checkpointed  # type: ignore[method-assign]


def shard_model(model: nn.Module, dtype: str = "float32") -> nn.Module:
    """FSDP2: shard each transformer block, then the root (embeddings, head, tied weights).

    The sharded parameters stay fp32 (the master weights the optimizer updates); with a bf16
    `dtype` FSDP2's `MixedPrecisionPolicy` all-gathers them in bf16 for forward and backward and
    reduce-scatters the gradients in fp32, as PyTorch documents for mixed-precision training."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    compute = compute_dtype(dtype)
    policy = MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=MASTER_DTYPE)
    block_names = set(getattr(model, "_no_split_modules", None) or [])
    for module in model.modules():
        if type(module).__name__ in block_names:
            fully_shard(module, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    return model


def shard_from_rank0(model: nn.Module, dtype: str, rank: int) -> nn.Module:
    """FSDP2-shard a model whose weights only rank 0 holds (on the CPU); every other rank holds
    the meta skeleton (`load_policy(meta=True)`). A collective.

    Rank 0 keeps its state dict on the CPU and turns its module into the same skeleton; every
    rank shards the skeleton (`shard_model`); then `set_model_state_dict(full_state_dict=True,
    broadcast_from_rank0=True)` (PyTorch's documented way, after `to_empty` gave each rank memory
    for its shards alone) broadcasts each tensor from rank 0 and each rank keeps its shard. The non-persistent buffers (rotary frequencies),
    which no state dict holds, are broadcast the same way. So no rank but 0 ever holds the full
    fp32 model, and rank 0 holds it once, on the CPU (not a second copy on its GPU)."""
    import torch.distributed as dist

    from rlhf_trainer.workers.distributed import group_device

    full = {k: v.detach() for k, v in model.state_dict().items()} if rank == 0 else {}
    buffers = {n: b.detach() for n, b in _non_persistent_buffers(model)} if rank == 0 else {}
    if rank == 0:
        _to_meta(model)
    model = shard_model(model, dtype)
    # Memory for this rank's shards only; the parameter objects stay (tied weights stay tied).
    model.to_empty(device=group_device())
    load_full_state_dict(model, full, broadcast_from_rank0=True)
    for name, buffer in _non_persistent_buffers(model):
        if rank == 0:
            buffer.copy_(buffers[name])
        dist.broadcast(buffer, src=0)
    del full, buffers
    return model


def _to_meta(model: nn.Module) -> None:
    """`model.to("meta")`, keeping shared (tied) parameters shared: `.to` across devices gives
    each module its own new parameter."""
    places: dict[int, list[tuple[nn.Module, str]]] = {}
    for module in model.modules():
        for name, param in module._parameters.items():
            if param is not None:
                places.setdefault(id(param), []).append((module, name))
    model.to("meta")
    for (module, name), *others in places.values():
        for other, other_name in others:
            other._parameters[other_name] = module._parameters[name]


def _non_persistent_buffers(model: nn.Module) -> list[tuple[str, Tensor]]:
    """`(name, buffer)` of the buffers no state dict holds (recomputed at build time)."""
    out = []
    for owner, module in model.named_modules():
        for leaf, buffer in module.named_buffers(recurse=False):
            if leaf in module._non_persistent_buffers_set and buffer is not None:
                out.append((f"{owner}.{leaf}" if owner else leaf, buffer))
    return out


def set_gradient_sync(model: nn.Module, sync: bool) -> None:
    """FSDP2: reduce-scatter gradients in this backward (`sync`) or only accumulate them locally
    (the micro-batches before the last one of an optimizer step). A no-op unsharded."""
    if _is_fsdp(model):
        model.set_requires_gradient_sync(sync)  # type: ignore[operator]


#: Parameter dtypes torch's fused AdamW kernel takes (the `fused` argument's documentation).
FUSED_ADAMW_DTYPES = (torch.float64, torch.float32, torch.float16, torch.bfloat16)


def why_not_fused_adamw(params: Sequence[Tensor]) -> str | None:
    """None when torch's fused AdamW kernel takes every one of `params`; else the reason. torch
    checks this only at the first `step()`, too late to fall back, so the check is made here."""
    try:
        from torch.utils._foreach_utils import _get_fused_kernels_supported_devices
    except ImportError:
        return f"torch {torch.__version__} does not list the devices of its fused optimizers"
    devices = set(_get_fused_kernels_supported_devices())
    for p in params:
        # A DTensor (FSDP2's shard) reports its local tensor's device.
        if p.device.type not in devices:
            return f"a parameter is on {p.device.type}; torch {torch.__version__} fuses on {sorted(devices)}"
        if p.dtype not in FUSED_ADAMW_DTYPES:
            return f"a parameter is {p.dtype}"
    return None


def build_optimizer(model: nn.Module, lr: float, weight_decay: float) -> torch.optim.Optimizer:
    """AdamW over the trainable parameters, with torch's fused kernel (the whole update in one
    pass over each tensor, on CPU and CUDA) where it takes every parameter; else torch's default
    (a loop over the parameters on CPU, `foreach` on CUDA), with a log line saying why. The two
    compute the same update to float rounding (tests/trainer/components/test_optimizer.py)."""
    params = [p for p in model.parameters() if p.requires_grad]
    why = why_not_fused_adamw(params)
    if why:
        logging.getLogger(__name__).info("AdamW: torch's default implementation, not the fused one: %s", why)
    return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, fused=True if why is None else None)


def build_scheduler(
    optimizer: torch.optim.Optimizer, schedule: str, warmup_steps: int, total_steps: int
) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warm-up, then constant, linear decay to 0, or cosine decay to 0 over `total_steps`."""
    total = max(total_steps, 1)

    def factor(step: int) -> float:
        if warmup_steps and step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = min(1.0, (step - warmup_steps) / max(1, total - warmup_steps))
        if schedule == "linear":
            return 1.0 - progress
        if schedule == "cosine":
            return 0.5 * (1.0 + math.cos(math.pi * progress))
        return 1.0

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def full_state_dict(model: nn.Module) -> dict[str, Tensor]:
    """The unsharded state dict on CPU (a collective under FSDP: every rank calls it; rank 0 gets it)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return typing.cast(dict[str, Tensor], state)


def load_full_state_dict(
    model: nn.Module, state: dict[str, Tensor], strict: bool = True, broadcast_from_rank0: bool = False
) -> None:
    """Load an unsharded state dict given on every rank (a collective under FSDP). `strict=False`:
    a subset of the parameters (LoRA's adapters), the others keep their values.
    `broadcast_from_rank0`: only rank 0 gives it (the others `{}`), each tensor is broadcast."""
    from torch.distributed.checkpoint import state_dict as dsd

    options = dsd.StateDictOptions(
        full_state_dict=True, strict=strict, broadcast_from_rank0=broadcast_from_rank0
    )
    dsd.set_model_state_dict(model, dict(state), options=options)  # type: ignore[arg-type]


def full_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    return get_optimizer_state_dict(
        model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )


def load_full_optimizer_state(
    model: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]
) -> None:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    implementation = [(g["fused"], g["foreach"]) for g in optimizer.param_groups]
    set_optimizer_state_dict(model, optimizer, state, options=StateDictOptions(full_state_dict=True))
    keep_implementation(optimizer, implementation)


def keep_implementation(optimizer: torch.optim.Optimizer, implementation: list[tuple[Any, Any]]) -> None:
    """Loading a state dict replaces each group's `fused`/`foreach` with the saved ones: a
    checkpoint written by the loop implementation (or on a machine that fused) would choose the
    implementation here. Put back `build_optimizer`'s choice; the fused kernel wants each step
    counter as a float32 tensor on its parameter's device."""
    for group, (fused, foreach) in zip(optimizer.param_groups, implementation):
        group["fused"], group["foreach"] = fused, foreach
        for p in group["params"] if fused else ():
            state = optimizer.state.get(p, {})
            if torch.is_tensor(state.get("step")):
                state["step"] = state["step"].to(dtype=torch.float32, device=p.device)


def to_float(x: Any) -> float:
    """A Python float from a tensor, a DTensor (e.g. FSDP2's grad norm) or a number."""
    if hasattr(x, "full_tensor"):
        x = x.full_tensor()
    if isinstance(x, Tensor):
        return float(x.detach().float().item())
    return float(x)


# -- sharded checkpoints (`torch.distributed.checkpoint`: each rank writes and reads its shards) --

#: The state a sharded checkpoint holds: `{MODEL_KEY: model state, OPTIMIZER_KEY: AdamW state}`;
#: DCP flattens it to `model.<param name>` and `optimizer.state.<param name>.<exp_avg|...>`.
MODEL_KEY = "model"
OPTIMIZER_KEY = "optimizer"


def save_sharded(model: nn.Module, optimizer: torch.optim.Optimizer, directory: Path) -> Any:
    """Write the model and optimizer state as a DCP checkpoint in `directory` (a collective:
    each rank writes the shards it holds, rank 0 the `.metadata` after all ranks wrote).
    Returns DCP's `Metadata` (every rank)."""
    from torch.distributed import checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optim_state = get_state_dict(model, optimizer)  # sharded: DTensors under FSDP2
    return dcp.save({MODEL_KEY: model_state, OPTIMIZER_KEY: optim_state}, checkpoint_id=str(directory))


def checkpoint_reader(directory: Path) -> Any:
    """The storage reader of a DCP checkpoint (a seam: tests count the bytes each rank reads)."""
    from torch.distributed.checkpoint import FileSystemReader

    return FileSystemReader(str(directory))


def load_sharded(model: nn.Module, optimizer: torch.optim.Optimizer, directory: Path) -> None:
    """Restore what `save_sharded` wrote, whatever the world size it was written with (a
    collective): each rank asks DCP for the state it holds (its FSDP2 shards, or everything on a
    single unsharded rank) and reads only those bytes, then `set_state_dict` puts it in place."""
    from torch.distributed import checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_state, optim_state = get_state_dict(model, optimizer)
    # DCP loads in place: into the tensors of these two dicts
    dcp.load(
        {MODEL_KEY: model_state, OPTIMIZER_KEY: optim_state}, storage_reader=checkpoint_reader(directory)
    )
    set_state_dict(model, optimizer, model_state_dict=model_state, optim_state_dict=optim_state)
