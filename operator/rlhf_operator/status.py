"""The `status` of an RLTrainingJob: its schema (dataclasses, rendered into the CRD like the spec)
and the pure helpers that compute it (conditions, the printer-column summaries).

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
import math
from dataclasses import dataclass
from typing import Any, Literal

from rlhf_operator.tenant_limits import clamp_int, clip
from rlhf_trainer.spec import _f

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
#: Longest condition reason kept; the longest number shown in a summary.
MAX_REASON = 128
MAX_COUNT = 10**12

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


# --------------------------------------------------------------------------------------------
# Pure helpers
# --------------------------------------------------------------------------------------------


def rfc3339(t: dt.datetime) -> str:
    return t.astimezone(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def parse_time(value: str | None) -> dt.datetime | None:
    if not value:
        return None
    return dt.datetime.strptime(value, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=dt.timezone.utc)


def get_condition(status: dict[str, Any], type_: str) -> dict[str, Any] | None:
    for cond in status.get("conditions") or []:
        if cond.get("type") == type_:
            return dict(cond)
    return None


def condition_is(status: dict[str, Any], type_: str) -> bool:
    cond = get_condition(status, type_)
    return bool(cond and cond.get("status") == "True")


def set_condition(
    conditions: list[dict[str, Any]],
    type_: str,
    true: bool,
    reason: str,
    message: str,
    now: dt.datetime,
) -> list[dict[str, Any]]:
    """A new conditions list with `type_` set; lastTransitionTime moves only when the status flips."""
    status = "True" if true else "False"
    out = [dict(c) for c in conditions if c.get("type") != type_]
    old = next((c for c in conditions if c.get("type") == type_), None)
    since = old.get("lastTransitionTime") if old and old.get("status") == status else rfc3339(now)
    # Clipped to the schema's maxLength: a longer message (a pod's termination message quoted, a
    # long list of pods) would make every status patch of the job fail with 422.
    out.append(
        {
            "type": type_,
            "status": status,
            "reason": reason[:MAX_REASON],
            "message": clip(message),
            "lastTransitionTime": since,
        }
    )
    order = {t: i for i, t in enumerate(CONDITION_TYPES)}
    return sorted(out, key=lambda c: order.get(c["type"], len(order)))


def _mapping(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def summary(status: dict[str, Any], total_steps: int) -> dict[str, Any]:
    """Printer-column values from a status: `12/20` steps, `2/3` ready/desired rollout replicas and
    the last mean reward (a number, whichever way the controller pod reported it)."""
    progress = _mapping(status.get("progress"))
    rollout = _mapping(status.get("rollout"))
    # The controller pod writes progress: each number clamped, whatever its type.
    total = clamp_int(progress.get("totalSteps"), 0, MAX_COUNT) or total_steps
    out: dict[str, Any] = {
        "step": f"{clamp_int(progress.get('step'), 0, MAX_COUNT)}/{total}",
        "rollout": f"{clamp_int(rollout.get('ready'), 0, MAX_COUNT)}/{clamp_int(rollout.get('desired'), 0, MAX_COUNT)}",
    }
    reward = progress.get("reward")
    if reward is None:  # the controller may report it among its metrics, as a string
        reward = _mapping(progress.get("metrics")).get("reward_mean")
    try:
        value = None if reward is None or isinstance(reward, bool) else float(reward)
    except (TypeError, ValueError, OverflowError):
        value = None
    # None (a merge patch removes it) also for NaN/inf, which JSON cannot carry: a step whose
    # every sample failed its reward must not make every later status patch invalid.
    out["reward"] = value if value is not None and math.isfinite(value) else None
    return out
