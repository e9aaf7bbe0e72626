"""`CriticWorker`: one rank of the value model (the policy's backbone with a value head)."""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn

from rlhf_trainer.workers import modeling
from rlhf_trainer.workers.actor import AlgorithmCache
from rlhf_trainer.workers.training import TrainableWorker


class CriticWorker(TrainableWorker):
    role = "critic"

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.algorithms = AlgorithmCache()

    def build_model(self) -> nn.Module:
        return modeling.ValueModel(self.spec.model.critic_path or self.model_path, self.spec.model.dtype)

    def learning_rate(self) -> float:
        return self.spec.training.critic_learning_rate

    def compute_values(self, batch: dict[str, Tensor]) -> tuple[Tensor, Tensor]:
        """`old_values` of this rank's share of the batch."""
        self.model.eval()
        return self.forward_shard(batch, lambda b: modeling.token_values(self.model, b))

    def update(
        self,
        batch: dict[str, Tensor],
        step: int,
        algorithm: str,
        params: dict[str, Any],
        state: dict[str, Any],
    ) -> dict[str, float]:
        algo = self.algorithms.get(algorithm, params, state)

        def loss_fn(micro: dict[str, Any]) -> dict[str, Any]:
            values = modeling.token_values(self.model, micro)
            return algo.compute_value_loss({**micro, "values": values})  # type: ignore[no-any-return]

        return self.train_batch(batch, step, loss_fn)
