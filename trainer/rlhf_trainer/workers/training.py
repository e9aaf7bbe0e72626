"""`TrainableWorker`: the part the actor and the critic share — a model sharded with FSDP2 when
the role has several ranks, AdamW with a warm-up/decay schedule, and the update loop:

    for each optimizer step (epochs x mini-batches):
        for each of this rank's micro-batches:
            loss = role loss(micro-batch, global token/sequence counts)   # a share of the step loss
            (loss * world_size).backward()                                # FSDP averages over ranks
        clip the global grad norm; optimizer step; scheduler step

Losses are normalised by the token and sequence counts of the whole optimizer step over all
ranks (`algorithms.aggregation`), so the gradient does not depend on how the step is split.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

from rlhf_trainer.workers import batching, modeling
from rlhf_trainer.workers.base import Worker


class TrainableWorker(Worker):
    """A rank of a trained role (actor or critic)."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR

    def build_model(self) -> nn.Module:
        raise NotImplementedError

    def learning_rate(self) -> float:
        return self.spec.training.learning_rate

    def setup(self) -> None:
        model = self.build_model().to(self.device)
        if self.world_size > 1:
            model = modeling.shard_model(model)
        self.model = model
        t = self.spec.training
        self.optimizer = modeling.build_optimizer(model, self.learning_rate(), t.weight_decay)
        self.scheduler = modeling.build_scheduler(
            self.optimizer, t.lr_schedule, t.warmup_steps, t.steps * self.optimizer_steps_per_batch()
        )

    def optimizer_steps_per_batch(self) -> int:
        t = self.spec.training
        batch = t.prompts_per_step * self.spec.rollout.samples_per_prompt
        return t.epochs_per_batch * max(1, batch // (t.mini_batch_size or batch))

    # -- the update loop -----------------------------------------------------------------------
    def train_batch(
        self, batch: dict[str, Tensor], step: int, loss_fn: Callable[[dict[str, Any]], dict[str, Any]]
    ) -> dict[str, float]:
        """Every optimizer step of one training step over `batch`; returns metrics averaged over
        optimizer steps (losses summed over micro-batches and ranks, other metrics token-weighted)."""
        t = self.spec.training
        order = torch.Generator().manual_seed(self.spec.training.seed * 7919 + step)  # same on every rank
        self.seed(step, stream=3)
        self.model.train()
        totals: dict[str, float] = {}
        steps = batching.minibatches(batch, t.mini_batch_size, t.epochs_per_batch, order)
        for rows in steps:
            my_units, total_units = batching.shard_for_rank(batch, rows, self.rank, self.world_size)
            mask = batch["response_mask"][rows]
            norms = {
                "global_tokens": float(mask.sum()),
                "global_seqs": float((mask.sum(-1) > 0).sum()),
            }
            sums: dict[str, float] = {}
            weight = 0.0
            for micro in batching.micro_batches(my_units, total_units, self.world_size, t.micro_batch_size):
                part = self.to_device(batching.select_rows(batch, micro))  # type: ignore[arg-type]
                out = loss_fn({**part, **norms})
                (out["loss"] * self.world_size).backward()
                tokens = float(part["response_mask"].sum())
                sums["loss"] = sums.get("loss", 0.0) + float(out["loss"].detach())
                for key, value in out.items():
                    if key != "loss" and isinstance(value, (int, float)):
                        sums[key] = sums.get(key, 0.0) + float(value) * tokens
                weight += tokens
            grad_norm = self.clip_and_step()
            reduced = self.all_reduce_metrics(sums, weight)
            reduced[f"{self.role}/grad_norm"] = grad_norm
            reduced[f"{self.role}/lr"] = float(self.scheduler.get_last_lr()[0])
            for key, value in reduced.items():
                totals[key] = totals.get(key, 0.0) + value / len(steps)
        totals[f"{self.role}/optimizer_steps"] = float(len(steps))
        return totals

    def clip_and_step(self) -> float:
        clip = self.spec.training.grad_clip
        params = [p for p in self.model.parameters() if p.grad is not None]
        norm = torch.nn.utils.clip_grad_norm_(params, clip if clip > 0 else float("inf"))
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return modeling.to_float(norm)

    def all_reduce_metrics(self, sums: dict[str, float], weight: float) -> dict[str, float]:
        """`loss` summed over ranks; every other metric averaged over ranks weighted by tokens."""
        keys = sorted(sums)
        vec = torch.tensor([sums[k] for k in keys] + [weight], dtype=torch.float64)
        if self.world_size > 1:
            dist.all_reduce(vec)
        total_weight = max(float(vec[-1]), 1.0)
        out = {}
        for i, key in enumerate(keys):
            name = key if "/" in key else f"{self.role}/{key}"
            out[name] = float(vec[i]) if key == "loss" else float(vec[i]) / total_weight
        return out

    # -- checkpoint ----------------------------------------------------------------------------
    def save(self, directory: str) -> None:
        """Write `<role>.safetensors`, `<role>_optim.safetensors` and `<role>_state.json` (rank 0)."""
        model_state = modeling.full_state_dict(self.model)
        optim_state = modeling.full_optimizer_state(self.model, self.optimizer)
        if self.rank != 0:
            return
        out = Path(directory)
        save_file(
            {k: v.detach().contiguous().clone() for k, v in model_state.items()},
            out / f"{self.role}.safetensors",
        )
        tensors, meta = flatten_optimizer_state(optim_state)
        save_file(tensors, out / f"{self.role}_optim.safetensors")
        state = {"optimizer": meta, "scheduler": self.scheduler.state_dict()}
        (out / f"{self.role}_state.json").write_text(json.dumps(state, indent=1, default=_json_default))

    def load(self, directory: str) -> None:
        """Restore what `save` wrote (every rank reads the files: a shared volume on a cluster)."""
        src = Path(directory)
        modeling.load_full_state_dict(self.model, load_file(src / f"{self.role}.safetensors"))
        state = json.loads((src / f"{self.role}_state.json").read_text())
        optim = unflatten_optimizer_state(
            load_file(src / f"{self.role}_optim.safetensors"), state["optimizer"]
        )
        modeling.load_full_optimizer_state(self.model, self.optimizer, optim)
        self.scheduler.load_state_dict(state["scheduler"])


def _json_default(value: Any) -> Any:
    if isinstance(value, Tensor):
        return value.item() if value.numel() == 1 else value.tolist()
    if isinstance(value, tuple):
        return list(value)
    return str(value)


def flatten_optimizer_state(state: dict[str, Any]) -> tuple[dict[str, Tensor], dict[str, Any]]:
    """Split a full optimizer state dict into tensors (`state/<param>/<key>`) and JSON metadata."""
    tensors: dict[str, Tensor] = {}
    scalars: dict[str, dict[str, Any]] = {}
    for param, entries in state.get("state", {}).items():
        for key, value in entries.items():
            if isinstance(value, Tensor):
                tensors[f"state/{param}/{key}"] = value.detach().contiguous().clone()
            else:
                scalars.setdefault(str(param), {})[key] = value
    return tensors, {"param_groups": state.get("param_groups", []), "scalars": scalars}


def unflatten_optimizer_state(tensors: dict[str, Tensor], meta: dict[str, Any]) -> dict[str, Any]:
    state: dict[str, dict[str, Any]] = {}
    for name, value in tensors.items():
        _, rest = name.split("/", 1)
        param, key = rest.rsplit("/", 1)
        state.setdefault(param, {})[key] = value
    for param, entries in meta.get("scalars", {}).items():
        state.setdefault(param, {}).update(entries)
    groups = [dict(g, betas=tuple(g["betas"])) if "betas" in g else g for g in meta["param_groups"]]
    return {"state": state, "param_groups": groups}
