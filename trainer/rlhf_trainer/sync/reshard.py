"""Resharding plans: which slice of each full (training-layout) tensor a tensor-parallel rank of a
rollout engine holds.

Training holds each parameter whole (one process) or FSDP2-sharded on dim 0 across the actor
ranks; either way the sync source materializes the full tensor (`buckets.materialize`). An
inference engine with tensor parallelism `T` holds, on rank `r`, one slice of it. The default
rules follow Megatron/vLLM for Llama/Qwen2-style Hugging Face names:

| parameters                                  | kind       | split            |
|---------------------------------------------|------------|------------------|
| `q_proj`, `k_proj`, `v_proj`, `gate_proj`, `up_proj` (weight and bias) | column | dim 0 |
| `o_proj.weight`, `down_proj.weight`          | row        | dim 1            |
| `o_proj.bias`, `down_proj.bias`              | replicated | (added after the all-reduce) |
| `embed_tokens.weight`, `lm_head.weight`      | vocab      | dim 0, uneven allowed |
| everything else (norms, rotary buffers)      | replicated |                  |

A rule may carry a `granularity`: the split happens only at multiples of it (the head size for
attention projections, so no head is cut). When a dimension has fewer such units than there are
ranks and `T` is a multiple of the unit count, units are *replicated*: rank `r` gets unit
`r * units // T` — how vLLM places KV heads when `T` exceeds the number of KV heads (GQA).
Uneven splits are an error unless the rule allows them (`uneven=True`, vocab-parallel tables):
then each rank gets `ceil(n / T)` rows and the last ones fewer (the engine pads).

Rules are tried in order, first match wins (`re.search` on the parameter name); pass your own list
to `ReshardPlan` for other architectures. Merged layouts of an engine (vLLM's `qkv_proj`,
`gate_up_proj`) are the engine's weight loader's business: it receives per-HF-parameter shards.

Colocated placement uses the same plan in process: `spec.take(full)` is a view, no copy.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch

from .buckets import TensorMeta


@dataclass(frozen=True)
class ShardRule:
    """How tensors whose name matches `pattern` are split across TP ranks."""

    pattern: str
    #: Dimension to split; None replicates the tensor on every rank.
    dim: int | None
    #: Split only at multiples of this many elements along `dim` (e.g. the head size).
    granularity: int = 1
    #: Allow a size not divisible by the rank count (ceil-sized slices, the last ones shorter).
    uneven: bool = False
    #: Documentation only: column, row, vocab, replicated.
    kind: str = ""


def default_tp_rules(head_dim: int | None = None) -> list[ShardRule]:
    """The Llama/Qwen2 rules of the module docstring. With `head_dim`, attention projections are
    split on head boundaries (and KV heads replicated when there are fewer than ranks)."""
    g = head_dim or 1
    return [
        ShardRule(r"(^|\.)(q_proj|k_proj|v_proj)\.(weight|bias)$", 0, granularity=g, kind="column"),
        ShardRule(r"(^|\.)(gate_proj|up_proj)\.(weight|bias)$", 0, kind="column"),
        ShardRule(r"(^|\.)o_proj\.weight$", 1, granularity=g, kind="row"),
        ShardRule(r"(^|\.)down_proj\.weight$", 1, kind="row"),
        ShardRule(r"(^|\.)(o_proj|down_proj)\.bias$", None, kind="replicated"),
        ShardRule(r"(^|\.)(embed_tokens|lm_head)\.weight$", 0, uneven=True, kind="vocab"),
        ShardRule(r".*", None, kind="replicated"),
    ]


@dataclass(frozen=True)
class ShardSpec:
    """Rank `tp_rank`'s slice of one tensor: `length` elements from `start` along `dim`."""

    name: str
    full_shape: tuple[int, ...]
    dim: int | None
    start: int
    length: int
    tp_rank: int

    @property
    def shape(self) -> tuple[int, ...]:
        if self.dim is None:
            return self.full_shape
        s = list(self.full_shape)
        s[self.dim] = self.length
        return tuple(s)

    def take(self, full: torch.Tensor) -> torch.Tensor:
        """The slice of `full` (a view)."""
        if tuple(full.shape) != self.full_shape:
            raise ValueError(
                f"tensor {self.name!r} has shape {tuple(full.shape)}, plan says {self.full_shape}"
            )
        return full if self.dim is None else full.narrow(self.dim, self.start, self.length)


