"""`ReferenceWorker`: the frozen initial policy, scoring `ref_log_probs` for the KL term.

Replicas are independent (no process group, nothing to shard for a frozen model): the
controller gives each its share of the rows.
"""

from __future__ import annotations

from torch import Tensor

from rlhf_trainer.workers import modeling
from rlhf_trainer.workers.base import Worker


class ReferenceWorker(Worker):
    role = "reference"
    shards_batches = False

    def setup(self) -> None:
        self.model = modeling.load_policy(self.model_path, self.spec.model.dtype).to(self.device)
        self.model.eval()
        self.model.requires_grad_(False)
        if self.spec.training.max_tokens_per_micro_batch is not None:
            self.layout = modeling.forward_layout(self.model, self.device)

    def compute_log_probs(self, batch: dict[str, Tensor]) -> tuple[Tensor, Tensor]:
        temperature = self.spec.rollout.temperature
        return self.forward_shard(
            batch, lambda b: modeling.token_log_probs(self.model, b, temperature, layout=self.layout)[0]
        )
