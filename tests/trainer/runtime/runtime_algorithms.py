"""Algorithms used by the runtime tests (imported by the Ray workers by path)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

from rlhf_trainer.algorithms.builtin import GRPO


class RecordingGRPO(GRPO):
    """GRPO that records, in the driver's process, each `update_step` call and what it saw."""

    calls: ClassVar[list[dict[str, float]]] = []

    def update_step(self, loss_dict: Mapping[str, Any]) -> None:
        RecordingGRPO.calls.append(
            {k: float(loss_dict[k]) for k in ("actor/optimizer_steps", "batch/num_samples")}
        )
        super().update_step(loss_dict)
