"""Stage `fsdp`: FSDP2 on a one-rank NCCL group, as a sharded actor runs on a GPU node: the
model sharded with the project's `modeling.shard_model` (bf16 `MixedPrecisionPolicy` over fp32
shards) and `enable_activation_checkpointing`; one training step on NCCL (metrics all-reduced
on the GPU); the project's checkpoint (`TrainableWorker.save` gathers, `load` scatters) into a
fresh sharded worker, whose next step must equal the live one's.
"""

from __future__ import annotations

import os
import sys
from typing import Any

from common import Stage, free_port, main, require


def likelihood_loss(worker: Any) -> Any:
    """Maximise the responses' log-likelihood, normalised by the step's global token count."""
    from rlhf_trainer.workers import modeling

    def loss_fn(micro: dict[str, Any]) -> dict[str, Any]:
        logp, _ = modeling.token_log_probs(worker.model, micro)
        return {"loss": -(logp * micro["response_mask"]).sum() / micro["global_tokens"]}

    return loss_fn


def random_batch(vocab: int, rows: int = 16, p: int = 6, t: int = 6, seed: int = 0) -> dict[str, Any]:
    import torch

    g = torch.Generator().manual_seed(seed)
    return {
        "prompt_ids": torch.randint(3, vocab, (rows, p), generator=g),
        "prompt_mask": torch.ones(rows, p, dtype=torch.long),
        "response_ids": torch.randint(3, vocab, (rows, t), generator=g),
        "response_mask": torch.ones(rows, t),
    }


def sharded_worker(spec: Any, device: str) -> Any:
    """An actor rank of a 1-rank group, sharded by hand (the worker shards only with 2+ ranks)."""
    from rlhf_trainer.workers import ActorWorker, modeling

    worker = ActorWorker(spec, device=device)
    model = worker.build_model()
    modeling.enable_activation_checkpointing(model)
    worker.model = modeling.shard_model(model.to(worker.device), spec.model.dtype)
    worker.optimizer = modeling.build_optimizer(worker.model, spec.training.learning_rate, 0.0)
    worker.scheduler = modeling.build_scheduler(worker.optimizer, "constant", 0, 10)
    return worker


def body(stage: Stage) -> None:
    require("transformers", "the project's models are transformers models")
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    import torch
    import torch.distributed as dist

    torch.use_deterministic_algorithms(True, warn_only=True)
    from loop import tiny_job

    from rlhf_trainer.workers import distributed, modeling

    spec = tiny_job(stage.shared, activationCheckpointing=True)
    device = torch.device("cuda", 0) if stage.device.startswith("cuda") else torch.device("cpu")
    distributed.init_group(("127.0.0.1", free_port()), 0, 1, device)
    try:
        backend = dist.get_backend()
        stage.figure("backend", backend)
        if device.type == "cuda":
            stage.check("NCCL group", backend == "nccl", backend)
        worker = sharded_worker(spec, str(device))
        from torch.distributed.tensor import DTensor

        params = list(worker.model.parameters())
        stage.check(
            "parameters are fp32 DTensor shards",
            all(isinstance(p, DTensor) and p.dtype == torch.float32 for p in params),
        )
        wrapped = sum(
            1 for m in worker.model.modules() if getattr(m.forward, "__name__", "") == "checkpointed"
        )
        stage.check("activation checkpointing wraps the blocks", wrapped > 0, f"{wrapped} blocks")
        vocab = worker.model.config.vocab_size
        with torch.no_grad():
            ids = torch.tensor([[5, 6, 7, 8]], device=device)
            logits = worker.model(input_ids=ids).logits
        stage.figure("fsdp_compute_dtype", str(logits.dtype))
        stage.check("bf16 compute (MixedPrecisionPolicy)", logits.dtype == torch.bfloat16, str(logits.dtype))
        before = {k: v.float().clone() for k, v in modeling.full_state_dict(worker.model).items()}
        m = worker.train_batch(random_batch(vocab), 0, likelihood_loss(worker))
        after = {k: v.float().clone() for k, v in modeling.full_state_dict(worker.model).items()}
        moved = max(float((after[k] - before[k]).abs().max()) for k in after)
        stage.figure("fsdp_step_loss", m["actor/loss"])
        stage.check("a training step moves the fp32 shards", moved > 0, f"max |dw| {moved:.3g}")
        flag = torch.ones(1, device=distributed.group_device())
        dist.all_reduce(flag)
        stage.check("all-reduce on the group's device", float(flag) == 1.0, str(flag.device))

        step_dir = stage.scratch / "ckpt"
        step_dir.mkdir(parents=True, exist_ok=True)
        worker.save(str(step_dir))
        restored = sharded_worker(spec, str(device))
        restored.load(str(step_dir))
        got = modeling.full_state_dict(restored.model)
        stage.check(
            "checkpoint round trip: same weights", all(torch.equal(got[k].float(), after[k]) for k in after)
        )
        nxt = random_batch(vocab, seed=1)
        worker.train_batch(nxt, 1, likelihood_loss(worker))
        restored.train_batch(nxt, 1, likelihood_loss(restored))
        a, b = modeling.full_state_dict(worker.model), modeling.full_state_dict(restored.model)
        diff = max(float((a[k].float() - b[k].float()).abs().max()) for k in a)
        stage.figure("fsdp_resume_next_step_max_abs_diff", diff)
        stage.check("restored shards' next step equals the live one's", diff <= 1e-6, f"{diff:.3g}")
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main("fsdp", body))
