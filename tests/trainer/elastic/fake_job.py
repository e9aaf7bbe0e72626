"""`FakeJob`: the job reader the membership tests give `ClusterMembership` instead of the API server."""

from __future__ import annotations

from typing import Any


class FakeJob:
    """A `JobReader` over an in-memory job object; `fail_reads`/`fail_patches` make the next
    calls raise, as an unreachable API server would."""

    def __init__(self, desired: int | None = None, generation: int = 0, spec_replicas: int = 1):
        self.job: dict[str, Any] = {"spec": {"roles": {"rollout": {"replicas": spec_replicas}}}, "status": {}}
        if generation:
            self.operator_writes(desired if desired is not None else spec_replicas, generation)
        self.patches: list[dict[str, Any]] = []
        self.fail_reads = 0
        self.fail_patches = 0

    def operator_writes(self, desired: int, generation: int) -> None:
        """What the operator's reconcile records when the rollout pod set changes."""
        rollout = self.job["status"].setdefault("rollout", {})
        rollout.update(desired=desired, generation=generation)
        self.job["spec"]["roles"]["rollout"]["replicas"] = desired

    def read(self) -> dict[str, Any]:
        if self.fail_reads:
            self.fail_reads -= 1
            raise ConnectionError("apiserver unreachable")
        return self.job

    def patch_status(self, patch: dict[str, Any]) -> None:
        if self.fail_patches:
            self.fail_patches -= 1
            raise ConnectionError("apiserver unreachable")
        self.patches.append(patch)
        self.job["status"]["rollout"].update(patch["status"]["rollout"])

    @property
    def synced(self) -> list[int]:
        return [p["status"]["rollout"]["syncedGeneration"] for p in self.patches]
