"""`TrainableWorker`: the part the actor and the critic share — a model sharded with FSDP2 when
the role has several ranks, AdamW with a warm-up/decay schedule, and the update loop:

    for each optimizer step (epochs x mini-batches):
        for each of this rank's micro-batches:
            loss = role loss(micro-batch, global token/sequence counts)   # a share of the step loss
            (loss * world_size).backward()     # FSDP reduces (averages over ranks) on the last one only
        clip the global grad norm; optimizer step; scheduler step

Precision: the weights, gradients and AdamW state are fp32 (master weights) whatever
`spec.model.dtype` says; that dtype is the compute dtype (FSDP2's `MixedPrecisionPolicy` when
sharded, autocast on one rank). `spec.training.activationCheckpointing` recomputes each block's
activations in the backward pass.

Losses are normalised by the token and sequence counts of the whole optimizer step over all
ranks (`algorithms.aggregation`), so the gradient does not depend on how the step is split.

One training step may train with several algorithms at once (`ConditionalUpdateOperator`): the
batch then carries `branch_index` (B,) and the update gets one `UpdateBranch` per index. Each
row is trained by its branch's loss, normalised by its branch's counts of the optimizer step,
and the step's loss is the sum of the branch losses: still one optimizer and one scheduler step
per optimizer step of the schedule.
"""

from __future__ import annotations

import json
import socket
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

from rlhf_trainer import checkpoint
from rlhf_trainer.workers import batching, distributed, modeling
from rlhf_trainer.workers.base import Worker


@dataclass(frozen=True)
class UpdateBranch:
    """How a worker rebuilds one of the algorithms of a training step (see the module docstring)."""

    algorithm: str
    """Registered name or import path."""
    params: dict[str, Any]
    state: dict[str, Any]
    """The controller's algorithm state (KL coefficient) at this step."""
    label: str = ""
    """Prefix of this branch's metrics (`true/actor/pg_loss`); "" for a step with one algorithm."""
    filler_keys: tuple[str, ...] = ()
    """Batch keys other branches brought and this one lacks (zeros in its rows): hidden from its loss."""


#: The batch key that says which `UpdateBranch` trains each row (absent: branch 0).
BRANCH_INDEX = "branch_index"


def branch_losses(
    micro: dict[str, Any],
    branches: Sequence[UpdateBranch],
    algorithms: Sequence[Any],
    loss_of: Callable[[Any, dict[str, Any]], dict[str, Any]],
    role: str,
) -> dict[str, Any]:
    """The micro-batch's loss: each branch's `loss_of(algorithm, its rows)`, summed.

    `micro` holds the per-row tensors (B, ...), `branch_index` (B,) when there are several
    branches, and the optimizer step's normalizers: `global_tokens`/`global_seqs` (one branch)
    or `branch_tokens`/`branch_seqs` (K,) (one entry per branch). A branch's metrics are
    prefixed with its label and weighted by its own tokens (`metric_tokens`); its loss share is
    reported as `<label>/<role>/loss`."""
    if len(branches) == 1 and BRANCH_INDEX not in micro:
        out = loss_of(algorithms[0], micro)
        return out
    index = micro[BRANCH_INDEX]  # (B,)
    total: Tensor | None = None
    metrics: dict[str, Any] = {}
    weights: dict[str, float] = {}
    for k, (branch, algorithm) in enumerate(zip(branches, algorithms)):
        rows = (index == k).nonzero().squeeze(-1)  # (B_k,)
        if rows.numel() == 0:
            continue
        sub = {
            key: value
            for key, value in batching.select_rows(micro, rows).items()
            if key not in branch.filler_keys and key not in ("branch_tokens", "branch_seqs", BRANCH_INDEX)
        }
        sub["global_tokens"] = float(micro["branch_tokens"][k])
        sub["global_seqs"] = float(micro["branch_seqs"][k])
        out = loss_of(algorithm, sub)
        total = out["loss"] if total is None else total + out["loss"]
        prefix = f"{branch.label}/" if branch.label else ""
        tokens = float(sub["response_mask"].sum())
        metrics[f"{prefix}{role}/loss"] = float(out["loss"].detach())
        for key, value in out.items():
            if key != "loss" and isinstance(value, (int, float)):
                metrics[prefix + key] = float(value)
                weights[prefix + key] = tokens
    assert total is not None, "a micro-batch holds rows of no branch"
    return {"loss": total, **metrics, "metric_tokens": weights}


