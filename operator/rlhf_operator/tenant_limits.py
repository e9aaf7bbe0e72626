"""What one tenant may ask of the shared operator: bounds checked before anything is built.

The operator serves every namespace's jobs from one process, so a job's size is a claim on
everybody's operator. Two settings of the operator (flags of `rlhf operator`, or its environment;
the chart's values) bound what a job may ask for, beyond what the CRD already refuses:

* `RLHF_OPERATOR_MAX_PODS_PER_JOB` (`--max-pods-per-job`, default `spec.MAX_PODS_PER_JOB`): the
  most pods one job may have (the controller, every role's replicas and the rollout fleet's
  `maxReplicas`). Counted from the spec, before a single pod is built: a job above it Fails with
  reason `TooManyPods`, naming the bound, and costs the operator nothing more.
* `RLHF_OPERATOR_ALLOWED_HOST_PATHS` (`--allowed-host-paths`, comma-separated; empty by default):
  the node paths a job's `hostPath` volumes may name, each allowing itself and what lies below it
  (`/data` allows `/data/models`, not `/database`). Every tenant's pods run with the same uid, so
  a hostPath is a window onto the node and onto other tenants' pods (`/proc`, kubelet
  directories); by default none is allowed, and a job naming one Fails with reason
  `HostPathNotAllowed`, naming the path and what is allowed.

It also holds the guards on what a pod may have written: every number the operator reads from a
job's status is clamped (`clamp_int`) before arithmetic, and every condition message is clipped to
the schema's length (`clip`).
"""

from __future__ import annotations

import math
import posixpath
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from rlhf_api.fields import MAX_PODS_PER_JOB
from rlhf_api.job import JobSpec

MAX_PODS_ENV = "RLHF_OPERATOR_MAX_PODS_PER_JOB"
ALLOWED_HOST_PATHS_ENV = "RLHF_OPERATOR_ALLOWED_HOST_PATHS"
#: The longest condition message the CRD's schema accepts (`admission.MAX_STRING`): a longer one
#: makes the status patch fail with 422, on every pass.
MAX_MESSAGE = 4096
#: Roles whose pods mount the spec's volumes (the controller pod's settings are `controller`).
_POD_ROLES = ("controller", "actor", "critic", "reference", "reward", "rollout")


@dataclass(frozen=True)
class Limits:
    """The operator's bounds on one job (see the module's docstring)."""

    max_pods_per_job: int = MAX_PODS_PER_JOB
    allowed_host_paths: tuple[str, ...] = ()

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> Limits:
        raw = env.get(MAX_PODS_ENV, "").strip()
        try:
            max_pods = int(raw) if raw else MAX_PODS_PER_JOB
        except ValueError:
            raise ValueError(f"{MAX_PODS_ENV}={raw!r} is not valid; valid: a positive integer") from None
        if max_pods < 1:
            raise ValueError(f"{MAX_PODS_ENV}={raw!r} is not valid; valid: a positive integer")
        paths = tuple(p.strip() for p in env.get(ALLOWED_HOST_PATHS_ENV, "").split(",") if p.strip())
        bad = [p for p in paths if not p.startswith("/")]
        if bad:
            raise ValueError(f"{ALLOWED_HOST_PATHS_ENV}: {bad[0]!r} is not valid; valid: absolute paths")
        return cls(max_pods, paths)


def pod_count(spec: JobSpec) -> int:
    """The most pods the job can have: the controller, every role's replicas and, when the fleet is
    separate, the rollout's maxReplicas (it may scale up to it). Arithmetic only: nothing is built."""
    roles = spec.roles
    gang = sum(getattr(roles, r).replicas for r in ("actor", "critic", "reference", "reward"))
    fleet = (
        max(roles.rollout.max_replicas, roles.rollout.replicas) if roles.placement == "disaggregated" else 0
    )
    return 1 + gang + fleet


def host_path_allowed(path: str, allowed: tuple[str, ...]) -> bool:
    """`path` is one of `allowed` or lies below one, on a path boundary; a path that climbs (`..`)
    is never allowed."""
    if ".." in path.split("/"):
        return False
    target = posixpath.normpath(path)
    for prefix in allowed:
        base = posixpath.normpath(prefix)
        if target == base or base == "/" or target.startswith(base + "/"):
            return True
    return False


def host_paths(spec: JobSpec) -> list[tuple[str, str]]:
    """(manifest path of the volume, node path) of every hostPath volume the job's pods mount."""
    out: dict[tuple[str, str], None] = {}
    for role in _POD_ROLES:
        for where, settings in spec.pod_settings(role):
            for i, v in enumerate(settings.volumes):
                if v.host_path is not None:
                    out[(f"{where}.volumes[{i}].hostPath.path", v.host_path.path)] = None
    return list(out)


def refusal(spec: JobSpec, limits: Limits) -> tuple[str, str] | None:
    """(reason, message) when the operator will not run the job as it stands, else None."""
    pods = pod_count(spec)
    if pods > limits.max_pods_per_job:
        return (
            "TooManyPods",
            f"spec.roles: the job asks for {pods} pods (the controller, every role's replicas and "
            f"rollout.maxReplicas); this operator runs at most {limits.max_pods_per_job} pods per job "
            f"({MAX_PODS_ENV}); lower the replicas, then re-create the job",
        )
    refused = [
        (where, p) for where, p in host_paths(spec) if not host_path_allowed(p, limits.allowed_host_paths)
    ]
    if refused:
        where, path = refused[0]
        allowed = ", ".join(limits.allowed_host_paths) or "none"
        return (
            "HostPathNotAllowed",
            f"{where}: hostPath {path!r} is not allowed by this operator (allowed host paths: {allowed}; "
            f"{ALLOWED_HOST_PATHS_ENV}, the chart's allowedHostPaths); use a PersistentVolumeClaim, "
            "or ask the cluster's administrator to allow the path",
        )
    return None


def clamp_int(value: Any, low: int, high: int, default: int = 0) -> int:
    """`value` as an integer within [low, high]; `default` when it is not a finite number (a
    string, a list, NaN: whatever a pod may have written into the status)."""
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        return default
    try:
        number = float(value) if isinstance(value, str) else value
    except ValueError:
        return default
    if isinstance(number, float):
        if not math.isfinite(number):
            return default
        number = int(number)
    return max(low, min(high, number))


def clip(message: str, limit: int = MAX_MESSAGE) -> str:
    """`message` cut to `limit` characters, marked as cut."""
    return message if len(message) <= limit else message[: limit - 14] + " ... (clipped)"
