"""Token-budget micro-batching (`spec.training.maxTokensPerMicroBatch`) on real workers: a tiny
random Llama made on the spot, a batch of very uneven lengths, and one training step whose loss
and gradients are captured before the optimizer step. Ranks run in-process (one rank) or as
spawned gloo processes (FSDP2)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

P, T = 7, 9
ACTOR_MODES = [
    "token-mean",
    "token-sum",
    "seq-mean-token-sum",
    "seq-mean-token-mean",
    "seq-mean-token-sum-norm",
]


def make_model(path: Path, vocab: int = 40, hidden: int = 32, layers: int = 2) -> Path:
    """A random tiny Llama saved with `save_pretrained` (sdpa attention, the CPU default)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=True,
    )
    LlamaForCausalLM(config).save_pretrained(path)
    return path


def spec_for(model: Path, budget: int | None, micro: int = 3, mini: int = 0, lora: bool = False) -> Any:
    from rlhf_api.loader import parse_spec

    training: dict[str, Any] = {
        "promptsPerStep": 2,
        "microBatchSize": micro,
        "miniBatchSize": mini,
        "learningRate": 1e-4,
        "gradClip": 0.0,
    }
    if budget is not None:
        training["maxTokensPerMicroBatch"] = budget
    model_spec: dict[str, Any] = {"path": str(model)}
    if lora:
        model_spec["lora"] = {"rank": 4, "alpha": 8, "targetModules": ["all-linear"]}
    return parse_spec(
        {
            "model": model_spec,
            "data": {"path": "unused.jsonl"},
            "reward": {"functions": [{"path": "r:f"}]},
            "rollout": {"samplesPerPrompt": 4, "maxNewTokens": T},
            "training": training,
        }
    )


def uneven_batch(
    vocab: int,
    prompt_lens: list[int],
    response_lens: list[int],
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
) -> dict[str, torch.Tensor]:
    """Left-padded prompts and right-padded responses of the given lengths, with what the actor's
    (GRPO/PPO) and the critic's losses read."""
    g = torch.Generator().manual_seed(seed)
    b = len(prompt_lens)
    prompt_mask = (torch.arange(P)[None] >= P - torch.tensor(prompt_lens)[:, None]).long()  # (B, P)
    mask = (torch.arange(T)[None] < torch.tensor(response_lens)[:, None]).to(dtype)  # (B, T)

    def noise(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(dtype)

    return {
        "prompt_ids": torch.randint(1, vocab, (b, P), generator=g) * prompt_mask,
        "prompt_mask": prompt_mask,
        "response_ids": torch.randint(1, vocab, (b, T), generator=g) * mask.long(),
        "response_mask": mask,
        "old_log_probs": (-3.0 - 0.1 * noise(b, T)) * mask,
        "ref_log_probs": (-3.0 - 0.1 * noise(b, T)) * mask,
        "advantages": noise(b, T) * mask,
        "old_values": 0.1 * noise(b, T) * mask,
        "returns": noise(b, T) * mask,
    }


def capture_step(worker: Any) -> dict[str, Any]:
    """Make the worker's optimizer step record the full gradients (a collective under FSDP) and
    leave the weights as they are; returns the record, filled by `train_batch`."""
    record: dict[str, Any] = {}

    def clip_and_step() -> float:
        grads = {}
        for name, p in worker.model.named_parameters():
            if p.grad is not None:
                g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
                grads[name] = g.detach().double().cpu().clone()
        record.setdefault("grads", []).append(grads)
        worker.optimizer.zero_grad(set_to_none=True)
        return 0.0

    worker.clip_and_step = clip_and_step
    return record


def _state(name: str, params: dict[str, Any]) -> dict[str, Any]:
    """The controller's algorithm state (its KL coefficient) at the first step."""
    from rlhf_trainer.algorithms import build_algorithm

    return build_algorithm(name, params).state_dict()  # type: ignore[no-any-return]


def actor_step(
    worker: Any, batch: dict[str, torch.Tensor], mode: str
) -> tuple[float, dict[str, torch.Tensor]]:
    """One GRPO update (KL loss on, entropy bonus on) with `mode`; the step's loss and gradients."""
    from rlhf_trainer.workers.training import UpdateBranch

    params = {"lossAggMode": mode, "klCoef": 0.1, "entropyCoef": 0.01}
    record = capture_step(worker)
    metrics = worker.update(batch, 0, [UpdateBranch("grpo", params, _state("grpo", params))])
    return metrics["actor/loss"], record["grads"][0]


def critic_step(
    worker: Any, batch: dict[str, torch.Tensor], mode: str
) -> tuple[float, dict[str, torch.Tensor]]:
    """One PPO value update with `mode`; the step's loss and gradients."""
    from rlhf_trainer.workers.training import UpdateBranch

    record = capture_step(worker)
    params = {"lossAggMode": mode}
    metrics = worker.update(batch, 0, [UpdateBranch("ppo", params, _state("ppo", params))])
    return metrics["critic/loss"], record["grads"][0]


def score(worker: Any, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """The scoring pass of the role (`old_log_probs`, `ref_log_probs` or `old_values`)."""
    method = worker.compute_values if hasattr(worker, "compute_values") else worker.compute_log_probs
    return method(batch)  # type: ignore[no-any-return]


def build(role: str, spec: Any, rank: int = 0, world: int = 1) -> Any:
    from rlhf_trainer.workers import ActorWorker, CriticWorker, ReferenceWorker

    cls = {"actor": ActorWorker, "critic": CriticWorker, "reference": ReferenceWorker}[role]
    return cls(spec, rank=rank, world_size=world, device="cpu")


def _rank(rank: int, world: int, port: int, model: str, budget: int, data: str, out: str) -> None:
    """One FSDP2 rank with the token budget: an actor step and a critic step per mode."""
    os.environ.setdefault("RLHF_TORCH_THREADS", "1")
    import torch.distributed as dist

    from rlhf_trainer.workers import batching

    batch, modes = torch.load(data)
    spec = spec_for(Path(model), budget)
    record: dict[str, Any] = {}
    for role in ("actor", "critic"):
        worker = build(role, spec, rank, world)
        if role == "actor":  # one process group, both roles' FSDP2 on it
            worker.init_group(("127.0.0.1", port))
        worker.setup()
        record[f"{role}/layout"] = worker.layout
        record[f"{role}/scores"] = score(worker, batch)  # this rank's (rows, outputs)
        step = actor_step if role == "actor" else critic_step
        for mode in modes:
            record[(role, mode)] = step(worker, batch, mode)
    units, total = batching.shard_for_rank(batch, torch.arange(len(batch["response_mask"])), rank, world)
    record["micro_batches"] = [
        m.tolist() for m in batching.token_micro_batches(batch, torch.arange(total), rank, world, budget)
    ]
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, record["micro_batches"])
    record["micro_batches"] = gathered
    if rank == 0:
        torch.save(record, out)
    dist.destroy_process_group()


def run_ranks(
    model: Path, budget: int, batch: dict[str, torch.Tensor], modes: list[str], tmp: Path, world: int = 2
) -> dict[str, Any]:
    """Spawn `world` FSDP2 ranks over gloo; returns rank 0's record."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    data, out = tmp / "batch.pt", tmp / "record.pt"
    torch.save((batch, modes), data)
    mp.spawn(_rank, args=(world, port, str(model), budget, str(data), str(out)), nprocs=world, join=True)
    return torch.load(out, weights_only=False)  # type: ignore[no-any-return]
