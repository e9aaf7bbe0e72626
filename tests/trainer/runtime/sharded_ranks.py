"""Ranks of FSDP2-sharded trained roles as spawned gloo processes, for `test_sharded_checkpoint`:
loading from rank 0 into meta skeletons, a sharded (DCP) checkpoint published by the real
`checkpoint.save`, and a resume in fresh processes. Real workers, real FSDP2, real DCP."""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Any

import torch

from .precision_ranks import batch, full_weights, likelihood_loss


def spec_for(model: Path, critic: bool = False) -> Any:
    from rlhf_api.loader import parse_spec

    return parse_spec(
        {
            "model": {"path": str(model)},
            "data": {"path": "unused.jsonl"},
            "reward": {"functions": [{"path": "r:f"}]},
            "algorithm": {"name": "ppo" if critic else "grpo"},
            "rollout": {"samplesPerPrompt": 4, "maxNewTokens": 4},
            "training": {"promptsPerStep": 2, "microBatchSize": 2, "learningRate": 1e-3, "gradClip": 1.0},
        }
    )


def value_loss(worker: Any) -> Any:
    """Pull the critic's values towards 1 (a loss with a gradient for every parameter)."""
    from rlhf_trainer.workers import modeling

    def loss_fn(micro: dict[str, Any]) -> dict[str, Any]:
        values = modeling.token_values(worker.model, micro)
        return {"loss": (((values - 1.0) ** 2) * micro["response_mask"]).sum() / micro["global_tokens"]}

    return loss_fn


def loss_of(worker: Any) -> Any:
    return value_loss(worker) if worker.role == "critic" else likelihood_loss(worker)


def build(role: str, model: Path, rank: int, world: int) -> Any:
    from rlhf_trainer.workers import ActorWorker, CriticWorker

    cls = {"actor": ActorWorker, "critic": CriticWorker}[role]
    return cls(spec_for(model, critic=role == "critic"), rank=rank, world_size=world, device="cpu")


def spy_loading(record: dict[str, Any]) -> list[tuple[Any, str, Any]]:
    """Wrap `modeling.shard_model` and the documented `set_model_state_dict`: note whether the
    model is all meta when it is sharded, whether each parameter holds only its shard when the
    broadcast starts, and how many tensors this rank passes in (the broadcast gives the rest).
    Returns what to put back."""
    from torch.distributed.checkpoint import state_dict as dsd

    from rlhf_trainer.workers import modeling

    real_load, real_shard = dsd.set_model_state_dict, modeling.shard_model

    def shard(model: Any, *args: Any) -> Any:
        record["meta_at_shard"] = all(p.is_meta for p in model.parameters())
        return real_shard(model, *args)

    def load(model: Any, state: Any, options: Any = None) -> Any:
        params = list(model.parameters())
        record["local_at_load"] = all(
            not p.is_meta and p.to_local().numel() * 2 == p.numel() for p in params if p.shape[0] % 2 == 0
        )
        record["tensors_given"] = len(state)
        record["broadcast"] = bool(options is not None and options.broadcast_from_rank0)
        return real_load(model, state, options=options)

    dsd.set_model_state_dict, modeling.shard_model = load, shard
    return [(dsd, "set_model_state_dict", real_load), (modeling, "shard_model", real_shard)]


def local_state(worker: Any) -> dict[str, torch.Tensor]:
    """This rank's shards of every parameter and every buffer (the non-persistent ones too)."""
    out = {f"param/{n}": p.to_local().detach().clone() for n, p in worker.model.named_parameters()}
    out.update({f"buffer/{n}": b.detach().clone() for n, b in worker.model.named_buffers()})
    return out


def todays_local_state(role: str, model: Path) -> dict[str, torch.Tensor]:
    """The shards the loading before this change gave: every rank loads the full model, then shards."""
    from rlhf_trainer.workers import modeling

    full = modeling.load_policy(str(model)) if role == "actor" else modeling.ValueModel(str(model))
    sharded = modeling.shard_model(full)
    out = {f"param/{n}": p.to_local().detach().clone() for n, p in sharded.named_parameters()}
    out.update({f"buffer/{n}": b.detach().clone() for n, b in sharded.named_buffers()})
    return out