class ReshardPlan:
    """Training layout (full tensors) -> inference layout with tensor parallelism `tp_size`."""

    def __init__(
        self,
        shapes: Mapping[str, Sequence[int]],
        tp_size: int,
        rules: Sequence[ShardRule] | None = None,
    ):
        if tp_size < 1:
            raise ValueError(f"tp_size must be >= 1, got {tp_size}")
        self.tp_size = tp_size
        self.rules = list(rules) if rules is not None else default_tp_rules()
        self._compiled = [(re.compile(r.pattern), r) for r in self.rules]
        self.specs: dict[str, list[ShardSpec]] = {
            name: self._plan(name, tuple(int(s) for s in shape)) for name, shape in shapes.items()
        }

    @classmethod
    def for_tensors(
        cls, named: Iterable[tuple[str, torch.Tensor]], tp_size: int, rules: Sequence[ShardRule] | None = None
    ) -> ReshardPlan:
        """A plan for these tensors (DTensors report their full shape; nothing is gathered)."""
        return cls({n: tuple(t.shape) for n, t in named}, tp_size, rules)

    def rule_for(self, name: str) -> ShardRule:
        for rx, rule in self._compiled:
            if rx.search(name):
                return rule
        return ShardRule("", None, kind="replicated")

    def _plan(self, name: str, shape: tuple[int, ...]) -> list[ShardSpec]:
        rule, T = self.rule_for(name), self.tp_size
        dim = rule.dim
        if dim is not None and dim < 0:
            dim += len(shape)
        if T == 1 or dim is None or dim >= len(shape):
            return [ShardSpec(name, shape, None, 0, 0, r) for r in range(T)]
        n, g = shape[dim], rule.granularity
        where = f"tensor {name!r} (shape {shape}, rule {rule.pattern!r} dim {dim})"
        if n % g:
            raise ValueError(f"{where}: size {n} is not a multiple of granularity {g}")
        units = n // g
        if units % T == 0:
            per = units // T * g
            return [ShardSpec(name, shape, dim, r * per, per, r) for r in range(T)]
        if units < T and T % units == 0:  # replicate units (KV heads under GQA)
            return [ShardSpec(name, shape, dim, (r * units // T) * g, g, r) for r in range(T)]
        if rule.uneven:
            per = math.ceil(units / T) * g
            return [
                ShardSpec(name, shape, dim, min(r * per, n), max(0, min(per, n - r * per)), r)
                for r in range(T)
            ]
        raise ValueError(
            f"{where}: {units} units of {g} cannot be split over tensor_parallel_size={T}; "
            "use a TP size that divides it, or a rule with uneven=True"
        )

    def shard(self, name: str, tp_rank: int) -> ShardSpec:
        if not 0 <= tp_rank < self.tp_size:
            raise ValueError(f"tp_rank {tp_rank} outside [0, {self.tp_size})")
        try:
            return self.specs[name][tp_rank]
        except KeyError:
            raise KeyError(f"tensor {name!r} is not in the plan") from None

    def metas(self, tp_rank: int, dtypes: Mapping[str, torch.dtype | str]) -> list[TensorMeta]:
        """The stream header of rank `tp_rank`'s channel, in plan order."""
        out = []
        for name in self.specs:
            dt = dtypes[name]
            out.append(TensorMeta(name, self.shard(name, tp_rank).shape, str(dt).removeprefix("torch.")))
        return out

    def transform(self, tp_rank: int) -> Callable[[str, torch.Tensor], torch.Tensor]:
        """For `bucketed_broadcast(transform=...)`: full tensor -> this rank's slice."""
        return lambda name, full: self.shard(name, tp_rank).take(full)

    def assemble(self, name: str, shards: Sequence[torch.Tensor]) -> torch.Tensor:
        """The full tensor back from every rank's slice (tests, and engines gathering for export)."""
        specs = self.specs[name]
        if len(shards) != self.tp_size:
            raise ValueError(f"{name!r}: need {self.tp_size} shards, got {len(shards)}")
        first = specs[0]
        if first.dim is None:
            return shards[0]
        full = torch.empty(first.full_shape, dtype=shards[0].dtype)
        for spec, s in zip(specs, shards):
            full.narrow(spec.dim, spec.start, spec.length).copy_(s)  # type: ignore[arg-type]
        return full

    def describe(self) -> list[tuple[str, str, int | None, tuple[int, ...]]]:
        """(name, kind, dim, rank-0 shard shape) per tensor, for logs and docs."""
        return [(n, self.rule_for(n).kind, s[0].dim, s[0].shape) for n, s in self.specs.items()]
