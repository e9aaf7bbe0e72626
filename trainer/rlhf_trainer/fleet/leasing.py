"""Prompt leasing: a step's prompts spread over the rollout replicas through one `PromptQueue`.

    leasing = PromptLeasing()
    outputs, positions = leasing.generate(replicas, prompts, n, step, on_lost=forget)
    batch, versions = rollout_tensors(outputs, positions)       # prompt order restored

Each replica leases a share, generates, and acks; a replica with nothing in flight leases again
while the queue holds prompts. A replica that dies while generating has its leases requeued for
the others (`on_lost` tells the fleet); when none is left, `refill` gives new ones (the fleet
starts replacements and waits for one), so the step completes with each prompt generated and
acked exactly once. `drain(name)` requeues whatever a leaving replica still holds.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from .queue import PromptQueue

log = logging.getLogger(__name__)


class PromptLeasing:
    """The fleet's prompt queue and the rollout loop over it. Items are positions in the step's
    prompt list; replicas are named (the queue's lease holders)."""

    def __init__(self) -> None:
        self.queue: PromptQueue[int] = PromptQueue()
        self.queue_depth = 0
        """Prompts the last step's rollout started with (the `queue_depth` signal)."""

    def generate(
        self,
        replicas: Mapping[str, Any],
        prompts: Sequence[Any],
        n: int,
        step: int,
        *,
        delay: float = 0.0,
        on_lost: Callable[[str, BaseException], None] | None = None,
        refill: Callable[[], Mapping[str, Any]] | None = None,
        greedy: bool = False,
        temperature: float | None = None,
    ) -> tuple[list[dict[str, Any]], list[list[int]]]:
        """`n` samples of every prompt (`data.PromptItem`s) from `replicas` (name -> Ray handle of
        a `RolloutWorker`). Returns each call's output and, per output, the positions in
        `prompts` of its prompts. `delay`: seconds per prompt added on every replica (test load).
        `refill()`: new replicas when none is left (raises when it cannot give any). `greedy`:
        temperature 0 (ReMax's baseline responses); `temperature`: in place of the rollout's."""
        import ray

        alive = dict(replicas)
        self.queue.enqueue(range(len(prompts)))
        self.queue_depth = self.queue.queued()
        if not alive and prompts:
            alive = self._refill(refill)
        share = math.ceil(len(prompts) / max(1, len(alive)))
        running: dict[Any, tuple[str, list[int], list[int]]] = {}
        outputs: list[dict[str, Any]] = []
        positions: list[list[int]] = []

        def lease(name: str) -> None:
            got = self.queue.lease(name, share)
            if got:
                ref = alive[name].generate.remote(
                    [prompts[p].ids for _, p in got], n, step, delay, greedy, temperature
                )
                running[ref] = (name, [pid for pid, _ in got], [p for _, p in got])

        for name in list(alive):
            lease(name)
        while running:
            (ref,), _ = ray.wait(list(running), num_returns=1)
            name, pids, pos = running.pop(ref)
            try:
                out = ray.get(ref)
            except ray.exceptions.RayActorError as err:
                back = self.queue.requeue_replica(name)
                log.warning(
                    "rollout replica %s died while generating (%s); %d prompts requeued", name, err, back
                )
                del alive[name]
                if on_lost is not None:
                    on_lost(name, err)
                if not alive:
                    try:
                        alive = self._refill(refill)
                    except RuntimeError as no_more:
                        raise no_more from err
                    share = math.ceil(self.queue.queued() / len(alive))
                for other in list(alive):
                    if self.queue.queued() and self.queue.in_flight(other) == 0:
                        lease(other)
                continue
            acked = self.queue.ack(name, pids)
            if not any(acked):
                continue
            if not all(acked):  # refused (this replica lost those leases): the requeued copies count
                out = keep_prompts(out, [i for i, ok in enumerate(acked) if ok])
            outputs.append(out)
            positions.append(pos)
            if self.queue.queued():
                lease(name)
        self.queue.check()
        done = sorted(ps[i] for out, ps in zip(outputs, positions) for i in sorted(set(out["prompt_index"])))
        if done != list(range(len(prompts))):
            raise RuntimeError(
                f"step {step}: prompts generated {done} are not each of 0..{len(prompts) - 1} once"
            )
        return outputs, positions

    @staticmethod
    def _refill(refill: Callable[[], Mapping[str, Any]] | None) -> dict[str, Any]:
        fresh = dict(refill()) if refill is not None else {}
        if not fresh:
            raise RuntimeError("every rollout replica died; nothing left to generate with")
        return fresh

    def drain(self, name: str) -> int:
        """Requeue every prompt leased to `name` (leaving or lost); returns how many."""
        return self.queue.requeue_replica(name)

    def metrics(self) -> dict[str, float]:
        c = self.queue.counters
        return {
            "rollout/queue_depth": float(self.queue_depth),
            "queue/enqueued": float(c.enqueued),
            "queue/leased": float(c.leased),
            "queue/acked": float(c.acked),
            "queue/requeued": float(c.requeued),
            "queue/stale_acks": float(c.stale_acks),
        }


def keep_prompts(out: dict[str, Any], keep: list[int]) -> dict[str, Any]:
    """The rows of one `generate` output whose prompt (index in that call) is in `keep`."""
    from rlhf_trainer.rollout import RolloutBatch

    version = out.pop("policy_version")
    batch = RolloutBatch.from_dict(out)
    rows = [r for r, i in enumerate(batch.prompt_index) if i in set(keep)]
    kept: dict[str, Any] = batch.select(rows).to_dict()
    kept["policy_version"] = version[torch.tensor(rows, dtype=torch.long)]
    return kept


def rollout_tensors(outputs: list[dict[str, Any]], positions: list[list[int]]) -> tuple[Any, torch.Tensor]:
    """One `RolloutBatch` of the fleet's outputs in prompt order, `prompt_index` the position of
    each row's prompt in the step's list; and the rows' policy versions."""
    from rlhf_trainer.rollout import RolloutBatch

    versions = [out.pop("policy_version") for out in outputs]
    parts = []
    for out, pos in zip(outputs, positions):
        part = RolloutBatch.from_dict(out)
        part.prompt_index = [pos[i] for i in part.prompt_index]
        parts.append(part)
    batch = RolloutBatch.concat(parts)
    version = torch.cat(versions)
    order = sorted(range(len(batch)), key=lambda r: batch.prompt_index[r])  # stable: samples stay in order
    return batch.select(order), version[torch.tensor(order, dtype=torch.long)]
