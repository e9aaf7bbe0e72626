"""Kueue, through its plain-pod integration, following Kueue's documented contract (no Go here).

A job with `scheduling.queueName` is queued by Kueue in that LocalQueue. Kueue has no built-in
integration for RLTrainingJob (its `spec.suspend` integrations, JobSet or Kubeflow's, are Go code
compiled into Kueue), so the operator speaks Kueue's *plain pod* protocol, the one Kueue documents
for controllers that create pods themselves:

* **The gang is one pod group.** The controller pod and every pod of the training and scoring
  roles carry `kueue.x-k8s.io/queue-name`, `kueue.x-k8s.io/pod-group-name` and the annotation
  `kueue.x-k8s.io/pod-group-total-count` (the gang's size). Kueue's webhook gates each pod
  (`kueue.x-k8s.io/admission` scheduling gate) and admits the group as one Workload once all of
  its pods exist: it removes the gates when the ClusterQueue has quota for all of them.
* **The elastic rollout fleet is not in the group.** Its size follows `/scale` (the autoscaler,
  `kubectl scale`), and a pod group's total count cannot change once its Workload exists. Each
  rollout pod is a single Kueue-managed pod instead (the queue-name label alone): its own
  Workload, admitted, preempted and released on its own, which is how the fleet already lives
  (members join, leave and are replaced alone). The group count, and a PodGroup's `minMember`,
  therefore never change on `/scale`. A scale-up beyond the queue's quota waits, gated, until
  quota frees; the job keeps running meanwhile.
* **Queued is not stuck.** A pod gated by Kueue is waiting for admission, not unschedulable: the
  job reports the `Queued` condition, and its scheduling timeout counts from admission.
* **Kueue's stop is a suspension.** To preempt or evict a pod group Kueue marks each pod with the
  `TerminationTarget` condition and deletes it; it never re-creates pods (its documentation: the
  controller that made them must). The operator treats that as a suspension immediately resumed:
  no restart is counted, the group's pods are released (below), and a fresh group is created,
  which Kueue queues until it can admit it again.
* **Quota is released when the group ends.** Kueue finishes a group's Workload when all its
  pods Succeeded, or when no pod is active and one carries
  `kueue.x-k8s.io/retriable-in-group: "false"`; until then it holds the quota and keeps a
  finalizer on the pods, waiting for replacements. The operator deletes the workers when the
  controller pod succeeds, so they never all succeed: every pod of a group the operator tears
  down (success, failure, suspension, Kueue's stop, a gang restart) is annotated first. A job
  deleted (or its namespace) has no pass left to do it: its pods are deleted by the garbage
  collector, and the operator's pod watch annotates each group pod being deleted whose job is gone
  (`orphaned`); without that Kueue kept them Terminating and their quota held for good.
* **A new group per incarnation.** Pod names are stable (`<job>-<role>-<i>`, their DNS names),
  so a replacement can only be created once its predecessor is gone, and Kueue removes its
  finalizer only from a pod that has a replacement. A gang that came back under the same group
  name would wait forever. So each incarnation of the gang (the job's UID, its restart attempt,
  its last resume) gets its own group name, and the old group is released as above. A restart
  therefore queues again in Kueue, like a new job.

Tested against Kueue's real controller manager (v0.17.0, built from the Go module proxy, its `pod`
integration only) on the kwok test cluster, `tests/cluster/test_operator_kueue.py`: a job behind a
full ClusterQueue stays gated and `Queued`, its group is one Workload of the gang's size and each
rollout pod one of its own, the quota is released when the job succeeds, is suspended or is
deleted and the next job is admitted, a resumed job queues again as a new group without a
restart, a job Kueue preempts for one of higher priority is suspended and queues again as a new
group (no restart), and a rollout scale-up past the quota waits gated while the job runs. A gang
restart under Kueue is covered by the unit tests, which drive `reconcile.plan` with the pods
Kueue's webhook and controller produce (gates, `TerminationTarget`, deletions).
"""

from __future__ import annotations

import hashlib
from typing import Any

from rlhf_api import contract

