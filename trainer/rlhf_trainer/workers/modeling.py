"""Models of the training roles and the tensor plumbing around them.

The policy is a transformers causal LM; the critic is the same backbone with a scalar value
head. Both score a `(prompt, response)` batch laid out as in `rollout.RolloutBatch`: the
response token at sequence position `P + t` is predicted from position `P + t - 1`, so the
per-response-token quantities are read from positions `P - 1 .. P + T - 2`.
"""

from __future__ import annotations

import contextlib
import math
import typing
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


def load_policy(path: str, dtype: str = "float32") -> nn.Module:
    from transformers import AutoModelForCausalLM

    check_model_dir(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=DTYPES[dtype])
    disable_dropout(model)
    return model


class ValueModel(nn.Module):
    """A transformers backbone with a linear value head: `(B, L)` values, one per position."""

    def __init__(self, path: str, dtype: str = "float32"):
        super().__init__()
        from transformers import AutoModel

        check_model_dir(path, "spec.model.criticPath")
        self.backbone = AutoModel.from_pretrained(path, dtype=DTYPES[dtype])
        disable_dropout(self.backbone)
        hidden = self.backbone.config.hidden_size
        self.value_head = nn.Linear(hidden, 1, dtype=DTYPES[dtype])
        nn.init.zeros_(self.value_head.weight)  # start at V = 0: a neutral baseline
        nn.init.zeros_(self.value_head.bias)
        self._no_split_modules = getattr(self.backbone, "_no_split_modules", None) or []

    def forward(self, input_ids: Tensor, attention_mask: Tensor, position_ids: Tensor) -> Tensor:
        out = self.backbone(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids)
        return self.value_head(out.last_hidden_state).squeeze(-1)  # (B, L)


def sequence_inputs(batch: dict[str, Tensor]) -> tuple[Tensor, Tensor, Tensor, int]:
    """`(input_ids, attention_mask, position_ids, P)` for prompt + response, all (B, P+T)."""
    prompt_ids, prompt_mask = batch["prompt_ids"], batch["prompt_mask"].long()
    response_ids, response_mask = batch["response_ids"], (batch["response_mask"] > 0).long()
    input_ids = torch.cat([prompt_ids, response_ids], dim=1)  # (B, P+T)
    attention_mask = torch.cat([prompt_mask, response_mask], dim=1)  # (B, P+T)
    # Positions count from each row's first real token, as the rollout engine does.
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)  # (B, P+T)
    return input_ids, attention_mask, position_ids, prompt_ids.shape[1]


def token_log_probs(
    model: nn.Module, batch: dict[str, Tensor], temperature: float = 1.0, with_entropy: bool = False
) -> tuple[Tensor, Tensor | None]:
    """Log-prob of every response token under `model`, and optionally the entropy, both (B, T).

    Logits are divided by the sampling temperature so the trained distribution is the sampled one.
    Only the positions that predict response tokens reach the LM head (`response_logits`), the
    log-prob is `z_y - logsumexp(z)` (no (B, T, V) log-softmax kept for backward), and the
    entropy, when asked for, is the chunked `algorithms.entropy_from_logits`.
    """
    from rlhf_trainer.algorithms.entropy import entropy_from_logits

    logits = response_logits(model, batch)  # (B, T, V) fp32
    if temperature > 0:
        logits = logits / temperature
    picked = logits.gather(-1, batch["response_ids"][..., None]).squeeze(-1)  # (B, T)
    logp = picked - torch.logsumexp(logits, dim=-1)  # (B, T)
    entropy = entropy_from_logits(logits) if with_entropy else None  # (B, T)
    return logp, entropy


def response_logits(model: nn.Module, batch: dict[str, Tensor]) -> Tensor:
    """The fp32 logits of the positions `P - 1 .. P + T - 2`, (B, T, V): the ones that predict the
    response tokens. The LM head runs on those T positions alone where the model's forward takes
    `logits_to_keep` (the last T + 1 positions: the prompt is left-padded, so the response ends
    every row), instead of on all P + T."""
    input_ids, attention_mask, position_ids, p = sequence_inputs(batch)
    t = batch["response_ids"].shape[1]
    keep = _logits_to_keep_kwarg(model)
    kwargs = {keep: t + 1} if keep else {}
    logits = model(
        input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, **kwargs
    ).logits
    if logits.shape[1] == t + 1:  # (B, T+1, V): positions P-1 .. P+T-1
        return logits[:, :t, :].float()  # (B, T, V)
    return logits[:, p - 1 : p + t - 1, :].float()  # (B, T, V): position P+t-1 predicts token t


def _logits_to_keep_kwarg(model: nn.Module) -> str | None:
    """The forward's keyword for computing only the last N positions' logits, if it has one
    (`logits_to_keep` in transformers 5, `num_logits_to_keep` before)."""
    import inspect

    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return None
    return next((k for k in ("logits_to_keep", "num_logits_to_keep") if k in params), None)


def token_values(model: nn.Module, batch: dict[str, Tensor]) -> Tensor:
    """Critic value of the state before each response token, (B, T)."""
    input_ids, attention_mask, position_ids, p = sequence_inputs(batch)
    t = batch["response_ids"].shape[1]
    values = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids)
    return values[:, p - 1 : p + t - 1].float()  # (B, T)


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


def set_gradient_sync(model: nn.Module, sync: bool) -> None:
    """FSDP2: reduce-scatter gradients in this backward (`sync`) or only accumulate them locally
    (the micro-batches before the last one of an optimizer step). A no-op unsharded."""
    if _is_fsdp(model):
        model.set_requires_gradient_sync(sync)  # type: ignore[operator]


def build_optimizer(model: nn.Module, lr: float, weight_decay: float) -> torch.optim.Optimizer:
    params = [p for p in model.parameters() if p.requires_grad]
    return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)


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


def load_full_state_dict(model: nn.Module, state: dict[str, Tensor], strict: bool = True) -> None:
    """Load an unsharded state dict given on every rank (a collective under FSDP). `strict=False`:
    a subset of the parameters (LoRA's adapters), the others keep their values."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    set_model_state_dict(model, dict(state), options=StateDictOptions(full_state_dict=True, strict=strict))  # type: ignore[arg-type]


def full_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    return get_optimizer_state_dict(
        model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )


def load_full_optimizer_state(
    model: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]
) -> None:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    set_optimizer_state_dict(model, optimizer, state, options=StateDictOptions(full_state_dict=True))


def to_float(x: Any) -> float:
    """A Python float from a tensor, a DTensor (e.g. FSDP2's grad norm) or a number."""
    if hasattr(x, "full_tensor"):
        x = x.full_tensor()
    if isinstance(x, Tensor):
        return float(x.detach().float().item())
    return float(x)
