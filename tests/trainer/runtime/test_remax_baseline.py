"""ReMax's greedy baseline phase with real workers run in-process (no Ray): each sample's
`baseline_scores` is the reward of the greedy decode of its own prompt."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from .conftest import make_job


class InProcessGroup:
    """The part of `WorkerGroup` the rollout and reward phases use, over plain worker objects."""

    def __init__(self, workers: list[Any]):
        self.workers = workers

    def __len__(self) -> int:
        return len(self.workers)

    def call_each(self, method: str, per_rank: list[tuple[Any, ...]], **kwargs: Any) -> list[Any]:
        return [getattr(w, method)(*args, **kwargs) for w, args in zip(self.workers, per_rank)]


def test_each_sample_gets_the_reward_of_its_prompts_greedy_response(tiny_model: Path, tmp_path: Path):
    from rlhf_trainer.algorithms import build_algorithm
    from rlhf_trainer.dataflow import TrainerContext, phases
    from rlhf_trainer.rewards.builtin import arithmetic_partial
    from rlhf_trainer.rollout import decode_responses
    from rlhf_trainer.rollout.hf import HFRolloutEngine
    from rlhf_trainer.startup import load_prompts, load_tokenizer
    from rlhf_trainer.workers import ActorWorker, RewardWorker

    job = make_job(
        "remax-phase",
        algorithm={"name": "remax", "params": {"klCoef": 0.0}},
        reward={"functions": [{"path": "rlhf_trainer.rewards.builtin:arithmetic_partial"}]},
        rollout={"samplesPerPrompt": 3, "maxNewTokens": 4, "temperature": 1.5},
        training={"steps": 1, "promptsPerStep": 6},
    )
    spec = job.spec
    tokenizer = load_tokenizer(spec)
    algorithm = build_algorithm("remax", {"klCoef": 0.0}, job=spec)
    ctx = TrainerContext(spec, "remax-phase", tmp_path, tokenizer, load_prompts(spec, tokenizer), algorithm)
    actor, reward = ActorWorker(spec, colocated=True), RewardWorker(spec)
    actor.setup()
    reward.setup()
    ctx.actor, ctx.reward = InProcessGroup([actor]), InProcessGroup([reward])  # type: ignore[assignment]

    prompts = phases.sample_prompts(ctx)
    batch = phases.score(ctx, phases.generate(ctx, prompts))
    assert len(batch) == 18
    batch = phases.greedy_baseline(ctx, batch, algorithm)

    # the greedy answers, decoded independently from the same weights
    engine = HFRolloutEngine(actor.model, tokenizer, max_new_tokens=4, temperature=0.0)
    greedy = engine.generate([p.ids for p in prompts], n=1)
    texts = decode_responses(greedy, tokenizer)
    expected = arithmetic_partial(
        [p.text for p in prompts], texts, answer=[p.columns["answer"] for p in prompts]
    )
    want = torch.tensor(expected, dtype=torch.float32)[batch["group_index"]]
    torch.testing.assert_close(batch["baseline_scores"], want)
    assert batch.metrics["baseline/reward_mean"] == float(torch.tensor(expected).mean())

    out = phases.compute_advantages(ctx, batch, algorithm)
    first = out["advantages"][:, 0]  # every sample has at least one token: A = score - baseline
    torch.testing.assert_close(first, out["scores"] - want)
    # an algorithm without a baseline adds nothing
    assert (
        "baseline_scores"
        not in phases.greedy_baseline(ctx, phases.generate(ctx, prompts), build_algorithm("grpo")).tensors
    )
