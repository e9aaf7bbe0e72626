"""LoRA on the policy (`spec.model.lora`), through `peft`.

The actor wraps its policy in a `peft` model: every targeted linear layer keeps its frozen base
weight `W` (d_out, d_in) and gains two trained matrices `A` (r, d_in) and `B` (d_out, r), `B`
starting at zero, so the layer computes `x W^T + (alpha / r) · x A^T B^T` (Hu et al. 2021,
arXiv:2106.09685). What the rest of the system sees:

* the optimizer holds only `A` and `B` (`modeling.build_optimizer` takes the parameters that
  require a gradient);
* the reference policy is the same module with its adapters disabled (`reference_mode`): the
  frozen base weights are the initial policy, so no second copy of the model exists anywhere;
* the rollout engines, the colocated engine and the exported model receive *merged* weights under
  the base model's own names (`merge_lora_state`): `W + (alpha / r) · B @ A`, which is what
  `AutoModelForCausalLM.from_pretrained` and the engines expect;
* a checkpoint holds the merged weights (`model.safetensors`, as without LoRA, for `rlhf export`)
  and the adapter alone (`ADAPTER_DIR`, peft format) that resume loads back.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

#: The checkpoint's (and the export's) folder of the adapter alone, in `peft`'s format.
ADAPTER_DIR = "adapter"
#: The adapter name `peft` gives the one adapter the actor trains.
ADAPTER_NAME = "default"
#: The prefix `peft` puts before the wrapped model's parameter names.
PEFT_PREFIX = "base_model.model."

_LORA_PART = re.compile(r"^(?P<module>.+)\.lora_(?P<which>A|B)\.[^.]+\.weight$")
_BASE_PART = re.compile(r"^(?P<module>.+)\.base_layer\.(?P<param>weight|bias)$")


def lora_config(rank: int, alpha: float, dropout: float, target_modules: list[str]) -> Any:
    """The `peft.LoraConfig` of `spec.model.lora` (fields as in `rlhf_api.sections.LoraSpec`)."""
    from peft import LoraConfig

    targets: str | list[str] = "all-linear" if target_modules == ["all-linear"] else list(target_modules)
    return LoraConfig(
        r=rank,
        lora_alpha=alpha,  # type: ignore[arg-type]  # peft annotates int; its scale alpha / r is a float
        lora_dropout=dropout,
        target_modules=targets,
        bias="none",
        task_type="CAUSAL_LM",
    )


def apply_lora(
    model: nn.Module, rank: int, alpha: float, dropout: float, target_modules: list[str]
) -> nn.Module:
    """Wrap a transformers causal LM in a `peft` model: base weights frozen, adapters trained.

    A target list that matches no module fails naming `spec.model.lora.targetModules` and the
    model's linear layers."""
    from peft import get_peft_model

    try:
        wrapped = get_peft_model(model, lora_config(rank, alpha, dropout, target_modules))  # type: ignore[arg-type]
    except ValueError as err:
        linear = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, nn.Linear)})
        raise ValueError(
            f"spec.model.lora.targetModules: {target_modules!r} cannot be applied ({err}); valid: [all-linear] "
            f"or names among this model's linear layers: {', '.join(linear)}"
        ) from err
    return wrapped  # type: ignore[no-any-return]


def is_lora(model: nn.Module) -> bool:
    from peft import PeftModel

    return isinstance(model, PeftModel)


@contextlib.contextmanager
def reference_mode(model: nn.Module) -> Iterator[None]:
    """The base model: the adapters bypassed for the duration (peft's `disable_adapter`)."""
    with model.disable_adapter():  # type: ignore[operator]
        yield


