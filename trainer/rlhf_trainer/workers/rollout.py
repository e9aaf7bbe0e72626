"""`RolloutWorker`: a generation engine of the disaggregated rollout fleet.

The sync seam: after each policy update the controller calls `push_weights(named_tensors,
version)` on every member (today a plain object-store broadcast; the elastic resharding of the
weight-sync group plugs in behind this same method). Every sample carries the policy version it
was generated with.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from rlhf_trainer.workers.base import Worker
from rlhf_trainer.workers.distributed import step_seed


class RolloutWorker(Worker):
    role = "rollout"

    def setup(self) -> None:
        from rlhf_trainer.rollout import build_engine

        self.engine = build_engine(
            self.spec.rollout,
            self.model_path,
            self.spec.model.dtype,
            self.device,
            seed=self.spec.training.seed,
            tokenizer_path=self.spec.model.tokenizer,
        )
        self.version = 0

    def push_weights(self, named_tensors: dict[str, Tensor], version: int) -> int:
        """Load new policy weights; later samples carry `version`. Returns the tensors loaded."""
        loaded = self.engine.load_weights(named_tensors.items())
        self.version = version
        return int(loaded)

    def generate(self, prompt_ids: list[list[int]], n: int, step: int) -> dict[str, Any]:
        self.engine.set_seed(step_seed(self.spec.training.seed, step, self.rank, stream=1))
        out = self.engine.generate(prompt_ids, n).to_dict()
        out["policy_version"] = torch.full((len(out["prompt_index"]),), self.version, dtype=torch.long)
        return out  # type: ignore[no-any-return]
