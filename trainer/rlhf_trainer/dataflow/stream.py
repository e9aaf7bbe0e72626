"""`DataStream`: a training step as a chain of operators, for programmatic use.

    stream = (
        DataStream()
        .add_operator(RolloutOperator(ctx))
        .add_operator(RewardModelScorer(ctx))
        .add_operator(FilterOperator(threshold=0.1))
        .add_operator(PPOUpdateOperator(ctx))
    )
    metrics = stream.step()

An operator is any callable `op(batch) -> batch`; the first one of a step receives `None` and
produces the batch (the rollout). `ConditionalUpdateOperator(condition, true_branch,
false_branch)` routes each sample to one of two sub-streams (PPO on high-reward samples,
online DPO on the rest) and trains them all in one update.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol, cast

import torch
from torch import Tensor

from rlhf_trainer.dataflow.batch import StepBatch


class Operator(Protocol):
    def __call__(self, batch: StepBatch | None) -> StepBatch: ...


class DataStream:
    """Operators run in order, once per `step()`."""

    def __init__(self, operators: Sequence[Operator] = ()):
        self.operators: list[Operator] = list(operators)
        self.last_batch: StepBatch | None = None

    def add_operator(self, operator: Operator) -> DataStream:
        self.operators.append(operator)
        return self

    def run(self, batch: StepBatch | None = None) -> StepBatch:
        for op in self.operators:
            batch = op(batch)
        if batch is None:
            raise ValueError(
                "DataStream: no operator produced a batch (the first one should be a RolloutOperator)"
            )
        return batch

    def step(self) -> dict[str, float]:
        """One training step; returns the step's metrics (the batch stays in `last_batch`)."""
        self.last_batch = self.run(None)
        return dict(self.last_batch.metrics)

    def algorithms(self) -> list[Any]:
        """Every algorithm an operator of this stream updates with (decides which roles run)."""
        found: list[Any] = []
        for op in self.operators:
            found.extend(getattr(op, "algorithms", lambda: [])())
        return found


class FilterOperator:
    """Keep the samples that pass: `scores >= threshold` (or `key >= threshold`), or where
    `predicate(batch)` is True. Removed samples are counted in `filter/<name>_dropped`."""

    def __init__(
        self,
        threshold: float | None = None,
        *,
        key: str = "scores",
        predicate: Callable[[StepBatch], Tensor] | None = None,
        name: str = "filter",
    ):
        if threshold is None and predicate is None:
            raise ValueError("FilterOperator needs a threshold or a predicate")
        self.threshold = threshold
        self.key = key
        self.predicate = predicate
        self.name = name

    def __call__(self, batch: StepBatch | None) -> StepBatch:
        if batch is None:
            raise ValueError(f"{self.name}: nothing to filter (put it after the rollout)")
        if self.predicate is not None:
            keep = torch.as_tensor(self.predicate(batch), dtype=torch.bool)
        else:
            keep = batch[self.key] >= float(self.threshold)  # type: ignore[arg-type]
        out = batch.select(keep)
        out.metrics[f"filter/{self.name}_dropped"] = float((~keep).sum())
        return out


