"""Suspend: `spec.suspend: true` removes every pod (checkpoints live on the shared volume and stay);
setting it back to false recreates the pods, which resume from the latest checkpoint.

A resume may come while the suspension's pods are still terminating (their grace period, a
finalizer, a slow kubelet). Those pods are not failures: the resumed job is Pending, waits for
their names to free, then creates the gang afresh. Counting them would make suspend/resume cost a
gang restart, and, repeated, fail the job on `maxRestarts` (Kueue suspends and resumes jobs as a
matter of course).
"""

from __future__ import annotations

from typing import Any


def pods_to_remove(pods: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every pod not already being deleted."""
    return [p for p in pods if not (p.get("metadata") or {}).get("deletionTimestamp")]


def resumed(previous_phase: str, suspend: bool) -> bool:
    """True on the pass that ends a suspension."""
    return previous_phase == "Suspended" and not suspend


def awaiting_removal(pod: dict[str, Any], phase: str) -> bool:
    """True for a pod being deleted while the job is Pending (resumed, or its gang not yet all
    created): wait for it to go and create it again, without a gang restart. Once the gang has
    started (Scheduling, Running) a pod deleted under it is a failure (`failure_policy`)."""
    return phase == "Pending" and bool((pod.get("metadata") or {}).get("deletionTimestamp"))
