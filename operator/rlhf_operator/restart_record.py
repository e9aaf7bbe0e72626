"""The operator's own record of a job's gang restarts: annotations on the job, not its status.

`status.restarts` and `status.countedRestarts` are what users read, but the controller pod (the
user's image, with the job's ServiceAccount) may patch the job's status, and where the chart's
status-writers policy is absent nothing stops it from writing them. So the numbers the failure
policy acts on (the restart attempt of the pods, the backoff, `maxRestarts`) come from a record
the pod cannot write: the annotations `rlhf.dev/restarts` and `rlhf.dev/counted-restarts` on the
job itself (the job's Role lets the pod `get`/`watch` the job and patch only its status
subresource, which ignores metadata). Whoever may edit the job may edit them too; such a user
may as well raise `maxRestarts`, and the values are clamped like every other number.

The record is written by the executor right after the pass's status write and before any pod is
created, whenever it differs from what the pass counted. Until a job's first restart it carries
no record: then the count is the highest restart attempt among the pods the job owns (labels the
operator wrote when it created them; 0 for a new job), so a job an earlier release started keeps
its count across the upgrade, and a forged `status.restarts` counts for nothing in either case.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from rlhf_api import contract
from rlhf_operator import tenant_limits

RESTARTS = "rlhf.dev/restarts"
COUNTED_RESTARTS = "rlhf.dev/counted-restarts"


def _attempt(pod: Mapping[str, Any]) -> int:
    raw = ((pod.get("metadata") or {}).get("labels") or {}).get(contract.RESTART_ATTEMPT, "0")
    return int(raw) if isinstance(raw, str) and raw.isdigit() and len(raw) <= 9 else 0


def read(meta: Mapping[str, Any], owned_pods: Iterable[Mapping[str, Any]], most: int) -> tuple[int, int]:
    """(restarts, counted restarts) from the job's record, each within [0, most] and counted at
    most restarts; without a record, the owned pods' highest attempt, every restart counted."""
    notes = meta.get("annotations") or {}
    if RESTARTS not in notes:
        restarts = min(max((_attempt(p) for p in owned_pods), default=0), most)
        return restarts, restarts
    restarts = tenant_limits.clamp_int(notes.get(RESTARTS), 0, most)
    counted = tenant_limits.clamp_int(notes.get(COUNTED_RESTARTS, restarts), 0, restarts, default=restarts)
    return restarts, counted


def to_write(meta: Mapping[str, Any], restarts: int, counted: int) -> dict[str, str] | None:
    """The annotations to merge into the job, or None when its record already says so (or, for a
    job that never restarted, when there is nothing to record)."""
    notes = meta.get("annotations") or {}
    want = {RESTARTS: str(restarts), COUNTED_RESTARTS: str(counted)}
    if RESTARTS not in notes and restarts == 0:
        return None
    if all(notes.get(k) == v for k, v in want.items()):
        return None
    return want
