"""`WorkerGroup`: N ranks of one role as Ray actors, with the role's own torch.distributed group.

    group = WorkerGroup(ActorWorker, spec, replicas=2, distributed=True, colocated=True)
    p = placement.role_placement(spec, "actor", cluster=True)   # what each rank asks Ray for
    group = WorkerGroup(ActorWorker, spec, p.ranks, **p.ray_options(), device=p.device)
    group.call("update", batch_ref, step, ...)      # every rank, same arguments
    group.call_each("generate", [args_rank0, ...])  # every rank, its own arguments

Rank 0 picks the TCP store address; every rank then joins before any model is loaded. Results
are collected with `get`, which raises the first error any rank reports instead of waiting for
ranks that may be blocked in a collective with the failed one.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any

import ray

from rlhf_api import contract
from rlhf_api.job import JobSpec
from rlhf_trainer.sync.push import gather

#: Logical CPUs each worker asks Ray for: fractional, so a whole job fits on a laptop.
DEFAULT_WORKER_CPUS = contract.ENV_WORKER_CPUS.get_float()


def placement_resources(role: str) -> dict[str, float]:
    """Custom Ray resources a rank of `role` asks for when nothing else is said (see
    `rlhf_trainer.placement`): on a cluster the driver runs in the job's controller pod
    (RLHF_ROLE=controller) and each role pod joins Ray advertising `rlhf.dev/role-<role>`
    (`rlhf worker --resources`, built by the operator from the same contract), so asking for one
    unit of it puts the rank on a pod of its role. Locally nothing advertises those resources,
    and nothing is asked."""
    if contract.ENV_ROLE.get() != contract.CONTROLLER_ROLE:
        return {}
    return {contract.ray_role_resource(role): 1.0}


#: `ray.get` of several refs, raising as soon as any of them failed (one function, in sync.push).
get = gather


class WorkerGroup:
    """The ranks of one role."""

    def __init__(
        self,
        worker_cls: type,
        spec: JobSpec,
        replicas: int,
        *,
        distributed: bool = False,
        start: bool = True,
        model_path: str | None = None,
        num_cpus: float = DEFAULT_WORKER_CPUS,
        num_gpus: float = 0,
        resources: dict[str, float] | None = None,
        rank_resources: Callable[[int], dict[str, float]] | None = None,
        **kwargs: Any,
    ):
        self.role = getattr(worker_cls, "role", worker_cls.__name__)
        #: Extra Ray resources of rank i (a rollout slot's pod: `sync.MembershipSource.placement`).
        self.rank_resources = rank_resources
        self.worker_cls = worker_cls
        self.spec = spec
        self.model_path = model_path
        self.distributed = distributed
        self.kwargs = kwargs
        #: Where the ranks compute (`placement.RolePlacement.device`; None: what each one sees).
        self.device: str | None = kwargs.get("device")
        #: Custom resources every rank asks for (`placement.RolePlacement.resources`).
        self.resources = placement_resources(self.role) if resources is None else dict(resources)
        self.remote_cls: Any = ray.remote(
            num_cpus=num_cpus, num_gpus=num_gpus, resources=self.resources, max_restarts=0
        )(worker_cls)
        self.workers = [self._start(rank, replicas) for rank in range(replicas)]
        if start:
            WorkerGroup.start_all([self])

    @staticmethod
    def start_all(groups: Sequence[WorkerGroup]) -> None:
        """Rendezvous each group's ranks, then load every group's models concurrently."""
        for g in groups:
            if g.distributed and len(g.workers) > 1:
                address = get([g.workers[0].pick_store_address.remote()])[0]
                get([w.init_group.remote(address) for w in g.workers])
        get([w.setup.remote() for g in groups for w in g.workers])

    def _start(self, rank: int, world_size: int) -> Any:
        cls = self.remote_cls
        extra = self.rank_resources(rank) if self.rank_resources else {}
        if extra:
            cls = cls.options(resources={**self.resources, **extra})
        return cls.remote(
            self.spec, rank=rank, world_size=world_size, model_path=self.model_path, **self.kwargs
        )

    def __len__(self) -> int:
        return len(self.workers)

    def call(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        """Call `method` on every rank with the same arguments; results in rank order."""
        return get([getattr(w, method).remote(*args, **kwargs) for w in self.workers])

    def call_each(self, method: str, per_rank: Sequence[tuple[Any, ...]], **kwargs: Any) -> list[Any]:
        """Call `method` on rank i with `per_rank[i]` (ranks beyond `per_rank` are not called)."""
        return get([getattr(w, method).remote(*args, **kwargs) for w, args in zip(self.workers, per_rank)])

    def add_replica(self) -> None:
        """Start one more independent replica (roles without a process group: rollout, reward)."""
        self.add_replicas([len(self.workers)])

    def add_replicas(self, ranks: Sequence[int]) -> list[Any]:
        """Start independent replicas with these ranks (their seeds), loading their models
        concurrently; returns the new workers (also appended to `workers`)."""
        if self.distributed:
            raise RuntimeError(f"{self.role}: a sharded role cannot grow one rank at a time")
        new = [self._start(rank, rank + 1) for rank in ranks]
        try:
            get([w.setup.remote() for w in new])
        except BaseException:
            for w in new:
                ray.kill(w, no_restart=True)
            raise
        self.workers.extend(new)
        return new

    def launch(self, rank: int) -> tuple[Any, Any]:
        """Start one independent replica with this rank without waiting for it: (the worker, the
        ref of its setup). `adopt` it once the setup is done, or `remove` it."""
        if self.distributed:
            raise RuntimeError(f"{self.role}: a sharded role cannot grow one rank at a time")
        worker = self._start(rank, rank + 1)
        return worker, worker.setup.remote()

    def adopt(self, worker: Any) -> None:
        """A `launch`ed replica is set up: it belongs to the group from now on."""
        self.workers.append(worker)

    def remove(self, worker: Any) -> None:
        """Stop one replica and forget it (a drained or dead member of an elastic role)."""
        self.workers = [w for w in self.workers if w is not worker]
        with contextlib.suppress(Exception):  # already gone
            ray.kill(worker, no_restart=True)

    def shutdown(self) -> None:
        for w in self.workers:
            ray.kill(w, no_restart=True)
        self.workers = []
