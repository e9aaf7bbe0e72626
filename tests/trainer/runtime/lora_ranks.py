"""A LoRA actor's ranks run in-process (one rank) or as spawned gloo processes (FSDP2), for
`test_lora`: the same two updates, then what each layout computes and sends."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from .precision_ranks import batch, likelihood_loss

LORA = {"rank": 4, "alpha": 8.0, "targetModules": ["all-linear"]}


def lora_spec(model: Path, lora: dict[str, Any] | None = LORA, lr: float = 1e-2) -> Any:
    from rlhf_api.loader import parse_spec

    model_section: dict[str, Any] = {"path": str(model)}
    if lora is not None:
        model_section["lora"] = lora
    return parse_spec(
        {
            "model": model_section,
            "data": {"path": "unused.jsonl"},
            "reward": {"functions": [{"path": "r:f"}]},
            "algorithm": {"name": "grpo", "params": {"klCoef": 0.05}},
            "rollout": {"samplesPerPrompt": 4, "maxNewTokens": 4},
            "training": {"promptsPerStep": 2, "microBatchSize": 4, "learningRate": lr, "gradClip": 0.0},
        }
    )


def train_and_record(worker: Any, staging: Path | None = None) -> dict[str, Any]:
    """Two updates on the same batch; then reference and policy log-probs (B, T) in row order
    (every rank's share, gathered) and the merged weights. With `staging`, a checkpoint part is
    written there too (a collective)."""
    rows = batch(worker.model.config.vocab_size)
    worker.train_batch(rows, 0, likelihood_loss(worker))
    worker.train_batch(rows, 1, likelihood_loss(worker))
    from rlhf_trainer.workers.base import stitch

    def gathered(share: Any) -> Any:
        shares = [share]
        if worker.world_size > 1:
            import torch.distributed as dist

            shares = [None] * worker.world_size
            dist.all_gather_object(shares, share)
        return stitch(shares, 8)

    ref = gathered(worker.compute_ref_log_probs(rows))
    policy = gathered(worker.compute_log_probs(rows))
    merged = {k: v.detach().cpu().clone() for k, v in worker.merged_weights()}
    if staging is not None:
        worker.save(str(staging))
    return {"ref": ref, "policy": policy, "merged": merged}


def _rank(rank: int, world: int, port: int, model: str, out: str) -> None:
    os.environ.setdefault("RLHF_TORCH_THREADS", "1")
    import torch.distributed as dist

    from rlhf_trainer.workers import ActorWorker

    worker = ActorWorker(lora_spec(Path(model)), rank=rank, world_size=world, device="cpu")
    worker.init_group(("127.0.0.1", port))
    worker.setup()
    staging = Path(out).parent / "staging"
    if rank == 0:
        staging.mkdir(exist_ok=True)
    dist.barrier()
    record = train_and_record(worker, staging)
    dist.barrier()
    # Resume: a fresh sharded actor loads the adapter the collective save wrote.
    resumed = ActorWorker(lora_spec(Path(model)), rank=rank, world_size=world, device="cpu")
    resumed.setup()
    resumed.load(str(staging))
    rows = batch(resumed.model.config.vocab_size)
    shares: list[Any] = [None] * world
    dist.all_gather_object(shares, resumed.compute_log_probs(rows))
    from rlhf_trainer.workers.base import stitch

    record["resumed_policy"] = stitch(shares, 8)
    if rank == 0:
        torch.save(record, out)
    dist.destroy_process_group()


def run_ranks(model: Path, out: Path, world: int = 2) -> dict[str, Any]:
    """Spawn `world` FSDP2 ranks over gloo; returns rank 0's record."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_rank, args=(world, port, str(model), str(out)), nprocs=world, join=True)
    return torch.load(out)  # type: ignore[no-any-return]
