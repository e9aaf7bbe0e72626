"""`CriticWorker`: one rank of the value model (the policy's backbone with a value head)."""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn

from rlhf_trainer.workers import modeling
from rlhf_trainer.workers.actor import AlgorithmCache
from rlhf_trainer.workers.training import TrainableWorker, UpdateBranch, branch_losses


class CriticWorker(TrainableWorker):
    role = "critic"

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.algorithms = AlgorithmCache()

    def build_model(self, meta: bool = False) -> nn.Module:
        # fp32 master weights; `spec.model.dtype` is the compute dtype (see `TrainableWorker`)
        return modeling.ValueModel(self.spec.model.critic_path or self.model_path, "float32", meta=meta)

    def learning_rate(self) -> float:
        return self.spec.training.critic_learning_rate

    def compute_values(self, batch: dict[str, Tensor]) -> tuple[Tensor, Tensor]:
        """`old_values` of this rank's share of the batch."""
        self.model.eval()
        return self.forward_shard(batch, lambda b: modeling.token_values(self.model, b, layout=self.layout))

    def update(self, batch: dict[str, Tensor], step: int, branches: list[UpdateBranch]) -> dict[str, float]:
        """The value update of one training step (rows of the branches whose algorithm has a critic)."""
        algos = [self.algorithms.get(b.algorithm, b.params, b.state) for b in branches]

        def loss_of(algo: Any, micro: dict[str, Any]) -> dict[str, Any]:
            return algo.compute_value_loss(micro)  # type: ignore[no-any-return]

        def loss_fn(micro: dict[str, Any]) -> dict[str, Any]:
            values = modeling.token_values(self.model, micro, layout=self.layout)
            return branch_losses({**micro, "values": values}, branches, algos, loss_of, self.role)

        return self.train_batch(batch, step, loss_fn, branches=len(branches))
