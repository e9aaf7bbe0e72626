"""The phases of a training step, each a short function of the context and the batch.

    prompts = sample_prompts(ctx)                    # data
    batch   = generate(ctx, prompts)                 # rollout
    batch   = score(ctx, batch)                      # reward
    batch   = reference_log_probs(ctx, batch, algo)  # reference   (algorithms with a KL term)
    batch   = critic_values(ctx, batch, algo)        # critic      (algorithms with a critic)
    batch   = policy_log_probs(ctx, batch, algo)     # old log-probs (when the batch is reused)
    batch   = compute_advantages(ctx, batch, algo)   # advantage
    batch   = update_policy(ctx, batch, algo)        # update
    reshard_if_needed(ctx, metrics)                  # elastic rollout (dataflow.elastic)
    sync_weights(ctx)                                # weight sync

The operators of `dataflow.operators` call these; the controller's loop calls the stream.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import Tensor

from rlhf_trainer.dataflow.batch import StepBatch
from rlhf_trainer.dataflow.context import TrainerContext

log = logging.getLogger(__name__)

#: Keys sent to training and scoring workers (texts and bookkeeping stay on the controller).
WORKER_KEYS = (
    "prompt_ids",
    "prompt_mask",
    "response_ids",
    "response_mask",
    "old_log_probs",
    "ref_log_probs",
    "old_values",
    "advantages",
    "returns",
    "scores",
    "group_index",
    "token_rewards",
    "chosen",
    "pair_index",
)


def _split(n: int, parts: int) -> list[range]:
    """`n` items as `parts` contiguous ranges (empty ones dropped)."""
    bounds = torch.tensor_split(torch.arange(n), parts)
    return [range(int(b[0]), int(b[-1]) + 1) for b in bounds if len(b)]


def worker_batch(batch: StepBatch) -> dict[str, Tensor]:
    return {k: v for k, v in batch.tensors.items() if k in WORKER_KEYS}


def sample_prompts(ctx: TrainerContext) -> list[Any]:
    """The step's prompts (`data.PromptItem`s); overlong ones are skipped and counted by the dataset."""
    return list(ctx.dataset.next_batch(ctx.spec.training.prompts_per_step))


def generate(ctx: TrainerContext, prompts: list[Any]) -> StepBatch:
    """Sample `samplesPerPrompt` responses per prompt on the generators, prompts split between them."""
    from rlhf_trainer.rollout import RolloutBatch, decode_responses

    n = ctx.spec.rollout.samples_per_prompt
    if ctx.fleet is not None:  # disaggregated: replicas lease prompts from the fleet's queue
        from rlhf_trainer.dataflow.elastic import rollout_tensors

        rollout, version = rollout_tensors(*ctx.fleet.generate(prompts, n, ctx.step))
    else:
        group = ctx.generators()
        chunks = _split(len(prompts), len(group))
        outputs = group.call_each("generate", [([prompts[i].ids for i in c], n, ctx.step) for c in chunks])
        versions = [out.pop("policy_version", None) for out in outputs]
        parts = [RolloutBatch.from_dict(out) for out in outputs]
        rollout = RolloutBatch.concat(parts, offset_prompt_index=True)
        version = torch.cat(
            [
                v if v is not None else torch.full((len(p),), ctx.policy_version)
                for v, p in zip(versions, parts)
            ]
        )
    items = [prompts[i] for i in rollout.prompt_index]
    tensors = {
        "prompt_ids": rollout.prompt_ids,
        "prompt_mask": rollout.prompt_mask,
        "response_ids": rollout.response_ids,
        "response_mask": rollout.response_mask.float(),
        "rollout_log_probs": rollout.log_probs,
        "group_index": torch.tensor(rollout.prompt_index, dtype=torch.long),
        "policy_version": version.long(),
    }
    lengths = rollout.response_mask.sum(-1)
    metrics = {
        "rollout/samples": float(len(rollout)),
        "rollout/tokens": float(lengths.sum()),
        "rollout/response_length": float(lengths.float().mean()),
        "rollout/policy_version_lag": float(ctx.policy_version - version.float().mean()),
    }
    if rollout.finished is not None:
        metrics["rollout/finished_fraction"] = float(rollout.finished.float().mean())
    return StepBatch(
        tensors=tensors,
        prompts=[it.text for it in items],
        responses=decode_responses(rollout, ctx.tokenizer),
        columns=[dict(it.columns) for it in items],
        metrics=metrics,
    )


