"""The elastic rollout fleet and the operator's half of the resharding protocol (DESIGN.md).

1. When the set of rollout pods changes (scale up, scale down, a replica replaced), the operator
   bumps `status.rollout.generation`.
2. The controller pod drains leaving replicas, rebuilds its weight-sync group and writes
   `status.rollout.syncedGeneration`.
3. Only then does the operator delete a leaving pod (index >= replicas).

Before the job runs (nothing to drain) leaving pods are deleted at once.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from rlhf_api import contract
from rlhf_operator.failure_policy import PodFailure, pod_failure


@dataclass
class RolloutPlan:
    generation: int
    #: Indices of rollout pods to create (missing below `desired`).
    create: list[int] = field(default_factory=list)
    #: Observed pods to delete (failed members, drained leavers).
    delete: list[dict[str, Any]] = field(default_factory=list)
    #: Leaving pods kept until the controller confirms the new generation.
    draining: list[str] = field(default_factory=list)
    #: Human-readable reasons for a generation bump (one Event each).
    changes: list[str] = field(default_factory=list)
    #: Failed members deleted this pass (one Warning Event each); they are recreated, and the
    #: generation bumped, once they are gone.
    failures: list[str] = field(default_factory=list)
    ready: int = 0


def index_of(pod: dict[str, Any]) -> int:
    return int((pod.get("metadata") or {}).get("labels", {}).get(contract.REPLICA_INDEX, "0"))


def plan_rollout(
    pods: list[dict[str, Any]],
    desired: int,
    previous_desired: int | None,
    generation: int,
    synced_generation: int,
    job_started: bool,
    failure_of: Callable[[dict[str, Any]], PodFailure | None] = pod_failure,
) -> RolloutPlan:
    """Decide the rollout fleet's changes from the observed rollout pods of the current attempt.

    `previous_desired` is the membership size the operator last recorded (None on the first pass);
    `job_started` is False while the gang is still being created (then nothing needs draining and a
    missing pod is simply not created yet). `failure_of` says which pods to replace (the
    reconcile passes one that also counts pods that cannot start, once a new pod may fare better).
    """
    plan = RolloutPlan(generation=max(generation, 1))
    if previous_desired is not None and previous_desired != desired:
        plan.changes.append(f"rollout replicas {previous_desired} -> {desired}")
    by_index = {index_of(p): p for p in pods}
    members_before = desired if previous_desired is None else previous_desired
    for i in range(desired):
        pod = by_index.get(i)
        if pod is None:
            plan.create.append(i)
            if job_started and i < members_before:
                plan.changes.append(f"rollout replica {i} lost; replacing it")
            continue
        failure = failure_of(pod)
        if failure is not None:
            if not (pod.get("metadata") or {}).get("deletionTimestamp"):
                plan.delete.append(pod)
                plan.failures.append(f"{failure.message}; replacing it")
        elif (pod.get("status") or {}).get("phase") == "Running":
            plan.ready += 1
    leaving = [p for i, p in sorted(by_index.items()) if i >= desired]
    if plan.changes:
        plan.generation += 1
    drained = synced_generation >= plan.generation or not job_started
    for pod in leaving:
        if (pod.get("metadata") or {}).get("deletionTimestamp"):
            continue
        if drained:
            plan.delete.append(pod)
        else:
            plan.draining.append(pod["metadata"]["name"])
    return plan
