"""A Ray-free GRPO step loop over plain worker objects, for the device check's stages: the
project's own phases (`dataflow.phases`: sample, generate, score, advantages) and the actor's
own `update`, with the workers called in this process instead of through Ray actors.

The job is the quickstart's (manifests/examples/quickstart.yaml: tiny arithmetic model, GRPO,
8 samples per prompt, lr 1e-3), made on the spot in the scratch directory (nothing downloaded).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any


class InProcessGroup:
    """The part of `WorkerGroup` the rollout and reward phases call, over plain worker objects."""

    def __init__(self, workers: list[Any]):
        self.workers = workers

    def __len__(self) -> int:
        return len(self.workers)

    def call_each(self, method: str, per_rank: list[tuple[Any, ...]], **kwargs: Any) -> list[Any]:
        return [getattr(w, method)(*args, **kwargs) for w, args in zip(self.workers, per_rank)]


#: The tiny model's directory: the project's model cache, the one the GPU tests use too, so one
#: check bootstraps it once (about half a minute on one CPU thread) and a second check not at all.
MODEL = Path(
    os.environ.get("DEVICE_CHECK_MODEL", "~/.cache/rlhf-operator/models/tiny-arithmetic")
).expanduser()


def tiny_job(shared: Path, dtype: str = "bfloat16", **training: Any) -> Any:
    """The quickstart's spec on the tiny arithmetic model (`MODEL`, bootstrapped when missing:
    `ensure_model` holds a lock while it builds), its prompts written into `shared`."""
    from rlhf_api.loader import parse_spec
    from rlhf_api.sections import ModelSpec
    from rlhf_trainer.bootstrap import ensure_model, write_prompts

    shared.mkdir(parents=True, exist_ok=True)
    model, prompts = MODEL, shared / "prompts.jsonl"
    ensure_model(ModelSpec(path=str(model), bootstrap="tiny-arithmetic"))
    if not prompts.is_file():
        write_prompts("tiny-arithmetic", prompts, n=1024, seed=0)
    return parse_spec(
        {
            "model": {"path": str(model), "dtype": dtype},
            "data": {"path": str(prompts)},
            "reward": {"functions": [{"path": "rlhf_trainer.rewards.builtin:arithmetic_exact"}]},
            "algorithm": {"name": "grpo", "params": {"klCoef": 0.0}},
            "rollout": {"samplesPerPrompt": 8, "maxNewTokens": 4, "temperature": 1.0},
            "roles": {"actor": {"resources": {"gpus": 1}}},
            "training": {
                "steps": 60,
                "promptsPerStep": 16,
                "microBatchSize": 128,
                "learningRate": 1e-3,
                "seed": 0,
                **training,
            },
            "checkpoint": {"every": 0},
        }
    )


class Loop:
    """The controller's side of the loop: context, algorithm, an actor and a reward worker."""

    def __init__(self, spec: Any, run_dir: Path, device: str):
        from transformers import AutoTokenizer

        from rlhf_trainer.algorithms import build_algorithm
        from rlhf_trainer.data import PromptDataset
        from rlhf_trainer.dataflow import TrainerContext
        from rlhf_trainer.workers import ActorWorker, RewardWorker

        tokenizer = AutoTokenizer.from_pretrained(spec.model.path)
        self.algorithm = build_algorithm(spec.algorithm.name, spec.algorithm.params, job=spec)
        dataset = PromptDataset(spec.data, tokenizer, seed=spec.training.seed)
        self.ctx = TrainerContext(spec, "device-check", run_dir, tokenizer, dataset, self.algorithm)
        self.actor = ActorWorker(spec, colocated=True, device=device)
        self.actor.setup()
        reward = RewardWorker(spec, device="cpu")
        reward.setup()
        self.ctx.actor = InProcessGroup([self.actor])  # type: ignore[assignment]
        self.ctx.reward = InProcessGroup([reward])  # type: ignore[assignment]

    def rollout(self, step: int) -> Any:
        """Rollout, reward and advantage of step `step` (the batch the update trains on)."""
        from rlhf_trainer.dataflow import phases

        self.ctx.step = step
        batch = phases.generate(self.ctx, phases.sample_prompts(self.ctx))
        batch = phases.score(self.ctx, batch)
        return phases.compute_advantages(self.ctx, batch, self.algorithm)

    def update(self, actor: Any, batch: Any, step: int) -> dict[str, float]:
        """The actor's update on `batch`, as `phases.update_policy` asks for it over Ray."""
        from rlhf_trainer.dataflow import phases
        from rlhf_trainer.workers.training import UpdateBranch

        branch = UpdateBranch(*phases._algorithm_args(self.ctx, self.algorithm))
        metrics: dict[str, float] = actor.update(phases.worker_batch(batch), step, [branch])
        return metrics

    def step(self, step: int) -> dict[str, float]:
        batch = self.rollout(step)
        metrics = self.update(self.actor, batch, step)
        self.algorithm.update_step(metrics)
        self.ctx.policy_version += 1
        return {**batch.metrics, **metrics}