def publish(worker: Any, root: Path, step: int) -> Path | None:
    """`checkpoint.save` driven from rank 0, as the controller drives it: it names the staging
    directory to every rank, and every rank writes its part (a collective)."""
    import torch.distributed as dist

    from rlhf_trainer import checkpoint

    if worker.rank != 0:
        box: list[Any] = [None]
        dist.broadcast_object_list(box, src=0)
        worker.save(box[0])
        return None

    def write_workers(staging: Path) -> dict[str, Any]:
        dist.broadcast_object_list([str(staging)], src=0)
        return {worker.role: worker.save(str(staging))}

    return checkpoint.save(root, step, {"job": "sharded"}, write_workers, keep=2)


def counting_reader(record: dict[str, Any]) -> None:
    """Count the bytes this rank's DCP reads ask for, by file (the reader's own read plan)."""
    from torch.distributed.checkpoint import FileSystemReader

    from rlhf_trainer.workers import modeling

    class Counting(FileSystemReader):
        def read_data(self, plan: Any, planner: Any) -> Any:
            for item in plan.items:
                info = self.storage_data[item.storage_index]
                record[info.relative_path] = record.get(info.relative_path, 0) + info.length
            return super().read_data(plan, planner)

    modeling.checkpoint_reader = lambda directory: Counting(str(directory))


def optimizer_shapes(worker: Any) -> dict[str, tuple[tuple[int, ...], tuple[int, ...]]]:
    """(local shape, full shape) of every optimizer moment this rank holds."""
    out = {}
    for i, state in enumerate(worker.optimizer.state.values()):
        for key, value in state.items():
            if hasattr(value, "to_local"):
                out[f"{i}/{key}"] = (tuple(value.to_local().shape), tuple(value.shape))
            elif value.dim() > 0:
                out[f"{i}/{key}"] = (tuple(value.shape), tuple(value.shape))
    return out


def _save_rank(rank: int, world: int, port: int, role: str, model: str, out: str) -> None:
    """Load (from rank 0), train step 0, publish checkpoint 1, train step 1; record."""
    os.environ.setdefault("RLHF_TORCH_THREADS", "1")
    import torch.distributed as dist

    torch.set_num_threads(1)
    record: dict[str, Any] = {}
    worker = build(role, Path(model), rank, world)
    worker.init_group(("127.0.0.1", port))
    restore = spy_loading(record)
    worker.setup()
    for owner, name, real in restore:
        setattr(owner, name, real)
    record["loaded"] = local_state(worker)
    record["today"] = todays_local_state(role, Path(model))
    record["tied"] = role == "actor" and worker.model.lm_head.weight is worker.model.model.embed_tokens.weight
    rows = batch(
        worker.model.config.vocab_size if role == "actor" else worker.model.backbone.config.vocab_size
    )
    worker.train_batch(rows, 0, loss_of(worker))
    root = Path(out).parent / "checkpoints"
    record["at_save"] = full_weights(worker)
    record["published"] = publish(worker, root, 1)
    record["metrics"] = worker.train_batch(rows, 1, loss_of(worker))
    record["after"] = full_weights(worker)
    torch.save(record, f"{out}.{rank}")
    dist.destroy_process_group()


def _resume_rank(rank: int, world: int, port: int, role: str, model: str, out: str) -> None:
    """Fresh ranks: load the newest checkpoint (counting what each reads), train step 1; record."""
    os.environ.setdefault("RLHF_TORCH_THREADS", "1")
    import torch.distributed as dist

    from rlhf_trainer import checkpoint

    torch.set_num_threads(1)
    record: dict[str, Any] = {"read": {}}
    worker = build(role, Path(model), rank, world)
    if world > 1:
        worker.init_group(("127.0.0.1", port))
    worker.setup()
    counting_reader(record["read"])
    found = checkpoint.latest(Path(out).parent / "checkpoints")
    assert found is not None
    worker.load(str(found))
    record["optimizer_shapes"] = optimizer_shapes(worker)
    rows = batch(
        worker.model.config.vocab_size if role == "actor" else worker.model.backbone.config.vocab_size
    )
    record["metrics"] = worker.train_batch(rows, 1, loss_of(worker))
    record["after"] = full_weights(worker)
    torch.save(record, f"{out}.{rank}")
    if world > 1:
        dist.destroy_process_group()


def spawn(fn: Any, role: str, model: Path, out: Path, world: int = 2) -> list[dict[str, Any]]:
    """Run `fn` on `world` gloo ranks; returns each rank's record."""
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(fn, args=(world, port, role, str(model), str(out)), nprocs=world, join=True)
    return [torch.load(f"{out}.{r}", weights_only=False) for r in range(world)]
