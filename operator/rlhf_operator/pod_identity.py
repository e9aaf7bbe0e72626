"""Which uid, gid and fsGroup a job's pods run as: an operator setting, not the tenant's.

`RLHF_OPERATOR_POD_UID` (the chart's `tenants.podUser`) is one of:

* a number (default `1000`): every job's pods run as that uid, gid and fsGroup (the image's user);
* `per-job`: each job gets its own uid = gid = fsGroup, derived from the job's UID (stable across
  its restarts, so its checkpoints stay its own; two jobs share one only by a 1-in-2^30 chance),
  so two tenants' pods on one node are not one identity to the kernel or a shared volume;
* `platform`: none is set, the platform assigns them (OpenShift's `restricted-v2` SCC refuses a
  pod that asks for a uid outside the namespace's range, and gives it one from that range).

In every mode the pod keeps `runAsNonRoot` and the RuntimeDefault seccomp profile. The setting is
read when a pod is built and checked once at the operator's start (`rlhf operator` exits naming
it), so a wrong value never half-applies.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping
from typing import Any

ENV = "RLHF_OPERATOR_POD_UID"
DEFAULT_UID = 1000
PER_JOB = "per-job"
PLATFORM = "platform"
#: The per-job uids lie in [PER_JOB_BASE, PER_JOB_BASE + PER_JOB_SPAN): above the usual system
#: and login ranges, below 2^31 (what every runtime and filesystem takes as a uid).
PER_JOB_BASE = 1 << 16
PER_JOB_SPAN = 1 << 30
_VALID = f"valid: a uid >= 1, {PER_JOB!r} (one uid per job) or {PLATFORM!r} (the platform assigns it)"


def setting(env: Mapping[str, str] | None = None) -> int | str:
    """The operator's setting: a fixed uid, `per-job` or `platform`; ValueError naming it when bad."""
    raw = (os.environ if env is None else env).get(ENV, "").strip()
    if not raw:
        return DEFAULT_UID
    if raw in (PER_JOB, PLATFORM):
        return raw
    if raw.isdigit() and int(raw) >= 1:
        return int(raw)
    raise ValueError(f"{ENV}={raw!r} is not valid; {_VALID}")


def per_job_uid(job_uid: str) -> int:
    """The uid of a job's pods under `per-job`: a hash of the job's UID into the per-job range."""
    digest = hashlib.sha256(job_uid.encode()).digest()
    return PER_JOB_BASE + int.from_bytes(digest[:8], "big") % PER_JOB_SPAN


def security_context(job_uid: str, env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The pod-level securityContext of one job's pods."""
    mode = setting(env)
    out: dict[str, Any] = {"runAsNonRoot": True}
    if mode != PLATFORM:
        uid = per_job_uid(job_uid) if mode == PER_JOB else int(mode)
        out.update(runAsUser=uid, runAsGroup=uid, fsGroup=uid)
    out["seccompProfile"] = {"type": "RuntimeDefault"}
    return out