def score(ctx: TrainerContext, batch: StepBatch) -> StepBatch:
    """Rewards for every sample, rows split between the reward workers.

    Failures follow `reward.onError` inside `CombinedReward`: `fail` raises (the job stops, naming
    the sample), `skip` marks the sample invalid (`reward_valid` False: dropped by the stream's
    filter), `penalty` gives it `errorPenalty`. Each failure is logged with its sample here.
    """
    chunks = _split(len(batch), len(ctx.reward))
    results = ctx.reward.call_each(
        "score",
        [
            ([batch.prompts[i] for i in c], [batch.responses[i] for i in c], [batch.columns[i] for i in c])
            for c in chunks
        ],
    )
    scores = torch.cat([torch.as_tensor(r.scores, dtype=torch.float32) for r in results])
    valid = torch.cat([torch.as_tensor(r.valid, dtype=torch.bool) for r in results])
    errors = [e for r in results for e in (r.errors or [])]
    for err in errors[:5]:  # CombinedReward logs each one with its sample; say which step it was
        log.warning("step %d: %s", ctx.step, err)
    batch["scores"] = torch.where(valid, scores, torch.zeros_like(scores))
    batch["reward_valid"] = valid
    ok = scores[valid]
    batch.metrics.update(
        {
            "reward/mean": float(ok.mean()) if len(ok) else float("nan"),
            "reward/std": float(ok.std()) if len(ok) > 1 else 0.0,
            "reward/max": float(ok.max()) if len(ok) else float("nan"),
            "reward/min": float(ok.min()) if len(ok) else float("nan"),
            "reward/errors": float(len(errors)),
            "reward/invalid": float((~valid).sum()),
        }
    )
    for r in results[:1]:
        for name in getattr(r, "per_reward", {}) or {}:
            values = torch.cat([torch.as_tensor(x.per_reward[name], dtype=torch.float32) for x in results])
            batch.metrics[f"reward/{name}"] = float(values[valid].mean()) if valid.any() else float("nan")
    return batch


def reference_log_probs(ctx: TrainerContext, batch: StepBatch, algorithm: Any) -> StepBatch:
    """`ref_log_probs` from the frozen reference policy, when the algorithm has a KL term."""
    if not algorithm.needs_reference or "ref_log_probs" in batch:
        return batch
    if ctx.reference is None:
        raise RuntimeError(f"algorithm {algorithm.name!r} needs a reference policy, but the job runs none")
    batch["ref_log_probs"] = _score_rows(ctx.reference, "compute_log_probs", batch, independent=True)
    return batch


def critic_values(ctx: TrainerContext, batch: StepBatch, algorithm: Any) -> StepBatch:
    """`old_values` from the critic, for algorithms with a critic (GAE)."""
    if not algorithm.needs_critic or "old_values" in batch:
        return batch
    if ctx.critic is None:
        raise RuntimeError(f"algorithm {algorithm.name!r} needs a critic, but the job runs none")
    batch["old_values"] = _score_rows(ctx.critic, "compute_values", batch) * batch["response_mask"]
    return batch


def policy_log_probs(ctx: TrainerContext, batch: StepBatch, algorithm: Any) -> StepBatch:
    """`old_log_probs` from the training policy, needed when the batch is trained on more than
    once (epochs, mini-batches) or enters the advantage (KL penalty in the reward). Otherwise the
    actor takes its own detached log-probs (ratio 1) and this forward pass is saved."""
    t = ctx.spec.training
    rows = len(batch)
    reused = t.epochs_per_batch > 1 or (t.mini_batch_size and t.mini_batch_size < rows)
    if "old_log_probs" in batch or not (reused or algorithm.needs_reference):
        return batch
    batch["old_log_probs"] = _score_rows(ctx.actor, "compute_log_probs", batch) * batch["response_mask"]
    return batch


