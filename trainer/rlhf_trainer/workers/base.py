"""What every role's worker shares: its rank, its process group, its device, per-step seeding,
and the sharded no-grad forward used to score a batch.

Worker classes are plain Python classes; `WorkerGroup` turns them into Ray actors. That keeps
them testable in-process and keeps Ray out of their code.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from rlhf_api.job import JobSpec
from rlhf_trainer.workers import batching, distributed


class Worker:
    """One rank of a role."""

    role = "worker"
    #: Ranks share one batch (a sharded role). Independent replicas score all rows they are given.
    shards_batches = True
    #: How micro-batches run through the model (`modeling.forward_layout`): `padded` unless
    #: `spec.training.maxTokensPerMicroBatch` is set, then `packed` or `trimmed`.
    layout: str = "padded"

    def __init__(
        self,
        spec: JobSpec,
        rank: int = 0,
        world_size: int = 1,
        model_path: str | None = None,
        device: str | None = None,
    ):
        distributed.set_threads()
        self.spec = spec
        self.rank = rank
        self.world_size = world_size
        self.model_path = model_path or spec.model.path
        self.device = distributed.worker_device(device, self.role)

    # -- rendezvous (called by WorkerGroup before `setup`) --------------------------------------
    def pick_store_address(self) -> tuple[str, int]:
        return distributed.pick_store_address()

    def init_group(self, address: tuple[str, int]) -> None:
        distributed.init_group(address, self.rank, self.world_size, self.device)

    def setup(self) -> None:
        """Load models; overridden per role."""

    def ready(self) -> bool:
        return True

    def compute(self) -> Any:
        """The context forward passes run in (trained roles: their mixed precision)."""
        return contextlib.nullcontext()

    def seed(self, step: int, stream: int = 0) -> None:
        distributed.seed_everything(distributed.step_seed(self.spec.training.seed, step, self.rank, stream))

    def seed_generation(self, engine: Any, step: int) -> None:
        """Seed the generation of `step`'s samples: `engine`'s sampler (stream 1), and Python's,
        NumPy's and torch's global generators (stream 2), which a multi-turn environment's
        `step` draws from. A resumed run then replays the step's episodes, the environment's
        draws included, whichever step its process starts at (`rollout.multiturn`)."""
        engine.set_seed(distributed.step_seed(self.spec.training.seed, step, self.rank, stream=1))
        self.seed(step, stream=2)

    def to_device(self, batch: dict[str, Any]) -> dict[str, Any]:
        return {k: (v.to(self.device) if isinstance(v, Tensor) else v) for k, v in batch.items()}

    @torch.no_grad()
    def forward_shard(
        self, batch: dict[str, Tensor], fn: Callable[[dict[str, Tensor]], Tensor]
    ) -> tuple[Tensor, Tensor]:
        """Run `fn` over this rank's share of `batch` in micro-batches; returns `(rows, outputs)`.

        Every rank runs the same number of forward passes (FSDP all-gathers in each), so the
        controller calls all ranks with the same batch and stitches the outputs by `rows`.
        Micro-batches hold `microBatchSize` rows, or with a `layout` other than `padded` at most
        `maxTokensPerMicroBatch` tokens (an empty one runs a row of this rank, its output unused).
        """
        rank, world = (self.rank, self.world_size) if self.shards_batches else (0, 1)
        rows = torch.arange(batching.row_count(batch))
        my_units, total = batching.shard_for_rank(batch, rows, rank, world)
        budget = self.spec.training.max_tokens_per_micro_batch
        if budget is not None and self.layout != "padded":
            micros = batching.token_micro_batches(batch, rows, rank, world, budget)
        else:
            micros = batching.micro_batches(my_units, total, world, self.spec.training.micro_batch_size)
        outs, done = [], []
        for micro in micros:
            filler = micro.numel() == 0
            part = self.to_device(batching.select_rows(batch, my_units[0] if filler else micro))  # type: ignore[arg-type]
            with self.compute():
                out = fn(part).float().cpu()  # type: ignore[arg-type]
            if not filler:
                outs.append(out)
                done.append(micro)
        width = max(o.shape[1] for o in outs)
        outs = [torch.nn.functional.pad(o, (0, width - o.shape[1])) for o in outs]
        return torch.cat(done), torch.cat(outs)


def stitch(results: list[tuple[Tensor, Tensor]], rows: int) -> Tensor:
    """Reassemble per-rank `(rows, outputs)` from `forward_shard` into one (B, ...) tensor."""
    first = results[0][1]
    out = torch.zeros((rows, *first.shape[1:]), dtype=first.dtype)
    for idx, values in results:
        out[idx] = values
    return out
