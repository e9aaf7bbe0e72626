"""Suspend: `spec.suspend: true` removes every pod (checkpoints live on the shared volume and stay);
setting it back to false recreates the pods, which resume from the latest checkpoint."""

from __future__ import annotations

from typing import Any


def pods_to_remove(pods: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every pod not already being deleted."""
    return [p for p in pods if not (p.get("metadata") or {}).get("deletionTimestamp")]


def resumed(previous_phase: str, suspend: bool) -> bool:
    """True on the pass that ends a suspension."""
    return previous_phase == "Suspended" and not suspend
