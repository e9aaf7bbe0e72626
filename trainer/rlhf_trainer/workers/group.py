"""`WorkerGroup`: N ranks of one role as Ray actors, with the role's own torch.distributed group.

    group = WorkerGroup(ActorWorker, spec, replicas=2, distributed=True, colocated=True)
    group.call("update", batch_ref, step, ...)      # every rank, same arguments
    group.call_each("generate", [args_rank0, ...])  # every rank, its own arguments

Rank 0 picks the TCP store address; every rank then joins before any model is loaded. Results
are collected with `get`, which raises the first error any rank reports instead of waiting for
ranks that may be blocked in a collective with the failed one.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Sequence
from typing import Any

import ray

from rlhf_trainer.spec import JobSpec

#: Logical CPUs each worker asks Ray for: fractional, so a whole job fits on a laptop.
DEFAULT_WORKER_CPUS = float(os.environ.get("RLHF_WORKER_CPUS", "0.25"))


def placement_resources(role: str) -> dict[str, float]:
    """Ray resources a rank of `role` asks for. On a cluster the driver runs in the job's controller
    pod (RLHF_ROLE=controller) and each role pod joins Ray advertising `rlhf.dev/role-<role>: 1`
    (rlhf_operator.children), so asking for it puts each rank on its own pod of its role. Locally
    nothing advertises those resources, and nothing is asked."""
    from rlhf_operator.labels import CONTROLLER_ROLE, RAY_ROLE_RESOURCE_PREFIX

    if os.environ.get("RLHF_ROLE") != CONTROLLER_ROLE:
        return {}
    return {f"{RAY_ROLE_RESOURCE_PREFIX}{role}": 1.0}


def get(refs: Sequence[Any]) -> list[Any]:
    """`ray.get` of several refs, raising as soon as any of them failed."""
    pending = list(refs)
    results: dict[Any, Any] = {}
    while pending:
        ready, pending = ray.wait(pending, num_returns=1)
        for ref in ready:
            results[ref] = ray.get(ref)
    return [results[r] for r in refs]


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
        **kwargs: Any,
    ):
        self.role = getattr(worker_cls, "role", worker_cls.__name__)
        self.worker_cls = worker_cls
        self.spec = spec
        self.model_path = model_path
        self.distributed = distributed
        self.kwargs = kwargs
        self.remote_cls: Any = ray.remote(
            num_cpus=num_cpus, num_gpus=num_gpus, resources=placement_resources(self.role), max_restarts=0
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
        return self.remote_cls.remote(
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

    def remove(self, worker: Any) -> None:
        """Stop one replica and forget it (a drained or dead member of an elastic role)."""
        self.workers = [w for w in self.workers if w is not worker]
        with contextlib.suppress(Exception):  # already gone
            ray.kill(worker, no_restart=True)

    def shutdown(self) -> None:
        for w in self.workers:
            ray.kill(w, no_restart=True)
        self.workers = []