def step_normalizers(batch: dict[str, Tensor], rows: Tensor, branches: int) -> dict[str, Any]:
    """Valid tokens and non-empty sequences of an optimizer step's `rows` over all ranks: in
    total (`global_tokens`, `global_seqs`) and, with several branches, per branch (K,)."""
    mask = batch["response_mask"][rows]  # (R, T)
    norms: dict[str, Any] = {
        "global_tokens": float(mask.sum()),
        "global_seqs": float((mask.sum(-1) > 0).sum()),
    }
    if BRANCH_INDEX in batch:
        index = batch[BRANCH_INDEX][rows]  # (R,)
        tokens = torch.zeros(branches, dtype=torch.float64).index_add_(0, index, mask.sum(-1).double())
        seqs = torch.zeros(branches, dtype=torch.float64).index_add_(0, index, (mask.sum(-1) > 0).double())
        norms["branch_tokens"], norms["branch_seqs"] = tokens, seqs  # (K,) each
    return norms


class TrainableWorker(Worker):
    """A rank of a trained role (actor or critic)."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR

    def build_model(self, meta: bool = False) -> nn.Module:
        """The role's fp32 model; `meta`: its skeleton on the meta device (no weights)."""
        raise NotImplementedError

    def learning_rate(self) -> float:
        return self.spec.training.learning_rate

    @property
    def sharded_checkpoints(self) -> bool:
        """Whether `save` writes DCP shards (each rank its own) rather than the gathered state."""
        return self.world_size > 1

    def setup(self) -> None:
        # fp32: the master weights. Sharded, only rank 0 reads them (on the CPU); the other ranks
        # build the skeleton on the meta device and get their shards by broadcast.
        model = self.build_model(meta=self.world_size > 1 and self.rank != 0)
        if self.spec.training.activation_checkpointing:
            modeling.enable_activation_checkpointing(model)
        t = self.spec.training
        if self.world_size == 1:
            model = model.to(self.device)
        if t.max_tokens_per_micro_batch is not None:
            # Before sharding: a no-grad forward of an FSDP2 root leaves its parameters swapped
            # for the unsharded ones, which the optimizer built next would then hold. Sharded,
            # rank 0 probes its CPU model and tells the others.
            self.layout = self._agreed(
                lambda: modeling.forward_layout(model, next(model.parameters()).device)
            )
        if self.world_size > 1:
            model = modeling.shard_from_rank0(model, self.spec.model.dtype, self.rank)
        self.model = model
        self.optimizer = modeling.build_optimizer(model, self.learning_rate(), t.weight_decay)
        self.scheduler = modeling.build_scheduler(
            self.optimizer, t.lr_schedule, t.warmup_steps, t.steps * self.optimizer_steps_per_batch()
        )

    def _agreed(self, compute: Callable[[], Any]) -> Any:
        """`compute()` on rank 0, its result on every rank (a collective when sharded)."""
        if self.world_size == 1:
            return compute()
        box = [compute() if self.rank == 0 else None]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def compute(self) -> Any:
        """The compute context of the model: bf16 autocast over the fp32 weights on one rank."""
        return modeling.mixed_precision(self.model, self.spec.model.dtype, self.device)

    def optimizer_steps_per_batch(self) -> int:
        t = self.spec.training
        batch = t.prompts_per_step * self.spec.rollout.samples_per_prompt
        return t.epochs_per_batch * max(1, batch // (t.mini_batch_size or batch))

    # -- the update loop -----------------------------------------------------------------------
    def train_batch(
        self,
        batch: dict[str, Tensor],
        step: int,
        loss_fn: Callable[[dict[str, Any]], dict[str, Any]],
        branches: int = 1,
    ) -> dict[str, float]:
        """Every optimizer step of one training step over `batch`; returns metrics averaged over
        optimizer steps (losses summed over micro-batches and ranks, other metrics token-weighted:
        by the micro-batch's tokens, or by the tokens `loss_fn` names in `metric_tokens`).
        `branches`: how many algorithms `batch["branch_index"]` selects between."""
        t = self.spec.training
        order = torch.Generator().manual_seed(self.spec.training.seed * 7919 + step)  # same on every rank
        self.seed(step, stream=3)
        self.model.train()
        totals: dict[str, float] = {}
        steps = batching.minibatches(batch, t.mini_batch_size, t.epochs_per_batch, order)
        for rows in steps:
            my_units, total_units = batching.shard_for_rank(batch, rows, self.rank, self.world_size)
            norms = step_normalizers(batch, rows, branches)
            sums: dict[str, float] = {}
            weights: dict[str, float] = {}
            micros = self.micro_batches(batch, rows, my_units, total_units)
            for i, micro in enumerate(micros):
                # An empty micro-batch (token budget: this rank has fewer units than the others
                # have micro-batches) runs one of its rows with weight 0, for FSDP's collectives.
                filler = micro.numel() == 0
                part = self.to_device(batching.select_rows(batch, my_units[0] if filler else micro))  # type: ignore[arg-type]
                # FSDP2: accumulate unreduced gradients until the step's last micro-batch, which
                # reduce-scatters the sum once (every rank runs the same number of micro-batches).
                modeling.set_gradient_sync(self.model, i == len(micros) - 1)
                with self.compute():
                    out = loss_fn({**part, **norms})
                (out["loss"] * (0.0 if filler else self.world_size)).backward()
                if filler:
                    continue
                tokens = float(part["response_mask"].sum())
                own = out.get("metric_tokens", {})
                sums["loss"] = sums.get("loss", 0.0) + float(out["loss"].detach())
                for key, value in out.items():
                    if key != "loss" and isinstance(value, (int, float)):
                        w = 1.0 if _summed(key) else own.get(key, tokens)
                        sums[key] = sums.get(key, 0.0) + float(value) * w
                        weights[key] = weights.get(key, 0.0) + w
            grad_norm = self.clip_and_step()
            reduced = self.all_reduce_metrics(sums, weights, union_keys=branches > 1)
            reduced[f"{self.role}/grad_norm"] = grad_norm
            reduced[f"{self.role}/lr"] = float(self.scheduler.get_last_lr()[0])
            for key, value in reduced.items():
                totals[key] = totals.get(key, 0.0) + value / len(steps)
        totals[f"{self.role}/optimizer_steps"] = float(len(steps))
        return totals

    def micro_batches(
        self, batch: dict[str, Tensor], rows: Tensor, my_units: list[Tensor], total_units: int
    ) -> list[Tensor]:
        """This rank's micro-batches of an optimizer step: `microBatchSize` rows each, or by the
        token budget `maxTokensPerMicroBatch` (`batching.token_micro_batches`)."""
        t = self.spec.training
        if t.max_tokens_per_micro_batch is None:
            return list(batching.micro_batches(my_units, total_units, self.world_size, t.micro_batch_size))
        return batching.token_micro_batches(
            batch, rows, self.rank, self.world_size, t.max_tokens_per_micro_batch
        )

    def clip_and_step(self) -> float:
        clip = self.spec.training.grad_clip
        params = [p for p in self.model.parameters() if p.grad is not None]
        norm = torch.nn.utils.clip_grad_norm_(params, clip if clip > 0 else float("inf"))
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return modeling.to_float(norm)

    def all_reduce_metrics(
        self, sums: dict[str, float], weights: dict[str, float], union_keys: bool = False
    ) -> dict[str, float]:
        """Losses (`loss`, `<branch>/<role>/loss`) summed over ranks; every other metric averaged
        over ranks weighted by its tokens. A rank whose rows held no sample of a branch lacks
        that branch's keys: the ranks agree on the union of their keys first."""
        keys = sorted(sums)
        if union_keys and self.world_size > 1:
            gathered: list[list[str] | None] = [None] * self.world_size
            dist.all_gather_object(gathered, keys)
            keys = sorted({k for ks in gathered for k in (ks or [])})
        vec = torch.tensor(
            [sums.get(k, 0.0) for k in keys] + [weights.get(k, 0.0) for k in keys], dtype=torch.float64
        )
        if self.world_size > 1:
            vec = vec.to(distributed.group_device())  # NCCL takes GPU tensors only
            dist.all_reduce(vec)
            vec = vec.cpu()
        out = {}
        for i, key in enumerate(keys):
            name = key if "/" in key else f"{self.role}/{key}"
            value = float(vec[i])
            out[name] = (
                value if key == "loss" or _summed(key) else value / max(float(vec[len(keys) + i]), 1.0)
            )
        return out

    # -- checkpoint (`rlhf_trainer.checkpoint`: the layout and the publishing protocol) -------
    def save(self, staging: str) -> dict[str, Any] | None:
        """Write this role's part of a checkpoint into `staging/<role>/` on the shared volume.

        A collective. Sharded (`sharded_checkpoints`): see `save_sharded`. Otherwise every rank
        gathers the model and optimizer state; rank 0 writes `model.safetensors`,
        `optimizer.safetensors`, `state.json` and `model_files`, then the part marker, and
        returns the marker (the controller checks it sees the same files)."""
        if self.sharded_checkpoints:
            return self.save_sharded(staging)
        model_state = modeling.full_state_dict(self.model)
        optim_state = modeling.full_optimizer_state(self.model, self.optimizer)
        if self.rank != 0:
            return None

        def write(out: Path) -> None:
            self.write_weights(out, model_state)
            tensors, meta = flatten_optimizer_state(optim_state)
            save_file(tensors, out / "optimizer.safetensors")
            state = {"optimizer": meta, "scheduler": self.scheduler.state_dict()}
            (out / "state.json").write_text(json.dumps(state, indent=1, default=_json_default))
            self.write_model_files(out)

        return checkpoint.write_part(staging, self.role, write)

    def write_weights(self, out: Path, model_state: dict[str, Tensor]) -> None:
        """The part's weights (`model_state`: the full state dict gathered on rank 0)."""
        save_file(
            {k: v.detach().contiguous().clone() for k, v in model_state.items()}, out / "model.safetensors"
        )

    def load_weights(self, src: Path) -> None:
        """Restore what `write_weights` wrote in `src` (every rank)."""
        modeling.load_full_state_dict(self.model, load_file(src / "model.safetensors"))

    def write_model_files(self, out: Path) -> None:
        """Files beside the weights that make the part usable on its own (the actor: its config
        and tokenizer, for `rlhf export`)."""

    def save_sharded(self, staging: str) -> dict[str, Any] | None:
        """The sharded part (`checkpoint.SHARDS_DIR`): rank 0 empties `staging/<role>/`; every
        rank writes its own shards of the model and AdamW state with DCP (rank 0 DCP's
        `.metadata`, once all have written); rank 0 checks it sees every shard file, writes
        `state.json` (the LR schedule) and `model_files`, then the part marker, and returns it."""
        problems: list[Any] = [None] * self.world_size
        dist.all_gather_object(problems, checkpoint.staging_problem(staging, self.role))
        if any(problems):  # every rank fails alike, none is left waiting in a collective
            raise checkpoint.CheckpointError(next(p for p in problems if p))
        out = Path(staging) / self.role
        if self.rank == 0:
            checkpoint.prepare_part(staging, self.role)
        dist.barrier()
        metadata = modeling.save_sharded(self.model, self.optimizer, out / checkpoint.SHARDS_DIR)
        hosts: list[Any] = [None] * self.world_size
        dist.all_gather_object(hosts, socket.gethostname())
        if self.rank != 0:
            return None
        problem = checkpoint.shards_problem(out / checkpoint.SHARDS_DIR, metadata, hosts)
        if problem:
            raise checkpoint.CheckpointError(f"{self.role} checkpoint: {problem}")
        state = {"format": checkpoint.SHARDED_FORMAT, "scheduler": self.scheduler.state_dict()}
        (out / "state.json").write_text(json.dumps(state, indent=1, default=_json_default))
        self.write_model_files(out)
        return checkpoint.finish_part(out, self.role)

    def load(self, step_dir: str) -> None:
        """Restore what `save` wrote, in either layout. Sharded: each rank reads only its own
        shards (DCP reshards to this world size). Gathered: every rank reads the whole part."""
        src = checkpoint.part_dir(step_dir, self.role)
        state = json.loads((src / "state.json").read_text())
        if (src / checkpoint.SHARDS_DIR).is_dir():
            modeling.load_sharded(self.model, self.optimizer, src / checkpoint.SHARDS_DIR)
        else:
            self.load_weights(src)
            optim = unflatten_optimizer_state(load_file(src / "optimizer.safetensors"), state["optimizer"])
            modeling.load_full_optimizer_state(self.model, self.optimizer, optim)
        self.scheduler.load_state_dict(state["scheduler"])

    def answer_checkpoint_probe(self, probe_dir: str) -> None:
        """At startup: does this rank see the controller's checkpoint directory (and it ours)?"""
        checkpoint.answer_probe(probe_dir, self.role, self.rank)


def _summed(key: str) -> bool:
    """A branch's loss share (`true/actor/loss`): summed over micro-batches and ranks, like `loss`."""
    return key.endswith("/loss") and key.count("/") >= 2


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
