"""Which worker asks Ray for which resources: a pure function of the job spec (torch-free, Ray-free).

Every role's ranks ask for the GPUs that role's `resources.gpus` names — never for what the
driver happens to see (on a cluster the driver is the GPU-less controller pod):

| role | ranks | GPUs per rank | where (cluster) |
|---|---|---|---|
| actor, critic, reference, reward | `replicas × max(1, gpus)` | 1 when `gpus > 0`, else 0 | one rank per GPU of each pod |
| rollout | one per replica (fleet slot) | `gpus` (one engine over the pod's GPUs) | its slot's pod |

On a cluster (the driver runs with `RLHF_ROLE=controller`) each rank also asks for one unit of
its role's Ray resource, which a pod of the role advertises `contract.ranks_per_pod` times, so
exactly that many ranks land on each pod; its CPU ask is its share of the pod's CPUs. Locally
no custom resource is asked, and a spec without GPUs runs on CPU as before.

A rank uses CUDA exactly when it asked for GPUs (`RolePlacement.device`): Ray then sets its
`CUDA_VISIBLE_DEVICES`, so its GPU is `cuda:0`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from rlhf_api import contract

#: Fractional Ray resources have 4 decimals; shares are rounded down so n of them fit in 1.
_RAY_RESOLUTION = 10_000


def _share(total: float, parts: int) -> float:
    """`total / parts`, rounded down to Ray's resolution (n shares never exceed the total)."""
    return math.floor(total * _RAY_RESOLUTION / parts) / _RAY_RESOLUTION


@dataclass(frozen=True)
class RolePlacement:
    """What the ranks of one role ask Ray for (`ray.remote(num_cpus=, num_gpus=, resources=)`)."""

    role: str
    #: Ray actors started for the role (its process group's world size when sharded).
    ranks: int
    #: Logical CPUs each rank asks for.
    num_cpus: float
    #: GPUs each rank asks for (whole GPUs; Ray sets CUDA_VISIBLE_DEVICES to them).
    num_gpus: int
    #: Custom resources each rank asks for (the role pod's `rlhf.dev/role-<role>`; none locally).
    resources: dict[str, float] = field(default_factory=dict)

    @property
    def device(self) -> str:
        """Where the rank computes: `cuda` when it was given GPUs, else `cpu`."""
        return "cuda" if self.num_gpus > 0 else "cpu"

    def ray_options(self) -> dict[str, Any]:
        """Keyword arguments of `ray.remote` / `.options` for one rank."""
        return {"num_cpus": self.num_cpus, "num_gpus": self.num_gpus, "resources": dict(self.resources)}


def on_cluster() -> bool:
    """The driver runs in the job's controller pod (the operator sets RLHF_ROLE=controller)."""
    return contract.ENV_ROLE.get() == contract.CONTROLLER_ROLE


def role_placement(
    spec: Any,
    role: str,
    *,
    cluster: bool,
    replicas: int | None = None,
    worker_cpus: float | None = None,
) -> RolePlacement:
    """The placement of `role`'s ranks for `spec` (a `JobSpec`).

    `replicas` overrides the role's pod count (the rollout fleet's current size comes from its
    membership source, not the spec); `worker_cpus` is the local CPU ask per rank (default
    RLHF_WORKER_CPUS), also the upper bound of a rank's share of its pod's CPUs on a cluster.
    """
    if role not in contract.ROLES:
        raise ValueError(f"unknown role {role!r}; valid: {', '.join(contract.ROLES)}")
    role_spec = getattr(spec.roles, role)
    gpus = int(role_spec.resources.gpus)
    pods = max(1, role_spec.replicas if replicas is None else replicas)
    per_pod = contract.ranks_per_pod(role, gpus)
    cpus = contract.ENV_WORKER_CPUS.get_float() if worker_cpus is None else worker_cpus
    resources: dict[str, float] = {}
    if cluster:
        resources = {contract.ray_role_resource(role): 1.0}
        cpus = min(cpus, _share(contract.ray_cpus(role_spec.resources.cpu), per_pod))
    return RolePlacement(
        role=role,
        ranks=pods * per_pod,
        num_cpus=cpus,
        num_gpus=gpus // per_pod,  # rank-per-GPU roles: 1 (or 0); rollout: the pod's GPUs
        resources=resources,
    )


#: Weight-sync backends (`RLHF_SYNC_BACKEND`).
SYNC_BACKENDS = ("gloo", "nccl")


def sync_backend(requested: str, actor_device: str, rollout_device: str) -> str:
    """The weight-sync backend every member of the sync group uses, decided once by the controller:
    `requested` (RLHF_SYNC_BACKEND), checked against where the actor and the replicas compute."""
    if requested not in SYNC_BACKENDS:
        raise ValueError(
            f"{contract.ENV_SYNC_BACKEND.name}={requested!r} is not a weight-sync backend; valid: "
            + ", ".join(SYNC_BACKENDS)
        )
    if requested == "nccl" and (actor_device != "cuda" or rollout_device != "cuda"):
        raise ValueError(
            f"{contract.ENV_SYNC_BACKEND.name}=nccl needs the actor and the rollout replicas on GPUs "
            f"(spec.roles.actor.resources.gpus and spec.roles.rollout.resources.gpus >= 1); the actor "
            f"runs on {actor_device}, the rollout on {rollout_device}: use gloo"
        )
    return requested


def job_gpus(placements: list[RolePlacement]) -> int:
    """GPUs the placed ranks ask for in all."""
    return sum(p.ranks * p.num_gpus for p in placements)


def check_local_gpus(placements: list[RolePlacement], available: float) -> None:
    """A local run asking for more GPUs than this Ray instance has would wait forever for them:
    fail at once, naming what asked for them."""
    wanted = job_gpus(placements)
    if wanted > available:
        asks = ", ".join(
            f"{p.role}: {p.ranks} rank(s) × {p.num_gpus} GPU" for p in placements if p.num_gpus > 0
        )
        raise ValueError(
            f"spec.roles.*.resources.gpus: the job asks for {wanted} GPUs ({asks}) but this machine's "
            f"Ray has {available:g}; lower the roles' `gpus` (0 runs on CPU) or run on a cluster"
        )
