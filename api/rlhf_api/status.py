"""The `status` of an RLTrainingJob: its schema (dataclasses, rendered into the CRD like the spec),
the phases, the condition types, and the format of its times (`rfc3339`, `parse_time`: both
writers stamp with them). The operator's helpers that compute it (conditions, the
printer-column summaries) are `rlhf_operator.status`.

Who writes what:

* the operator: phase, conditions, observedGeneration, restarts, countedRestarts, startTime,
  completionTime, summary, rollout.{desired, ready, selector, generation}, and autoscaling.* (the
  autoscaler's memory: it writes that key alone, in its own patch);
* the controller pod: progress.* and rollout.syncedGeneration (the resharding protocol).

The operator writes its keys with a JSON merge patch that never names the controller's keys, so
neither side overwrites the other.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass
from typing import Literal

from rlhf_api.fields import _f

#: The status's times (startTime, completionTime, progress.updated, conditions' transitions):
#: RFC 3339 in UTC, to the second, as both writers spell them.
TIME_FORMAT = "%Y-%m-%dT%H:%M:%SZ"


def rfc3339(t: dt.datetime) -> str:
    return t.astimezone(dt.timezone.utc).strftime(TIME_FORMAT)


def parse_time(value: str | None) -> dt.datetime | None:
    if not value:
        return None
    return dt.datetime.strptime(value, TIME_FORMAT).replace(tzinfo=dt.timezone.utc)


Phase = Literal["Pending", "Scheduling", "Running", "Restarting", "Suspended", "Succeeded", "Failed"]
PHASES: tuple[str, ...] = (
    "Pending",
    "Scheduling",
    "Running",
    "Restarting",
    "Suspended",
    "Succeeded",
    "Failed",
)
FINISHED = ("Succeeded", "Failed")

# Condition types. Each is True/False with a reason and a message.
SCHEDULED = "Scheduled"  # every pod of the gang is bound to a node
RUNNING = "Running"  # every pod of the gang runs
RESTARTING = "Restarting"  # a gang restart is in progress (waiting for its backoff or old pods)
UNSCHEDULABLE = "Unschedulable"  # pods waited longer than scheduling.timeoutSeconds
# A pod of the current attempt failed or cannot start (image pull, container config, crash loop,
# early exit, not Running in time): reason ImagePullFailed, PodStartFailed, ContainerFailed,
# PodStartTimeout, ...; the message names the pod, the container and what the kubelet said.
POD_FAILURE = "PodFailure"
# The API server refused a child object: reason ChildRejected (HTTP 400/422, the job fails),
# QuotaExceeded or ChildForbidden (HTTP 403, retried with backoff); the message quotes the server.
CHILD_FAILURE = "ChildFailure"
# The job names a Prometheus URL the operator does not allow (`autoscaler.refusal`): reason
# URLNotAllowed; the autoscaler reads the controller pod's /metrics instead.
PROMETHEUS_REFUSED = "PrometheusRefused"
SUSPENDED = "Suspended"
# A directory several pods write (the checkpoint directory) lies on a persistentVolumeClaim that
# they cannot all mount (not ReadWriteMany) or that does not exist (`rlhf_api.storage.claim_findings`):
# reason ClaimNotShared while True (no pod is created), ClaimsShared once fixed; ClaimsForbidden
# while True because the operator may not read the claims (its RBAC lacks get on persistentvolumeclaims).
STORAGE_NOT_SHARED = "StorageNotShared"
# Kueue holds pods of the job back (its admission scheduling gate): reason WaitingForKueue while
# True, Admitted once it lets them go (see `kueue`). The scheduling timeout counts from then.
QUEUED = "Queued"
SUCCEEDED = "Succeeded"
FAILED = "Failed"
CONDITION_TYPES = (
    QUEUED,
    SCHEDULED,
    RUNNING,
    RESTARTING,
    UNSCHEDULABLE,
    POD_FAILURE,
    CHILD_FAILURE,
    PROMETHEUS_REFUSED,
    STORAGE_NOT_SHARED,
    SUSPENDED,
    SUCCEEDED,
    FAILED,
)


@dataclass
class Condition:
    """One observation about the job, in the Kubernetes conditions convention."""

    type: str = _f(doc="Condition type: " + ", ".join(CONDITION_TYPES) + ".")
    status: Literal["True", "False", "Unknown"] = _f(doc="Whether the condition holds.")
    reason: str = _f("", doc="One CamelCase word saying why.")
    message: str = _f("", doc="Human-readable details, naming the pods or values involved.")
    last_transition_time: str | None = _f(None, doc="When `status` last changed (RFC 3339).")


@dataclass
class ProgressStatus:
    """Training progress, written by the controller pod. A structured schema, not free form: the
    pod's writes are pruned to these keys and bounded in size, whatever the pod sends."""

    step: int = _f(0, doc="Completed training steps.")
    total_steps: int = _f(0, doc="Steps the job will run (spec.training.steps).")
    reward: float | None = _f(None, doc="Mean reward of the last step.")
    checkpoint_step: int | None = _f(None, doc="Step of the latest complete checkpoint.")
    updated: str | None = _f(None, doc="When the controller last wrote progress (RFC 3339).")
    eval_reward: float | None = _f(
        None, doc="Mean reward of the last evaluation (spec.eval): greedy responses, else sampled ones."
    )
    eval_step: int | None = _f(None, doc="Completed training steps when the last evaluation ran.")
    metrics: dict[str, str] = _f(
        {},
        doc="A few metrics of the last step, by name (`/` written `_`), as decimal text.",
        value_max_length=64,
    )


