"""Gang scheduling: the job runs only when every pod of its gang is bound and running.

All pods are created together; while some wait for a node, the job is `Scheduling`. After
`scheduling.timeoutSeconds` the job reports `Unschedulable` with the scheduler's own message and,
per `scheduling.onTimeout`, keeps waiting or fails.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class GangState:
    total: int
    scheduled: int
    running: int
    #: The scheduler's message for the first unscheduled pod (for example `0/500 nodes are available: ...`).
    reason: str

    @property
    def all_scheduled(self) -> bool:
        return self.scheduled == self.total

    @property
    def all_running(self) -> bool:
        return self.running == self.total


def is_scheduled(pod: dict[str, Any]) -> bool:
    return bool((pod.get("spec") or {}).get("nodeName"))


def is_running(pod: dict[str, Any]) -> bool:
    return (pod.get("status") or {}).get("phase") == "Running" and not (pod.get("metadata") or {}).get(
        "deletionTimestamp"
    )


def scheduler_message(pod: dict[str, Any]) -> str | None:
    for cond in (pod.get("status") or {}).get("conditions") or []:
        if cond.get("type") == "PodScheduled" and cond.get("status") == "False":
            return f"{pod['metadata']['name']}: {cond.get('reason', 'Unschedulable')}: {cond.get('message', '')}".rstrip(
                ": "
            )
    return None


def gang_state(pods: list[dict[str, Any]], expected: int) -> GangState:
    """Scheduling state of the `expected` pods of the gang, of which `pods` are observed."""
    scheduled = sum(1 for p in pods if is_scheduled(p))
    running = sum(1 for p in pods if is_running(p))
    reason = next((m for p in pods if not is_scheduled(p) and (m := scheduler_message(p))), "")
    if not reason and scheduled < expected:
        waiting = sorted(p["metadata"]["name"] for p in pods if not is_scheduled(p))
        reason = "waiting for the scheduler: " + ", ".join(waiting[:5]) if waiting else "pods not created yet"
    return GangState(total=expected, scheduled=scheduled, running=running, reason=reason)


def timed_out(waited_seconds: float, timeout_seconds: int) -> bool:
    return waited_seconds >= timeout_seconds