def compute_advantages(ctx: TrainerContext, batch: StepBatch, algorithm: Any) -> StepBatch:
    out = algorithm.compute_advantages(batch.algorithm_batch())
    for key, value in out.items():
        if isinstance(value, Tensor):
            batch[key] = value
        elif isinstance(value, (int, float)) and "/" in key:
            batch.metrics[key] = float(value)
    if "advantages" in batch:  # preference algorithms pair samples up instead
        adv = batch["advantages"][batch["response_mask"] > 0]
        batch.metrics["advantage/mean"] = float(adv.mean()) if len(adv) else 0.0
        batch.metrics["advantage/std"] = float(adv.std()) if len(adv) > 1 else 0.0
    return batch


def update_policy(ctx: TrainerContext, batch: StepBatch, algorithm: Any) -> StepBatch:
    """One training step of the actor (and critic) on `batch`; the controller's algorithm then
    sees the step's metrics (`update_step`: adaptive KL)."""
    import ray

    data = ray.put(worker_batch(batch))
    name, params, state = _algorithm_args(ctx, algorithm)
    metrics: dict[str, float] = {}
    actor_runs = [w.update.remote(data, ctx.step, name, params, state) for w in ctx.actor.workers]
    critic_runs = []
    if algorithm.needs_critic and ctx.critic is not None:
        critic_runs = [w.update.remote(data, ctx.step, name, params, state) for w in ctx.critic.workers]
    from rlhf_trainer.workers.group import get

    results = get(actor_runs + critic_runs)
    metrics.update(results[0])  # ranks all-reduce their metrics: rank 0 holds the job's values
    if critic_runs:
        metrics.update(results[len(actor_runs)])
    metrics["batch/num_samples"] = float(len(batch))
    algorithm.update_step(metrics)
    ctx.policy_version += 1
    batch.metrics.update(metrics)
    batch.metrics["actor/policy_version"] = float(ctx.policy_version)
    return batch


def sync_weights(ctx: TrainerContext) -> dict[str, float]:
    """Make the generators sample from the updated policy; returns the sync's metrics.

    Colocated: each actor refreshes its hybrid engine (nothing to move with one rank).
    Disaggregated: a bucketed broadcast from actor rank 0 to every member of the fleet's weight-sync
    group, confirmed by every receiver (`elastic.RolloutFleet.sync`).
    """
    if ctx.fleet is None:
        ctx.actor.call("sync_engine")
        return {}
    return ctx.fleet.sync(ctx.policy_version, ctx.step)  # type: ignore[no-any-return]


def _algorithm_args(ctx: TrainerContext, algorithm: Any) -> tuple[str, dict[str, Any], dict[str, Any]]:
    """How workers rebuild `algorithm`: its name or import path, its params and its state."""
    spec_algo = ctx.spec.algorithm
    if algorithm is ctx.algorithm:
        name, params = spec_algo.name, dict(spec_algo.params)
    else:
        cls = type(algorithm)
        name = cls.name or f"{cls.__module__}:{cls.__qualname__}"
        params = algorithm.params.as_dict()
    return name, params, algorithm.state_dict()


def _score_rows(group: Any, method: str, batch: StepBatch, independent: bool = False) -> Tensor:
    """Run a scoring method over all rows: one shared batch for a sharded group (each rank takes
    its share), or contiguous row ranges for independent replicas."""
    from rlhf_trainer.workers.base import stitch

    data = worker_batch(batch)
    if independent and len(group) > 1:
        chunks = _split(len(batch), len(group))
        parts = group.call_each(
            method, [({k: v[c.start : c.stop] for k, v in data.items()},) for c in chunks]
        )
        results = [(rows + c.start, values) for (rows, values), c in zip(parts, chunks)]
    else:
        import ray

        results = group.call(method, ray.put(data))
    out = stitch(results, len(batch))
    width = batch["response_mask"].shape[1]
    return torch.nn.functional.pad(out, (0, width - out.shape[1]))[:, :width]