def merge_lora_state(state: dict[str, Tensor], scaling: float) -> dict[str, Tensor]:
    """The merged weights of a `peft`-wrapped model's full state dict, under the base model's names.

    `state` maps peft names to tensors: `base_model.model.<m>.base_layer.weight` W (d_out, d_in),
    `base_model.model.<m>.lora_A.<adapter>.weight` A (r, d_in), `...lora_B.<adapter>.weight`
    B (d_out, r), and every untouched parameter under `base_model.model.<name>`. Returns
    `<m>.weight = W + scaling · B @ A` (d_out, d_in) in W's dtype, `<m>.bias` from the base layer,
    and every other tensor under `<name>`; no `lora_*` key remains. `scaling` is alpha / r.
    Pure: the inputs are not modified."""
    out: dict[str, Tensor] = {}
    pairs: dict[str, dict[str, Tensor]] = {}
    for name, tensor in state.items():
        lora = _LORA_PART.match(name.removeprefix(PEFT_PREFIX))
        if lora:
            pairs.setdefault(lora["module"], {})[lora["which"]] = tensor
            continue
        out[base_name(name) or name] = tensor
    for module, ab in pairs.items():
        key = f"{module}.weight"
        if key not in out or set(ab) != {"A", "B"}:
            raise ValueError(f"LoRA merge: module {module!r} lacks its base weight or one of lora_A/lora_B")
        w = out[key]
        delta = ab["B"].to(torch.float32) @ ab["A"].to(
            torch.float32
        )  # (d_out, r) @ (r, d_in) = (d_out, d_in)
        out[key] = (w.to(torch.float32) + scaling * delta).to(w.dtype)
    return out


def base_name(name: str) -> str | None:
    """The base model's name of a peft parameter name; None for an adapter matrix.
    `base_model.model.<m>.base_layer.weight` -> `<m>.weight`; `base_model.model.<n>` -> `<n>`."""
    name = name.removeprefix(PEFT_PREFIX)
    if _LORA_PART.match(name):
        return None
    base = _BASE_PART.match(name)
    return f"{base['module']}.{base['param']}" if base else name


def base_parameter_names(peft_names: list[str]) -> list[str]:
    """The base model's parameter names, in order, of a peft model's `named_parameters()` names."""
    return [b for b in (base_name(n) for n in peft_names) if b is not None]


def scaling_of(model: nn.Module) -> float:
    """alpha / r of the actor's adapter (one value: `spec.model.lora` configures all layers alike)."""
    config: Any = model.peft_config[ADAPTER_NAME]  # type: ignore[index]
    return float(config.lora_alpha) / float(config.r)


def adapter_state(state: dict[str, Tensor]) -> dict[str, Tensor]:
    """The adapter's tensors of a full peft state dict, named as `peft` saves them
    (`base_model.model.<m>.lora_A.weight`: the adapter name dropped)."""
    return {
        name.replace(f".{ADAPTER_NAME}.", "."): t
        for name, t in state.items()
        if _LORA_PART.match(name.removeprefix(PEFT_PREFIX))
    }


def save_adapter(model: nn.Module, state: dict[str, Tensor], out: Path) -> None:
    """Write the adapter alone in `peft`'s format (`adapter_config.json`, `adapter_model.safetensors`),
    which `PeftModel.from_pretrained(base, out)` loads. `state` is the full (gathered) state dict."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    config: Any = model.peft_config[ADAPTER_NAME]  # type: ignore[index]
    config.save_pretrained(str(out))
    tensors = {k: v.detach().contiguous().clone() for k, v in adapter_state(state).items()}
    save_file(tensors, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})


def load_adapter_state(src: Path) -> dict[str, Tensor]:
    """The adapter tensors `save_adapter` wrote, named as the actor's model names them (full names,
    with the adapter name), for `modeling.load_full_state_dict`'s non-strict load."""
    from safetensors.torch import load_file

    tensors = load_file(str(src / "adapter_model.safetensors"))
    return {
        re.sub(r"\.lora_(A|B)\.weight$", rf".lora_\1.{ADAPTER_NAME}.weight", name): t
        for name, t in tensors.items()
    }
