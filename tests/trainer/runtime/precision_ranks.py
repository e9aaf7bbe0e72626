"""Ranks of a trained role run in-process (one rank) or as spawned gloo processes (FSDP2), for the
mixed-precision and gradient-accumulation tests. Real workers, real FSDP2, a simple loss."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch


def spec_for(model: Path, dtype: str, lr: float, micro: int, checkpointing: bool = False) -> Any:
    from rlhf_api.loader import parse_spec

    return parse_spec(
        {
            "model": {"path": str(model), "dtype": dtype},
            "data": {"path": "unused.jsonl"},
            "reward": {"functions": [{"path": "r:f"}]},
            "rollout": {"samplesPerPrompt": 4, "maxNewTokens": 4},
            "training": {
                "promptsPerStep": 2,
                "microBatchSize": micro,
                "learningRate": lr,
                "gradClip": 0.0,
                "activationCheckpointing": checkpointing,
            },
        }
    )


def batch(vocab: int, rows: int = 8, p: int = 5, t: int = 4, seed: int = 0) -> dict[str, torch.Tensor]:
    """`rows` random (prompt, response) pairs: ids (B, P) and (B, T), full masks."""
    g = torch.Generator().manual_seed(seed)
    return {
        "prompt_ids": torch.randint(3, vocab, (rows, p), generator=g),
        "prompt_mask": torch.ones(rows, p, dtype=torch.long),
        "response_ids": torch.randint(3, vocab, (rows, t), generator=g),
        "response_mask": torch.ones(rows, t),
    }


def likelihood_loss(worker: Any) -> Any:
    """Maximise the responses' log-likelihood, normalised by the step's global token count."""
    from rlhf_trainer.workers import modeling

    def loss_fn(micro: dict[str, Any]) -> dict[str, Any]:
        logp, _ = modeling.token_log_probs(worker.model, micro)
        return {"loss": -(logp * micro["response_mask"]).sum() / micro["global_tokens"]}

    return loss_fn


def full_weights(worker: Any) -> dict[str, torch.Tensor]:
    from rlhf_trainer.workers import modeling

    return {k: v.float().clone() for k, v in modeling.full_state_dict(worker.model).items()}


def train_once(worker: Any, rows: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    worker.train_batch(rows, 0, likelihood_loss(worker))
    return full_weights(worker)


def _rank(rank: int, world: int, port: int, model: str, dtype: str, micro: int, out: str) -> None:
    """One FSDP2 rank: train one step; rank 0 saves what the test checks."""
    os.environ.setdefault("RLHF_TORCH_THREADS", "1")
    import torch.distributed as dist

    from rlhf_trainer.workers import ActorWorker, modeling

    spec = spec_for(Path(model), dtype, lr=1e-6, micro=micro)
    worker = ActorWorker(spec, rank=rank, world_size=world, device="cpu")
    worker.init_group(("127.0.0.1", port))
    worker.setup()
    # Count the gradient reductions: FSDP2 reduce-scatters each FSDP module's gradients in a
    # backward whose gradient sync is on. A spy on the real collective (it still runs).
    calls = {"n": 0}
    name = next(n for n in ("reduce_scatter_single", "reduce_scatter_tensor") if hasattr(dist, n))
    real = getattr(dist, name)

    def counting(*args: Any, **kwargs: Any) -> Any:
        calls["n"] += 1
        return real(*args, **kwargs)

    setattr(dist, name, counting)
    before = full_weights(worker)
    sharded = {n: (p.dtype, type(p).__name__) for n, p in worker.model.named_parameters()}
    vocab = worker.model.config.vocab_size
    after = train_once(worker, batch(vocab))
    setattr(dist, name, real)
    fsdp_modules = sum(1 for m in worker.model.modules() if modeling._is_fsdp(m))
    optim_dtypes = sorted(
        {str(v.dtype) for s in worker.optimizer.state.values() for v in s.values() if v.dim() > 0}
    )
    if rank == 0:
        torch.save(
            {
                "before": before,
                "after": after,
                "sharded": sharded,
                "optim_dtypes": optim_dtypes,
                "reduce_scatters": calls["n"],
                "fsdp_modules": fsdp_modules,
            },
            out,
        )
    dist.destroy_process_group()


def run_ranks(model: Path, dtype: str, micro: int, out: Path, world: int = 2) -> dict[str, Any]:
    """Spawn `world` FSDP2 ranks over gloo; returns rank 0's record."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_rank, args=(world, port, str(model), dtype, micro, str(out)), nprocs=world, join=True)
    return torch.load(out)  # type: ignore[no-any-return]
