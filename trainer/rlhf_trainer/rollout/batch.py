"""`RolloutBatch`: what a rollout engine hands to the rest of the step.

Layout (B responses, P prompt tokens, T response tokens)::

    prompt_ids     (B, P)  long   left-padded with the pad id
    prompt_mask    (B, P)  long   1 on real prompt tokens, 0 on padding
    response_ids   (B, T)  long   right-padded with the pad id after the stop
    response_mask  (B, T)  float  1.0 on every generated token up to and including EOS, 0.0 after
    log_probs      (B, T)  float  log-prob of each sampled token under the engine's sampling
                                  distribution (see `rollout.sampling.sampling_log_probs`); 0.0
                                  where `response_mask` is 0
    prompt_index   list[int]      row -> index of its prompt in the list given to `generate`

Multi-turn rollouts (`rollout.multiturn`) add, where the environment wrote tokens into the response::

    observation_mask (B, T) float 1.0 on the environment's tokens (response_mask is 0 there:
                                  not trained on, but attended to: `real_response_mask`)
    turn_rewards     (B, T) float each environment reward on the last model token of its turn
    turns            (B,)   long  model turns of each episode

Prompt and response concatenated (`sequences`) are the tokens the actor scores: position `P + t`
of the sequence holds `response_ids[:, t]`, predicted from the logits at position `P + t - 1`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class RolloutBatch:
    """B sampled responses with their prompts. See the module docstring for shapes."""

    prompt_ids: torch.Tensor
    """(B, P) long, left-padded with `pad_token_id`."""
    prompt_mask: torch.Tensor
    """(B, P) long, 1 on prompt tokens."""
    response_ids: torch.Tensor
    """(B, T) long, right-padded with `pad_token_id`."""
    response_mask: torch.Tensor
    """(B, T) float, 1.0 up to and including the EOS token (or the last token when cut at max tokens)."""
    log_probs: torch.Tensor
    """(B, T) float32, log-prob of each sampled token under the sampling distribution; 0 on padding."""
    prompt_index: list[int] = field(default_factory=list)
    """Row -> index of its prompt in the `generate` call (rows of one prompt are adjacent)."""
    pad_token_id: int = 0
    """The pad id used on both sides; `concat` re-pads with it."""
    finished: torch.Tensor | None = None
    """(B,) bool, True where the response ended with EOS (False: cut at max tokens)."""
    observation_mask: torch.Tensor | None = None
    """(B, T) float, multi-turn: 1.0 on the tokens the environment wrote (see the module docstring)."""
    turn_rewards: torch.Tensor | None = None
    """(B, T) float, multi-turn: the environment's rewards, on the last model token of each turn."""
    turns: torch.Tensor | None = None
    """(B,) long, multi-turn: model turns per episode."""

    def __post_init__(self) -> None:
        b = self.prompt_ids.shape[0]
        for name in ("prompt_mask", "response_ids", "response_mask", "log_probs"):
            t = getattr(self, name)
            if t.shape[0] != b:
                raise ValueError(f"RolloutBatch.{name} has {t.shape[0]} rows, prompt_ids has {b}")
        for name in PER_TOKEN_EXTRAS:
            t = getattr(self, name)
            if t is not None and t.shape != self.response_ids.shape:
                raise ValueError(
                    f"RolloutBatch.{name} has shape {tuple(t.shape)}, response_ids {tuple(self.response_ids.shape)}"
                )
        if (
            self.response_ids.shape != self.response_mask.shape
            or self.response_ids.shape != self.log_probs.shape
        ):
            raise ValueError(
                "RolloutBatch: response_ids, response_mask and log_probs must share a shape, got "
                f"{tuple(self.response_ids.shape)}, {tuple(self.response_mask.shape)}, {tuple(self.log_probs.shape)}"
            )
        if self.prompt_index and len(self.prompt_index) != b:
            raise ValueError(f"RolloutBatch.prompt_index has {len(self.prompt_index)} entries for {b} rows")

    def __len__(self) -> int:
        return int(self.prompt_ids.shape[0])

    @property
    def response_lengths(self) -> torch.Tensor:
        """(B,) long: generated tokens per row, EOS included."""
        return self.response_mask.sum(-1).long()

    @property
    def num_tokens(self) -> int:
        """Generated tokens in the batch (EOS included, padding excluded)."""
        return int(self.response_mask.sum().item())

    def sequences(self) -> tuple[torch.Tensor, torch.Tensor]:
        """`(input_ids, attention_mask)`, both (B, P+T): prompt then response, as the actor scores them."""
        ids = torch.cat([self.prompt_ids, self.response_ids], dim=1)  # (B, P+T)
        real = real_response_mask(self.response_mask, self.observation_mask)
        mask = torch.cat([self.prompt_mask.long(), real.long()], dim=1)  # (B, P+T)
        return ids, mask

    def to(self, device: torch.device | str) -> RolloutBatch:
        moved: dict[str, Any] = {
            f.name: (v.to(device) if isinstance(v := getattr(self, f.name), torch.Tensor) else v)
            for f in dataclasses.fields(self)
        }
        return RolloutBatch(**moved)

    def to_dict(self) -> dict[str, Any]:
        """Plain mapping (tensors, lists, ints), e.g. for Ray transport or `from_dict`."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RolloutBatch:
        return cls(**data)

    def select(self, rows: Sequence[int] | torch.Tensor) -> RolloutBatch:
        """The sub-batch of `rows` (prompt_index values are kept as they are)."""
        idx = torch.as_tensor(list(rows) if not isinstance(rows, torch.Tensor) else rows, dtype=torch.long)
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if isinstance(v, torch.Tensor):
                out[f.name] = v[idx.to(v.device)]
            elif f.name == "prompt_index":
                out[f.name] = [v[i] for i in idx.tolist()] if v else []
            else:
                out[f.name] = v
        return RolloutBatch(**out)

    @staticmethod
    def concat(batches: Sequence[RolloutBatch], offset_prompt_index: bool = False) -> RolloutBatch:
        """Stack batches row-wise, re-padding prompts on the left and responses on the right.

        With `offset_prompt_index`, the prompt indices of each batch are shifted past those of the
        previous ones (use it when each batch came from its own `generate` call over different prompts).
        """
        if not batches:
            raise ValueError("RolloutBatch.concat: no batches given")
        pad = batches[0].pad_token_id
        p_len = max(b.prompt_ids.shape[1] for b in batches)
        t_len = max(b.response_ids.shape[1] for b in batches)

        def left(t: torch.Tensor, width: int, value: float) -> torch.Tensor:
            return torch.nn.functional.pad(t, (width - t.shape[1], 0), value=value)

        def right(t: torch.Tensor, width: int, value: float) -> torch.Tensor:
            return torch.nn.functional.pad(t, (0, width - t.shape[1]), value=value)

        index: list[int] = []
        shift = 0
        for b in batches:
            index.extend(i + shift for i in b.prompt_index)
            if offset_prompt_index and b.prompt_index:
                shift += max(b.prompt_index) + 1
        finished = None
        if all(b.finished is not None for b in batches):
            finished = torch.cat([b.finished for b in batches if b.finished is not None])
        extras: dict[str, torch.Tensor | None] = {}
        for name in PER_TOKEN_EXTRAS:  # absent from a part (a single-turn engine): zeros there
            if any(getattr(b, name) is not None for b in batches):
                extras[name] = torch.cat(
                    [right(_or_zeros(getattr(b, name), b.response_mask), t_len, 0.0) for b in batches]
                )
        if all(b.turns is not None for b in batches):
            extras["turns"] = torch.cat([b.turns for b in batches if b.turns is not None])
        return RolloutBatch(
            prompt_ids=torch.cat([left(b.prompt_ids, p_len, pad) for b in batches]),
            prompt_mask=torch.cat([left(b.prompt_mask, p_len, 0) for b in batches]),
            response_ids=torch.cat([right(b.response_ids, t_len, pad) for b in batches]),
            response_mask=torch.cat([right(b.response_mask, t_len, 0.0) for b in batches]),
            log_probs=torch.cat([right(b.log_probs, t_len, 0.0) for b in batches]),
            prompt_index=index,
            pad_token_id=pad,
            finished=finished,
            **extras,
        )


#: Optional (B, T) fields of multi-turn rollouts.
PER_TOKEN_EXTRAS = ("observation_mask", "turn_rewards")


def _or_zeros(t: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    return torch.zeros_like(like, dtype=torch.float32) if t is None else t


def real_response_mask(response_mask: torch.Tensor, observation_mask: torch.Tensor | None) -> torch.Tensor:
    """(B, T) bool: the response's real tokens, the model's (`response_mask`, the loss mask) and the
    environment's (`observation_mask`): what attention sees and positions count. One rule for the
    engines' batches and the trainer's forward passes (`workers.modeling.sequence_inputs`)."""
    real = response_mask > 0
    return real if observation_mask is None else real | (observation_mask > 0)


def decode_responses(batch: RolloutBatch, tokenizer: Any) -> list[str]:
    """Response texts, special tokens (EOS, padding) removed; a multi-turn response holds every
    turn, the environment's included."""
    out = []
    real = real_response_mask(batch.response_mask, batch.observation_mask)
    for ids, mask in zip(batch.response_ids.tolist(), real.tolist()):
        kept = [t for t, m in zip(ids, mask) if m]
        out.append(tokenizer.decode(kept, skip_special_tokens=True))
    return out
