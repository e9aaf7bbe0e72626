"""`ClusterMembership`: the controller pod follows the operator's rollout fleet.

On a cluster the operator is the only owner of the fleet's size: `spec.roles.rollout.replicas`
is the CRD's `/scale` subresource (the operator's autoscaler, `kubectl scale`, HPA and KEDA
write it), and the operator records the membership it acts on in the job's status:

    status.rollout.desired            the replica count of ...
    status.rollout.generation         ... this membership generation (bumped on every change)
    status.rollout.syncedGeneration   written here: the controller pod's fleet matches it

At each step boundary the fleet asks `target()`, which reads the job (one GET with the per-job
ServiceAccount: `get` on its own RLTrainingJob) and returns `Target(desired, generation)`. The
fleet drains the replicas in slots `>= desired`, starts one in every empty slot below (slot `i`
asks Ray for `rlhf.dev/rollout-<i>`, which only rollout pod `i` advertises), rebuilds the sync
group and pushes the weights; once it matches, `synced()` patches `syncedGeneration` (`patch` on
the job's status). Only then does the operator delete the leaving pods.

The pod runs no autoscaler: one writer per number. A job read that fails holds the fleet as it
is (logged); a status patch that fails is retried after the next sync.

    membership = ClusterMembership(KubernetesJob.in_cluster(name, namespace))   # the pod
    membership = ClusterMembership.from_kubeconfig(path, name, namespace)       # a test
    membership = ClusterMembership(FakeJob(...))                                 # a unit test
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any, Protocol

from rlhf_api import contract

from .membership import Target

log = logging.getLogger(__name__)

#: (connect, read) seconds of every API call the controller pod makes (the kubernetes client's
#: `_request_timeout`): without one, a connection the API server (or a proxy) stops answering
#: blocks the training loop, which makes these calls between steps, for good.
API_REQUEST_TIMEOUT = (5.0, 10.0)


class JobReader(Protocol):
    """Access to one RLTrainingJob: what the per-job ServiceAccount may do."""

    def read(self) -> dict[str, Any]:
        """The job object (`metadata`, `spec`, `status`)."""
        ...

    def patch_status(self, patch: dict[str, Any]) -> None:
        """Merge `patch` (`{"status": {...}}`) into the job's status subresource."""
        ...


class KubernetesJob:
    """`JobReader` over the Kubernetes API (the `kubernetes` client's CustomObjectsApi)."""

    def __init__(self, api: Any, name: str, namespace: str):
        self.api = api
        self.name = name
        self.namespace = namespace

    @classmethod
    def in_cluster(cls, name: str, namespace: str) -> KubernetesJob:
        """With the pod's ServiceAccount token (the controller pod)."""
        from kubernetes import client, config

        config.load_incluster_config()
        return cls(client.CustomObjectsApi(), name, namespace)

    @classmethod
    def from_kubeconfig(
        cls, path: str, name: str, namespace: str, context: str | None = None
    ) -> KubernetesJob:
        """With the credentials of a kubeconfig file (a test against a real API server)."""
        from kubernetes import client, config

        api_client = config.new_client_from_config(config_file=str(path), context=context)
        return cls(client.CustomObjectsApi(api_client), name, namespace)

    def read(self) -> dict[str, Any]:
        job: dict[str, Any] = self.api.get_namespaced_custom_object(
            contract.GROUP,
            contract.VERSION,
            self.namespace,
            contract.PLURAL,
            self.name,
            _request_timeout=API_REQUEST_TIMEOUT,
        )
        return job

    def patch_status(self, patch: dict[str, Any]) -> None:
        self.api.patch_namespaced_custom_object_status(
            contract.GROUP,
            contract.VERSION,
            self.namespace,
            contract.PLURAL,
            self.name,
            patch,
            _request_timeout=API_REQUEST_TIMEOUT,
        )


def rollout_target(job: Mapping[str, Any]) -> Target:
    """The fleet the operator asks for: `status.rollout.desired` at `status.rollout.generation`.
    Before the operator has recorded a generation: `spec.roles.rollout.replicas`, generation 0
    (nothing to report yet)."""
    rollout = ((job.get("status") or {}).get(contract.STATUS_ROLLOUT)) or {}
    generation = int(rollout.get(contract.ROLLOUT_GENERATION) or 0)
    if generation > 0 and rollout.get(contract.ROLLOUT_DESIRED) is not None:
        return Target(int(rollout[contract.ROLLOUT_DESIRED]), generation)
    spec_replicas = (((job.get("spec") or {}).get("roles") or {}).get("rollout") or {}).get("replicas")
    return Target(int(spec_replicas if spec_replicas is not None else 1), generation)


