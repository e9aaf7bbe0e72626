"""Failure policy: which pod failures restart the training gang, and how long to back off.

A pod of the training gang (controller, actor, critic, reference, reward) that fails, is evicted,
or disappears with its node restarts every pod of the job from the last checkpoint, after an
exponential backoff, up to `failurePolicy.maxRestarts`; then the job is Failed. A rollout pod that
fails is replaced alone (see `rollout`), because the controller reshards around it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rlhf_operator import labels
from rlhf_trainer.spec import FailurePolicySpec


@dataclass(frozen=True)
class PodFailure:
    """Why one pod no longer counts: `reason` is one CamelCase word, `message` names the pod."""

    pod: str
    role: str
    reason: str
    message: str


def pod_failure(pod: dict[str, Any]) -> PodFailure | None:
    """The failure of an observed pod, or None while it is healthy (pending, running, succeeded)."""
    meta = pod.get("metadata") or {}
    status = pod.get("status") or {}
    name = meta.get("name", "")
    role = (meta.get("labels") or {}).get(labels.ROLE, "")
    if status.get("phase") == "Failed":
        reason = status.get("reason") or _terminated_reason(status) or "PodFailed"
        detail = status.get("message") or _terminated_reason(status) or "phase Failed"
        return PodFailure(name, role, reason, f"pod {name} failed: {detail}")
    if meta.get("deletionTimestamp"):
        disrupted = next(
            (c for c in status.get("conditions") or [] if c.get("type") == "DisruptionTarget"), None
        )
        reason = (disrupted or {}).get("reason") or "PodDeleted"
        return PodFailure(name, role, reason, f"pod {name} is being deleted ({reason})")
    return None


def missing_pod(name: str, role: str) -> PodFailure:
    """A gang pod that existed once (the job was past Pending) and is gone: lost with its node or deleted."""
    return PodFailure(
        name, role, "PodLost", f"pod {name} disappeared (its node was removed or it was deleted)"
    )


def _terminated_reason(status: dict[str, Any]) -> str | None:
    for cs in status.get("containerStatuses") or []:
        term = (cs.get("state") or {}).get("terminated")
        if term:
            return f"{term.get('reason', 'Error')} (exit code {term.get('exitCode')})"
    return None


def is_gang_role(role: str) -> bool:
    return role in labels.GANG_ROLES


def backoff_seconds(policy: FailurePolicySpec, restarts: int) -> float:
    """Delay before the pods of restart number `restarts` (1-based) are created: backoff, doubled each
    time, capped at maxBackoffSeconds."""
    if restarts <= 0:
        return 0.0
    return float(min(policy.backoff_seconds * 2 ** (restarts - 1), policy.max_backoff_seconds))


def exhausted(policy: FailurePolicySpec, restarts: int) -> bool:
    """True when another failure must fail the job instead of restarting it."""
    return restarts >= policy.max_restarts
