"""Stage `critic_lora`: the two trained modules beside the plain actor, on a GPU.

* the critic (`CriticWorker`, PPO's value model: the backbone plus a value head): its values
  are computed, then a few updates on one batch with fixed returns must lower the value loss;
* LoRA (`spec.model.lora`, needs peft): only the adapters train, the base weights do not move,
  the reference log-probs (adapters disabled) are the base model's, and the merged weights carry
  the base model's names. Without peft this part is reported, not run.
"""

from __future__ import annotations

import importlib.util
import sys
from typing import Any

from common import Stage, main, require


def _batch(vocab: int) -> dict[str, Any]:
    from fsdp import random_batch

    return random_batch(vocab, rows=16, p=6, t=6)


def _branch(spec: Any) -> Any:
    from rlhf_trainer.algorithms import build_algorithm
    from rlhf_trainer.workers.training import UpdateBranch

    algo = build_algorithm(spec.algorithm.name, spec.algorithm.params, job=spec)
    return UpdateBranch(spec.algorithm.name, algo.params.as_dict(), algo.state_dict())


def critic(stage: Any) -> None:
    import torch
    from loop import tiny_job

    from rlhf_api.loader import parse_spec
    from rlhf_trainer.workers import CriticWorker

    base = tiny_job(stage.shared)
    spec = parse_spec(
        {
            "model": {"path": base.model.path, "dtype": "bfloat16"},
            "data": {"path": base.data.path},
            "reward": {"functions": [{"path": "rlhf_trainer.rewards.builtin:arithmetic_exact"}]},
            "algorithm": {"name": "ppo", "params": {"klCoef": 0.0}},
            "roles": {"critic": {"resources": {"gpus": 1}}},
            "training": {"promptsPerStep": 2, "microBatchSize": 16, "learningRate": 1e-3},
            "rollout": {"samplesPerPrompt": 8},
        }
    )
    worker = CriticWorker(spec, device=stage.device)
    worker.setup()
    batch = _batch(worker.model.backbone.config.vocab_size)
    _, values = worker.compute_values(batch)
    stage.check(
        "critic values (B, T), finite",
        tuple(values.shape) == (16, 6) and bool(torch.isfinite(values).all()),
        str(tuple(values.shape)),
    )
    batch = {
        **batch,
        "old_values": values,
        "returns": torch.linspace(-1, 1, 16)[:, None].expand(16, 6).contiguous(),
    }
    losses = [worker.update(batch, s, [_branch(spec)])["critic/loss"] for s in range(8)]
    stage.figure("critic_loss_first_last", [losses[0], losses[-1]])
    stage.check(
        "value loss falls on a fixed batch", losses[-1] < losses[0], f"{losses[0]:.4f} -> {losses[-1]:.4f}"
    )


def lora(stage: Any) -> None:
    import torch
    from fsdp import likelihood_loss
    from loop import tiny_job

    from rlhf_trainer.workers import ActorWorker, modeling

    spec = tiny_job(stage.shared)
    import dataclasses

    from rlhf_api.sections import LoraSpec

    spec = dataclasses.replace(spec, model=dataclasses.replace(spec.model, lora=LoraSpec()))
    worker = ActorWorker(spec, device=stage.device)
    worker.setup()
    trainable = [n for n, p in worker.model.named_parameters() if p.requires_grad]
    stage.check(
        "only adapters train",
        bool(trainable) and all("lora_" in n for n in trainable),
        f"{len(trainable)} tensors",
    )
    frozen = {n: p.detach().clone() for n, p in worker.model.named_parameters() if not p.requires_grad}
    batch = _batch(worker.model.config.vocab_size)
    losses = [worker.train_batch(batch, s, likelihood_loss(worker))["actor/loss"] for s in range(8)]
    stage.figure("lora_loss_first_last", [losses[0], losses[-1]])
    stage.check(
        "LoRA loss falls on a fixed batch", losses[-1] < losses[0], f"{losses[0]:.4f} -> {losses[-1]:.4f}"
    )
    moved = max(
        float((p.detach() - frozen[n]).abs().max()) for n, p in worker.model.named_parameters() if n in frozen
    )
    stage.check("base weights do not move", moved == 0.0, f"max |dw| {moved:.3g}")
    base = modeling.load_policy(spec.model.path, "float32").to(stage.device)
    _, ref = worker.compute_ref_log_probs(batch)
    with torch.no_grad(), worker.compute():
        want, _ = modeling.token_log_probs(base, worker.to_device(batch))
    diff = float((ref - want.float().cpu()).abs().max())
    stage.figure("lora_reference_vs_base_max_abs_diff", diff)
    stage.check("reference log-probs are the base model's", diff <= 5e-2, f"{diff:.3g}")
    names = [n for n, _ in worker.merged_weights()]
    base_names = [n for n, _ in base.named_parameters()]
    stage.check(
        "merged weights carry the base model's names",
        names == base_names,
        f"{len(names)} vs {len(base_names)}",
    )


def body(stage: Stage) -> None:
    require("transformers", "the project's models are transformers models")
    critic(stage)
    if importlib.util.find_spec("peft") is None:
        stage.note("LoRA", f"needs peft (spec.model.lora); not installed in {sys.executable}")
    else:
        lora(stage)


if __name__ == "__main__":
    sys.exit(main("critic_lora", body))
