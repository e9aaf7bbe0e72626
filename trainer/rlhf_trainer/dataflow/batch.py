"""`StepBatch`: the samples of one step as they flow through the operators of a `DataStream`.

`tensors` holds per-row tensors under the algorithm library's batch keys (`response_mask`,
`scores`, `group_index`, `old_log_probs`, `ref_log_probs`, `old_values`, `advantages`, ...)
plus the rollout's `prompt_ids`, `prompt_mask`, `response_ids`, `rollout_log_probs` and
`policy_version`. Texts and the prompts' extra columns ride along for the reward functions.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor


@dataclass
class StepBatch:
    tensors: dict[str, Tensor]
    prompts: list[str]
    """Prompt text of each row."""
    responses: list[str] = field(default_factory=list)
    """Decoded response of each row."""
    columns: list[dict[str, Any]] = field(default_factory=list)
    """Extra dataset columns of each row's prompt (reward-function keyword arguments)."""
    metrics: dict[str, float] = field(default_factory=dict)
    """What the operators measured on this batch (namespaced keys)."""
    messages: list[list[dict[str, Any]] | None] = field(default_factory=list)
    """Each row's prompt as chat messages (`PromptItem.messages`; None for a plain-text prompt)."""

    def __len__(self) -> int:
        return int(self.tensors["response_mask"].shape[0])

    def __getitem__(self, key: str) -> Tensor:
        try:
            return self.tensors[key]
        except KeyError:
            raise KeyError(missing_key(key, self.tensors)) from None

    def __setitem__(self, key: str, value: Tensor) -> None:
        self.tensors[key] = value

    def __contains__(self, key: object) -> bool:
        return key in self.tensors

    def select(self, rows: Tensor) -> StepBatch:
        """The rows where `rows` (a bool mask or indices) selects; metrics are kept."""
        if rows.dtype == torch.bool:
            rows = rows.nonzero().squeeze(-1)
        idx = rows.tolist()
        n = len(self)
        return StepBatch(
            tensors={k: (v[rows] if v.dim() > 0 and v.shape[0] == n else v) for k, v in self.tensors.items()},
            prompts=[self.prompts[i] for i in idx],
            responses=[self.responses[i] for i in idx] if self.responses else [],
            columns=[self.columns[i] for i in idx] if self.columns else [],
            metrics=dict(self.metrics),
            messages=[self.messages[i] for i in idx] if self.messages else [],
        )

    def algorithm_batch(self) -> dict[str, Tensor]:
        """The tensors an algorithm and a training worker read (a shallow copy)."""
        return dict(self.tensors)


#: verl's names of batch keys (the seed tutorials' `condition=lambda x: x["reward"] > 0.8`): a
#: lookup by one of them fails naming the key to read instead.
VERL_KEYS = {
    "reward": "scores",  # (B,) each sample's combined reward
    "rewards": "scores",
    "old_log_prob": "old_log_probs",
    "ref_log_prob": "ref_log_probs",
    "adv": "advantages",
    "ret": "returns",
}


def missing_key(key: str, tensors: dict[str, Tensor]) -> str:
    """What a lookup of a key the batch lacks says: the key verl's name means here, or the keys."""
    if key in VERL_KEYS:
        ours = VERL_KEYS[key]
        return (
            f"batch key {key!r} is verl's name; here it is {ours!r}: read batch[{ours!r}] (docs/from-verl.md)"
        )
    return f"batch key {key!r} is not in this batch; keys: {', '.join(sorted(tensors))}"


def concat_batches(parts: list[StepBatch]) -> StepBatch:
    """The rows of several batches (rollout rounds of one step) as one: response tensors (B, T)
    right-padded to the widest with zeros, prompt tensors (`prompt_*`, B, P) left-padded, per-row
    vectors concatenated; `group_index` shifted so that each part's prompts stay groups of their
    own. Metrics: the first part's (the caller adds the rounds' counts)."""
    if not parts:
        raise ValueError("concat_batches: no batches given")
    keys = [k for k in parts[0].tensors if all(k in p.tensors for p in parts)]
    tensors: dict[str, Tensor] = {}
    for key in keys:
        pieces = [p[key] for p in parts]
        if pieces[0].dim() >= 2:
            width = max(x.shape[1] for x in pieces)
            left = key.startswith("prompt_")
            pieces = [
                torch.nn.functional.pad(x, (width - x.shape[1], 0) if left else (0, width - x.shape[1]))
                for x in pieces
            ]
        elif key == "group_index":
            shifted, offset = [], 0
            for x in pieces:
                shifted.append(x + offset)
                offset += int(x.max()) + 1 if len(x) else 0
            pieces = shifted
        tensors[key] = torch.cat(pieces)
    return StepBatch(
        tensors=tensors,
        prompts=[t for p in parts for t in p.prompts],
        responses=[t for p in parts for t in p.responses],
        columns=[c for p in parts for c in p.columns] if all(p.columns for p in parts) else [],
        metrics=dict(parts[0].metrics),
        messages=[m for p in parts for m in p.messages] if all(p.messages for p in parts) else [],
    )