@dataclass
class RolloutStatus:
    """The elastic rollout fleet; backs the /scale subresource."""

    desired: int = _f(0, doc="Rollout replicas the operator maintains (spec.roles.rollout.replicas).")
    ready: int = _f(0, doc="Rollout pods running (the /scale subresource's status replicas).")
    selector: str = _f("", doc="Label selector of the rollout pods (for HPA and KEDA).")
    generation: int = _f(
        0, doc="Bumped by the operator whenever the rollout membership changes (resharding protocol)."
    )
    synced_generation: int = _f(
        0,
        doc="Written by the controller pod once it has drained leaving replicas and pushed weights to "
        "every member of `generation`; the operator deletes a leaving pod only after this catches up.",
    )


@dataclass
class RecommendationStatus:
    """One past recommendation of the autoscaling policy (kept for the stabilization window)."""

    time: float = _f(doc="When it was made (Unix seconds).")
    replicas: int = _f(doc="Replicas the proportional rule recommended (before stabilization).")


@dataclass
class AutoscalingStatus:
    """The operator's autoscaler (spec.autoscaling): its memory between periods and its last decision."""

    recommendations: list[RecommendationStatus] = _f(
        [], doc="Recommendations within the stabilization window, oldest first."
    )
    last_evaluation_time: str | None = _f(None, doc="When the policy last ran (RFC 3339).")
    last_reshard_time: str | None = _f(
        None,
        doc="When rollout.syncedGeneration last caught up with rollout.generation (RFC 3339); the "
        "cooldown counts from here.",
    )
    resharded_generation: int = _f(0, doc="The rollout generation whose sync set lastReshardTime.")
    signal: float | None = _f(None, doc="Value of the signal at the last evaluation (absent: no data).")
    desired_replicas: int | None = _f(None, doc="Replicas the last evaluation wanted.")
    reason: str = _f("", doc="Why, in one line (also posted as an Event when the count changed).")


@dataclass
class SummaryStatus:
    """Values shown by `kubectl get rltj` (printer columns cannot format or combine fields)."""

    step: str = _f("", doc="`done/total` steps.")
    rollout: str = _f("", doc="`ready/desired` rollout replicas.")
    reward: float | None = _f(
        None, doc="Mean reward of the last step: progress.reward, else progress.metrics.reward_mean."
    )


@dataclass
class JobStatus:
    """Observed state of an RLTrainingJob."""

    phase: Phase = _f("Pending", doc="Where the job is in its life: " + ", ".join(PHASES) + ".")
    conditions: list[Condition] = _f([], doc="Latest observations, one per type.")
    observed_generation: int = _f(0, doc="metadata.generation the operator last acted on.")
    restarts: int = _f(0, doc="Gang restarts so far (also the restart attempt of the current pods).")
    counted_restarts: int | None = _f(
        None,
        doc="Gang restarts that count against spec.failurePolicy.maxRestarts: `restarts` less those a "
        "RestartGangNoCount rule let through (absent: all of them).",
    )
    start_time: str | None = _f(None, doc="When every pod of the job first ran (RFC 3339).")
    completion_time: str | None = _f(None, doc="When the job Succeeded or Failed (RFC 3339).")
    progress: ProgressStatus = _f(ProgressStatus, doc="Training progress (written by the controller pod).")
    rollout: RolloutStatus = _f(RolloutStatus, doc="The rollout fleet.")
    autoscaling: AutoscalingStatus = _f(
        AutoscalingStatus, doc="The operator's autoscaler (only while spec.autoscaling.enabled)."
    )
    summary: SummaryStatus = _f(SummaryStatus, doc="Printer-column strings.")