#: Kueue's scheduling gate on the pods it manages, removed on admission.
ADMISSION_GATE = "kueue.x-k8s.io/admission"
#: Annotation that lets Kueue finish a pod group once no pod is active (releasing its quota).
RETRIABLE_IN_GROUP = "kueue.x-k8s.io/retriable-in-group"
#: The pod condition Kueue sets before it deletes a pod it stops (preemption, eviction).
TERMINATION_TARGET = "TerminationTarget"
#: Label values may not be longer.
MAX_LABEL_VALUE = 63


def group_name(job: str, uid: str, attempt: int, incarnation: str = "") -> str:
    """The pod group of one incarnation of the gang: `<job>-<digest>`, at most 63 characters.

    The digest covers the job's UID (a job recreated under the same name never joins its
    predecessor's Workload), the restart attempt and `incarnation` (when the gang was last
    resumed, after a suspension or Kueue's stop)."""
    digest = hashlib.sha256(f"{uid}/{attempt}/{incarnation}".encode()).hexdigest()[:10]
    return f"{job[: MAX_LABEL_VALUE - len(digest) - 1].rstrip('-.')}-{digest}"


def pod_metadata(queue: str, role: str, group: str, gang_size: int) -> tuple[dict[str, str], dict[str, str]]:
    """Kueue's labels and annotations for a pod of `role`: the gang's group, or (rollout) a pod
    Kueue admits on its own."""
    lab = {contract.KUEUE_QUEUE_NAME: queue}
    ann: dict[str, str] = {}
    if role != "rollout":
        lab[contract.KUEUE_POD_GROUP_NAME] = group
        ann[contract.KUEUE_POD_GROUP_TOTAL_COUNT] = str(gang_size)
    return lab, ann


def _meta(pod: dict[str, Any]) -> dict[str, Any]:
    return pod.get("metadata") or {}


def group_of(pod: dict[str, Any]) -> str | None:
    return (_meta(pod).get("labels") or {}).get(contract.KUEUE_POD_GROUP_NAME)


def is_gated(pod: dict[str, Any]) -> bool:
    """True while Kueue holds the pod back (not admitted yet)."""
    gates = (pod.get("spec") or {}).get("schedulingGates") or []
    return any(g.get("name") == ADMISSION_GATE for g in gates)


def stopped(pod: dict[str, Any]) -> dict[str, Any] | None:
    """Kueue's `TerminationTarget` condition when Kueue stopped the pod (preempted or evicted
    its Workload), else None."""
    for c in (pod.get("status") or {}).get("conditions") or []:
        if c.get("type") == TERMINATION_TARGET and c.get("status", "True") == "True":
            return c  # type: ignore[no-any-return]
    return None


def released(pod: dict[str, Any]) -> bool:
    return (_meta(pod).get("annotations") or {}).get(RETRIABLE_IN_GROUP) == "false"


def to_release(pods: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The pods of Kueue pod groups to annotate `retriable-in-group: "false"` (so Kueue finishes
    their Workloads once they stop), by name, each once."""
    out = {}
    for pod in pods:
        if group_of(pod) and not released(pod):
            out[_meta(pod).get("name", "")] = pod
    return [out[n] for n in sorted(out)]


RELEASE_PATCH = {"metadata": {"annotations": {RETRIABLE_IN_GROUP: "false"}}}


def maybe_orphaned(pod: dict[str, Any]) -> bool:
    """A pod of a Kueue pod group being deleted and not released: released by its job's reconcile
    when the job lives, else by `orphaned` (cheap: decides from the pod alone whether the job is
    worth reading)."""
    return bool(group_of(pod)) and not released(pod) and bool(_meta(pod).get("deletionTimestamp"))


def orphaned(pod: dict[str, Any], job: dict[str, Any] | None) -> bool:
    """True when `pod` (see `maybe_orphaned`) outlived its job: `job` is the job of its name now,
    None when there is none; one with another UID (recreated) or being deleted does not own it
    any more. Nothing else will release the group: the job's reconcile is over."""
    if not maybe_orphaned(pod):
        return False
    if job is None:
        return True
    meta = job.get("metadata") or {}
    owners = {r.get("uid") for r in _meta(pod).get("ownerReferences") or [] if r.get("kind") == contract.KIND}
    return meta.get("uid") not in owners or bool(meta.get("deletionTimestamp"))
