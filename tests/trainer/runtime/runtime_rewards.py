"""Reward functions used by the runtime tests (imported by the Ray reward workers by path)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def starts_with_one(prompts: Sequence[str], responses: Sequence[str], **_: Any) -> list[float]:
    """1.0 when the response starts with the digit 1: a signal any policy can learn in a few steps."""
    return [1.0 if r.strip().startswith("1") else 0.0 for r in responses]


def fails_on_seven(prompts: Sequence[str], responses: Sequence[str], **_: Any) -> list[float]:
    """Raises when a prompt contains a 7 (a reward with a bug)."""
    for p, r in zip(prompts, responses):
        if "7" in p:
            raise ValueError(f"cannot score response {r!r}")
    return [1.0 for _ in responses]