class ClusterMembership:
    """`MembershipSource` of the controller pod: follows the job's `status.rollout` (see the
    module docstring).

    `join_wait`: seconds a boundary waits for replicas starting on new pods (default 0: training
    goes on while a pod pulls its image and loads its model; the replica joins at the first
    boundary after it has loaded, and `syncedGeneration` follows). `pin_to_pods`: ask for the
    per-slot Ray resource (off only where the replicas run on a Ray without the job's pods, e.g.
    a test driving a local Ray against a real API server). `fallback_replicas`: the fleet's size
    when the job cannot be read at start (the mounted spec's)."""

    def __init__(
        self,
        jobs: JobReader,
        *,
        join_wait: float | None = 0.0,
        pin_to_pods: bool = True,
        fallback_replicas: int = 1,
    ):
        self.jobs = jobs
        self.join_wait = join_wait
        self.pin_to_pods = pin_to_pods
        self.fallback_replicas = fallback_replicas
        self.last: Target | None = None
        self.reported = 0
        """The last generation this process wrote as `syncedGeneration`."""

    @classmethod
    def in_cluster(cls, name: str, namespace: str, **kwargs: Any) -> ClusterMembership:
        return cls(KubernetesJob.in_cluster(name, namespace), **kwargs)

    @classmethod
    def from_kubeconfig(
        cls, path: str, name: str, namespace: str, *, context: str | None = None, **kwargs: Any
    ) -> ClusterMembership:
        return cls(KubernetesJob.from_kubeconfig(path, name, namespace, context), **kwargs)

    @classmethod
    def from_environment(cls, name: str, namespace: str, **kwargs: Any) -> ClusterMembership | None:
        """In a pod: follow the job with the pod's ServiceAccount. Elsewhere: None (the local
        policy owns the fleet)."""
        if not contract.ENV_KUBERNETES_SERVICE_HOST.is_set():
            return None
        try:
            import kubernetes  # noqa: F401
        except ImportError as err:
            raise RuntimeError(
                "the controller pod follows status.rollout through the Kubernetes API, but the "
                "`kubernetes` client is not installed in this image"
            ) from err
        return cls.in_cluster(name, namespace, **kwargs)

    def _read(self) -> Target | None:
        try:
            job = self.jobs.read()
        except Exception as err:  # the API server is away: hold the fleet, say why
            log.warning("could not read the job's status.rollout (the fleet holds): %s", err)
            return None
        target = rollout_target(job)
        if self.last is None or target.generation != self.last.generation:
            log.info(
                "following status.rollout generation %d: %d rollout replicas",
                target.generation,
                target.replicas,
            )
        self.last = target
        return target

    def initial(self) -> Target:
        return self._read() or Target(self.fallback_replicas)

    def target(self, step: int, metrics: dict[str, float]) -> Target:
        return self._read() or self.last or Target(self.fallback_replicas)

    def placement(self, index: int) -> dict[str, float]:
        return {contract.ray_rollout_slot_resource(index): 1.0} if self.pin_to_pods else {}

    def synced(self, target: Target, changed: bool) -> None:
        """Write `status.rollout.syncedGeneration` (once per generation; a failed patch is tried
        again after the next sync)."""
        if target.generation <= self.reported:
            return
        patch = {"status": {contract.STATUS_ROLLOUT: {contract.ROLLOUT_SYNCED_GENERATION: target.generation}}}
        try:
            self.jobs.patch_status(patch)
        except Exception as err:  # the operator keeps the leaving pods meanwhile: nothing is lost
            log.warning("could not write status.rollout.syncedGeneration=%d: %s", target.generation, err)
            return
        self.reported = target.generation
        log.info("rollout generation %d synced (%d replicas)", target.generation, target.replicas)

    def attach_metrics(self, registry: Any) -> None:
        pass

    def step_metrics(self) -> dict[str, float]:
        return {
            "rollout/job_generation": float(self.last.generation if self.last else 0),
            "rollout/job_synced_generation": float(self.reported),
        }