class ConditionalUpdateOperator:
    """Route each sample by `condition(batch) -> (B,) bool` to `true_branch` or `false_branch`,
    then train every routed sample in ONE update of the policy.

    A branch is an operator or a list of operators; each runs on its own rows (skipped when it
    has none). An update operator in a branch (`UpdateOperator` and its subclasses, at most one
    per branch) only *prepares* its rows there — reference log-probs, critic values, advantages
    or pairs, with its own algorithm — and then one actor (and critic) update trains all rows
    together, each by its branch's loss normalised over its branch's rows, the step's loss being
    the sum of the branch losses (`phases.update_branches`). So a training step makes one
    optimizer and scheduler step (per mini-batch and epoch, as a plain update does), bumps the
    policy version once, and the old log-probs of every branch are those of the policy that
    generated the samples (taken before the update, once for the whole batch).

    Metrics are merged under `true/` and `false/` (a branch's own losses: `true/actor/pg_loss`,
    `true/actor/loss`); the update's shared ones (`actor/loss`, `actor/lr`, `actor/grad_norm`)
    keep their plain names. For group-based algorithms make the condition constant within a
    prompt's group (see `group_mean_at_least`).
    """

    def __init__(
        self,
        condition: Callable[[StepBatch], Tensor],
        true_branch: Operator | Sequence[Operator],
        false_branch: Operator | Sequence[Operator] | None = None,
    ):
        self.condition = condition
        self.branches = {"true": _as_stream(true_branch), "false": _as_stream(false_branch)}
        for name, stream in self.branches.items():
            if stream is None:
                continue
            if any(isinstance(op, ConditionalUpdateOperator) for op in stream.operators):
                raise ValueError(
                    f"ConditionalUpdateOperator: {name}_branch holds another ConditionalUpdateOperator"
                )
            if len(_updaters(stream)) > 1:
                raise ValueError(
                    f"ConditionalUpdateOperator: {name}_branch holds {len(_updaters(stream))} update operators; "
                    "one update per branch (a step trains once)"
                )

    def __call__(self, batch: StepBatch | None) -> StepBatch:
        from rlhf_trainer.dataflow import phases
        from rlhf_trainer.dataflow.context import timed

        if batch is None:
            raise ValueError("ConditionalUpdateOperator: nothing to route (put it after the rollout)")
        batch = phases.drop_invalid_rewards(batch)  # no failed reward reaches either branch
        mask = torch.as_tensor(self.condition(batch), dtype=torch.bool)
        if mask.dim() == 0:
            mask = mask.expand(len(batch))
        updaters = [u for s in self.branches.values() if s is not None for u in _updaters(s)]
        ctx = updaters[0].ctx if updaters else None
        if ctx is not None:  # old log-probs of the generating policy, before any branch trains
            with timed(batch.metrics, "old_log_probs"):
                for u in updaters:
                    batch = phases.policy_log_probs(ctx, batch, u.algorithm)
                batch = phases.behaviour_log_probs(ctx, batch)
                batch = phases.rollout_correction(ctx, batch)
        trained: list[tuple[str, Any, StepBatch]] = []
        for name, rows in (("true", mask), ("false", ~mask)):
            stream = self.branches[name]
            batch.metrics[f"{name}/samples"] = float(rows.sum())
            if stream is None or not rows.any():
                continue
            part = batch.select(rows)
            part.metrics = {}
            for op in stream.operators:
                prepare = getattr(op, "prepare", None)
                if prepare is not None:
                    part = prepare(part)
                    if len(part):  # online DPO may find no pair among its rows
                        trained.append((name, cast(Any, op).algorithm, part))
                else:
                    part = op(part)
            self._merge_metrics(batch, name, part.metrics)
        if ctx is not None and trained:
            self._update(ctx, batch, trained)
        elif ctx is not None:  # nothing to train on (online DPO without a pair): the policy stays
            phases.skip_update(ctx, batch)
        return batch

    @staticmethod
    def _merge_metrics(batch: StepBatch, name: str, metrics: dict[str, float]) -> None:
        for key, value in metrics.items():
            if key.startswith("timing/"):  # phases add up across branches: step time stays whole
                batch.metrics[key] = batch.metrics.get(key, 0.0) + value
            else:
                batch.metrics[f"{name}/{key}"] = value

    @staticmethod
    def _update(ctx: Any, batch: StepBatch, trained: list[tuple[str, Any, StepBatch]]) -> None:
        """The one update of the step over every branch's prepared rows."""
        from rlhf_trainer.dataflow import phases
        from rlhf_trainer.dataflow.context import timed

        merged, fillers = phases.merge_branches([(name, part) for name, _, part in trained])
        if len(merged) < len(ctx.actor):
            batch.metrics["update/skipped"] = 1.0  # fewer samples than actor ranks
            return
        branches = [
            phases.Branch(name, algorithm, filler) for (name, algorithm, _), filler in zip(trained, fillers)
        ]
        with timed(batch.metrics, "update"):
            done = phases.update_branches(ctx, merged, branches)
        for key, value in done.metrics.items():
            batch.metrics[key] = value

    def algorithms(self) -> list[Any]:
        return [a for s in self.branches.values() if s is not None for a in s.algorithms()]


def _updaters(stream: DataStream) -> list[Any]:
    """The operators of `stream` that prepare-then-update (`UpdateOperator`s)."""
    return [op for op in stream.operators if callable(getattr(op, "prepare", None))]


def group_mean_at_least(threshold: float, key: str = "scores") -> Callable[[StepBatch], Tensor]:
    """A condition: True for every sample of a group whose mean `key` is >= `threshold`."""

    def condition(batch: StepBatch) -> Tensor:
        group = batch["group_index"]
        _, inverse = torch.unique(group, return_inverse=True)
        sums = torch.zeros(int(inverse.max()) + 1).index_add_(0, inverse, batch[key].float())
        counts = torch.zeros_like(sums).index_add_(0, inverse, torch.ones(len(batch)))
        return (sums / counts)[inverse] >= threshold

    return condition


def _as_stream(branch: Operator | Sequence[Operator] | None) -> DataStream | None:
    if branch is None:
        return None
    if isinstance(branch, DataStream):
        return branch
    if isinstance(branch, Sequence):
        return DataStream(branch)
    return DataStream([branch])
