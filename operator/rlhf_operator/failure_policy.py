"""Failure policy: which pod failures restart the training gang, when, and how long to back off.

A pod of the training gang (controller, actor, critic, reference, reward) that fails, is evicted,
or disappears with its node restarts every pod of the job from the last checkpoint, after an
exponential backoff, up to `failurePolicy.maxRestarts`; then the job is Failed. A rollout pod that
fails is replaced alone (see `rollout`), because the controller reshards around it.

A pod that never starts (`pod_health`) is a failure too, once waiting cannot help:

* at once for a crash loop, a container that exited non-zero, an image reference the kubelet
  will never pull (`InvalidImageName`, `ErrImageNeverPull`), and a bound pod still not Running
  after `scheduling.timeoutSeconds`;
* after `START_GRACE_SECONDS` (at most the timeout) since the pod was bound, for the errors the
  kubelet itself retries (`ErrImagePull`/`ImagePullBackOff`, `CreateContainerConfigError`, ...):
  a registry blip or a Secret created a moment late clears within it; a missing image does not.

An image that cannot be pulled fails the job without a gang restart (`restartable=False`): the
restart would create the same pods with the same image reference and pull secrets, on the same
pools, and the kubelet has already retried the pull for the grace period.

Every failure also gets a *cause*, one of `spec.FAILURE_REASONS` (`NodeLost`, `Evicted`,
`Preempted`, `PodDeletedByUser`, `ContainerExitCode` with its exit code, `OOMKilled`, ...), read
from the pod's `DisruptionTarget` condition, its `status.reason`, its containers, or how it went
missing. `spec.failurePolicy.rules` map causes to actions (`decide`): the first matching rule's
action applies, and a failure no rule matches keeps the default (a counted gang restart; failing
the job for one that is not `restartable`). Of several failures in one pass the gravest action
wins: FailJob, then RestartGang, then RestartGangNoCount.

The restarts these functions are given come from the operator's own record on the job
(`restart_record`), never from the status a pod may write.

A child object the API server refuses (`Rejection`): HTTP 400/422 is permanent for that spec
(the job fails, `ChildRejected`); 403 (a quota, a LimitRange, an admission webhook, missing RBAC)
may clear later, so the create is retried with a growing delay and reported meanwhile.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
from dataclasses import dataclass
from typing import Any

from rlhf_api import contract
from rlhf_api.roles import FailurePolicyRuleSpec, FailurePolicySpec
from rlhf_operator import kueue, pod_health

#: How long the kubelet may retry a pull or container create before the job acts on it.
START_GRACE_SECONDS = 60.0


@dataclass(frozen=True)
class PodFailure:
    """Why one pod no longer counts: `reason` is one CamelCase word, `message` names the pod."""

    pod: str
    role: str
    reason: str
    message: str
    #: False when a gang restart would fail the same way (an image that cannot be pulled).
    restartable: bool = True
    #: Seconds before the policy acts; > 0 while the kubelet's own retries may still clear it
    #: (the problem is reported meanwhile).
    act_in: float = 0.0
    #: Identity of one occurrence (`pod NAME container C`), for reporting it once.
    subject: str = ""
    #: What `failurePolicy.rules[].onReasons` calls it: one of `spec.FAILURE_REASONS`.
    cause: str = "PodFailed"
    #: Exit code of the container that failed (cause ContainerExitCode or OOMKilled).
    exit_code: int | None = None

    @property
    def acting(self) -> bool:
        return self.act_in <= 0


# -- causes: the failure reasons rules name (spec.FAILURE_REASONS) ---------------------------------

NODE_LOST = "NodeLost"
EVICTED = "Evicted"
PREEMPTED = "Preempted"
POD_DELETED_BY_USER = "PodDeletedByUser"
CONTAINER_EXIT_CODE = "ContainerExitCode"
OOM_KILLED = "OOMKilled"
WORKER_EXITED = "WorkerExited"
POD_FAILED = "PodFailed"

#: The reason given to a pod Kueue stopped (a rollout pod, its own Workload; the gang's group is
#: a suspension, `reconcile.kueue_stopped`).
KUEUE_STOPPED = "StoppedByKueue"
#: `DisruptionTarget` condition reasons (Kubernetes' pod disruption conditions) -> cause.
DISRUPTION_CAUSES = {
    "PreemptionByScheduler": PREEMPTED,
    "PreemptionByKubeScheduler": PREEMPTED,  # its name before Kubernetes 1.27
    "EvictionByEvictionAPI": EVICTED,  # a drain, a descheduler
    "TerminationByKubelet": EVICTED,  # node-pressure eviction, graceful node shutdown
    "DeletionByTaintManager": NODE_LOST,  # a NoExecute taint: the node is unreachable or not ready
    "DeletionByPodGC": NODE_LOST,  # the pod's node object was deleted
    KUEUE_STOPPED: PREEMPTED,  # Kueue preempted or evicted the pod's Workload
}
#: A Failed pod's `status.reason` (set by the kubelet or the node controller) -> cause.
POD_REASON_CAUSES = {
    "Evicted": EVICTED,
    "Preempting": PREEMPTED,  # the kubelet made room for a critical pod
    "NodeLost": NODE_LOST,
    "NodeShutdown": NODE_LOST,
    "Terminated": NODE_LOST,  # graceful node shutdown
    "Shutdown": NODE_LOST,
}
#: `pod_health` problem kinds (and the container reasons of `describe_failed`) -> cause.
PROBLEM_CAUSES = {
    pod_health.IMAGE_PULL_FAILED: pod_health.IMAGE_PULL_FAILED,
    pod_health.POD_START_FAILED: pod_health.POD_START_FAILED,
    pod_health.POD_START_TIMEOUT: pod_health.POD_START_TIMEOUT,
    pod_health.CONTAINER_FAILED: CONTAINER_EXIT_CODE,
    "OOMKilled": OOM_KILLED,
}


def _disruption(pod: dict[str, Any]) -> str | None:
    """Reason of the pod's `DisruptionTarget` condition (why the system is taking it away), if
    any; `StoppedByKueue` when Kueue's `TerminationTarget` condition marks it (`kueue`)."""
    for c in (pod.get("status") or {}).get("conditions") or []:
        if c.get("type") == "DisruptionTarget" and c.get("status", "True") == "True":
            return str(c.get("reason") or "") or None
    return KUEUE_STOPPED if kueue.stopped(pod) is not None else None


def _failed_cause(pod: dict[str, Any], container_reason: str | None) -> str:
    """The cause of a `Failed` pod: the disruption that took it, then its own reason, then the
    container that failed it (`describe_failed`'s reason)."""
    disruption = _disruption(pod)
    if disruption in DISRUPTION_CAUSES:
        return DISRUPTION_CAUSES[disruption]
    reason = (pod.get("status") or {}).get("reason")
    if reason in POD_REASON_CAUSES:
        return POD_REASON_CAUSES[reason]
    return PROBLEM_CAUSES.get(container_reason or "", POD_FAILED)


def _memory_hint(pod: dict[str, Any], role: str) -> str:
    """For an OOMKilled pod: its container's memory limit and the field that sets it, e.g.
    `; the memory limit is 128Mi (spec.roles.actor.resources.memory)`."""
    containers = (pod.get("spec") or {}).get("containers") or []
    limit = next(
        (
            c.get("resources", {}).get("limits", {}).get("memory")
            for c in containers
            if c.get("name") == "trainer"
        ),
        None,
    )
    field = (
        "spec.controller.resources.memory"
        if role == contract.CONTROLLER_ROLE
        else f"spec.roles.{role}.resources.memory"
    )
    return f"; the memory limit is {limit} ({field})" if limit else f"; raise {field}"


def _cause_and_code(cause: str, pod: dict[str, Any]) -> tuple[str, int | None]:
    code = pod_health.exit_code(pod) if cause in (CONTAINER_EXIT_CODE, OOM_KILLED) else None
    return cause, code


def pod_failure(
    pod: dict[str, Any],
    now: dt.datetime | None = None,
    start_timeout_seconds: int | None = None,
    pull_timeout_seconds: int | None = None,
) -> PodFailure | None:
    """The failure of an observed pod, or None while it is healthy (pending, running, succeeded).

    Without `now`, only pods that are Failed or being deleted; with it, also the start problems of
    `pod_health.diagnose` (the start timeout only with `start_timeout_seconds`; a pod still being
    created, pulling its image, gets `pull_timeout_seconds` instead)."""
    meta = pod.get("metadata") or {}
    status = pod.get("status") or {}
    name = meta.get("name", "")
    role = (meta.get("labels") or {}).get(contract.ROLE, "")
    if status.get("phase") == "Failed":
        container = pod_health.describe_failed(pod)
        reason = status.get("reason") or (container[0] if container else "PodFailed")
        detail = status.get("message") or (container[1] if container else "phase Failed")
        cause, code = _cause_and_code(_failed_cause(pod, container[0] if container else None), pod)
        if cause == OOM_KILLED:
            detail += _memory_hint(pod, role)
        return PodFailure(
            name,
            role,
            reason,
            f"pod {name} failed: {detail}",
            subject=f"pod {name}",
            cause=cause,
            exit_code=code,
        )
    if meta.get("deletionTimestamp"):
        disruption = _disruption(pod)
        reason = disruption or "PodDeleted"
        # Deleted with no disruption reason: by a user (or a controller that states none).
        cause = POD_DELETED_BY_USER if disruption is None else DISRUPTION_CAUSES.get(disruption, POD_FAILED)
        return PodFailure(
            name, role, reason, f"pod {name} is being deleted ({reason})", subject=f"pod {name}", cause=cause
        )
    if now is None:
        return None
    problem = pod_health.diagnose(pod, now, start_timeout_seconds, pull_timeout_seconds)
    if problem is None:
        return None
    kind = OOM_KILLED if problem.kubelet_reason == "OOMKilled" else problem.reason
    cause, code = _cause_and_code(PROBLEM_CAUSES.get(kind, POD_FAILED), pod)
    return PodFailure(
        name,
        role,
        problem.reason,
        problem.message + (_memory_hint(pod, role) if cause == OOM_KILLED else ""),
        restartable=problem.reason != pod_health.IMAGE_PULL_FAILED,
        act_in=_act_in(problem, now, start_timeout_seconds),
        subject=problem.subject,
        cause=cause,
        exit_code=code,
    )


def _act_in(problem: pod_health.PodProblem, now: dt.datetime, start_timeout_seconds: int | None) -> float:
    if problem.definite:
        return 0.0
    grace = START_GRACE_SECONDS
    if start_timeout_seconds is not None:
        grace = min(grace, float(start_timeout_seconds))
    waited = (now - problem.bound_at).total_seconds() if problem.bound_at else 0.0
    return max(grace - waited, 0.0)


def missing_pod(name: str, role: str) -> PodFailure:
    """A gang pod that existed once (the job was past Pending) and is gone: lost with its node or deleted."""
    return PodFailure(
        name,
        role,
        "PodLost",
        f"pod {name} disappeared (its node was removed or it was deleted)",
        subject=f"pod {name}",
        cause=NODE_LOST,
    )


def worker_exited(name: str, role: str) -> PodFailure:
    """A gang pod other than the controller that Succeeded: the training cannot go on without it."""
    return PodFailure(
        name,
        role,
        "WorkerExited",
        f"pod {name} exited before the controller",
        subject=f"pod {name}",
        cause=WORKER_EXITED,
    )


def is_gang_role(role: str) -> bool:
    return role in contract.GANG_ROLES


#: The shortest delay before a gang restart's pods are created, whatever the spec says.
MIN_BACKOFF_SECONDS = 1.0
#: Gang restarts that RestartGangNoCount rules may let through uncounted; past this many, each
#: further restart counts against maxRestarts (a job failing forever for an uncounted reason
#: would otherwise recreate its gang forever).
MAX_UNCOUNTED_RESTARTS = 100


def backoff_seconds(policy: FailurePolicySpec, restarts: int) -> float:
    """Delay before the pods of restart number `restarts` (1-based) are created: backoff, doubled each
    time, capped at maxBackoffSeconds."""
    if restarts <= 0:
        return 0.0
    # The exponent is capped before the power: `restarts` comes from the status, and 2 ** 10**12
    # would take the operator's memory (the cap is above any maxBackoffSeconds/backoffSeconds).
    # A floor keeps a job with backoffSeconds 0 from a create/delete storm against the API server.
    doubled = policy.backoff_seconds * 2 ** min(restarts - 1, 62)
    return float(max(MIN_BACKOFF_SECONDS, min(doubled, policy.max_backoff_seconds)))


def exhausted(policy: FailurePolicySpec, restarts: int) -> bool:
    """True when another counted failure must fail the job instead of restarting it (`restarts`:
    the restarts counted against maxRestarts so far)."""
    return restarts >= policy.max_restarts


# -- rules: which action a failure gets ------------------------------------------------------------

RESTART_GANG = "RestartGang"
RESTART_GANG_NO_COUNT = "RestartGangNoCount"
FAIL_JOB = "FailJob"
#: Of several failures in one pass, the gravest action applies.
GRAVITY = {RESTART_GANG_NO_COUNT: 0, RESTART_GANG: 1, FAIL_JOB: 2}


def rule_matches(rule: FailurePolicyRuleSpec, failure: PodFailure) -> bool:
    """`onReasons` empty or naming the failure's cause; `exitCodes` filter only ContainerExitCode."""
    if rule.on_reasons and failure.cause not in rule.on_reasons:
        return False
    if rule.exit_codes and failure.cause == CONTAINER_EXIT_CODE:
        return failure.exit_code in rule.exit_codes
    return True


@dataclass(frozen=True)
class Verdict:
    """The action one failure gets, and from where."""

    action: str
    failure: PodFailure
    #: Index into spec.failurePolicy.rules of the rule that decided; None: the default.
    rule: int | None = None

    def describe(self) -> str:
        """`spec.failurePolicy.rules[1] (FailJob on ContainerExitCode, exit code 3)`, or the default."""
        if self.rule is None:
            return f"the default ({self.action})"
        what = self.failure.cause
        if self.failure.exit_code is not None and self.failure.cause in (CONTAINER_EXIT_CODE, OOM_KILLED):
            what += f", exit code {self.failure.exit_code}"
        return f"spec.failurePolicy.rules[{self.rule}] ({self.action} on {what})"


def verdict(policy: FailurePolicySpec, failure: PodFailure) -> Verdict:
    """The first matching rule's action, else the default: fail for a failure a restart cannot
    cure (`restartable` False), a counted restart for any other."""
    for i, rule in enumerate(policy.rules):
        if rule_matches(rule, failure):
            return Verdict(rule.action, failure, i)
    return Verdict(RESTART_GANG if failure.restartable else FAIL_JOB, failure)


@dataclass(frozen=True)
class Decision:
    """What the failures of one pass do to the job."""

    #: RestartGang, RestartGangNoCount or FailJob (a counted restart past maxRestarts is FailJob).
    action: str
    #: The verdict that decided (the gravest; the first of equals).
    verdict: Verdict
    #: True when the job fails because maxRestarts is spent (the verdict was RestartGang).
    exhausted: bool = False


def decide(
    policy: FailurePolicySpec, failures: list[PodFailure], counted_restarts: int, uncounted_restarts: int = 0
) -> Decision:
    """The action for the acting failures of one pass (at least one). `counted_restarts`: the
    restarts counted against maxRestarts so far; `uncounted_restarts`: those let through by
    RestartGangNoCount rules (past `MAX_UNCOUNTED_RESTARTS` such a restart counts)."""
    if not failures:
        raise ValueError("decide needs at least one failure")
    verdicts = [verdict(policy, f) for f in failures]
    gravest = max(verdicts, key=lambda v: GRAVITY[v.action])  # max keeps the first of equals
    if gravest.action == RESTART_GANG_NO_COUNT and uncounted_restarts >= MAX_UNCOUNTED_RESTARTS:
        gravest = dataclasses.replace(gravest, action=RESTART_GANG)
    if gravest.action == RESTART_GANG and exhausted(policy, counted_restarts):
        return Decision(FAIL_JOB, gravest, exhausted=True)
    return Decision(gravest.action, gravest)


# -- children the API server refuses ------------------------------------------------------------

#: HTTP statuses of a create that no retry of the same object can change.
PERMANENT_STATUSES = (400, 422)
#: Bounds of the delay between retries of a refused create.
REJECTION_RETRY_MIN_SECONDS = 5.0
REJECTION_RETRY_MAX_SECONDS = 300.0


@dataclass(frozen=True)
class Rejection:
    """The API server refused to create one child object."""

    kind: str
    name: str
    #: HTTP status: 403 (quota, LimitRange, admission webhook, RBAC) or 400/422 (invalid object).
    code: int
    #: The server's own message, e.g. `pods "j-actor-0" is forbidden: exceeded quota: gpu, ...`
    #: (or, with `reason_override`, the operator's own explanation).
    message: str
    #: A refusal the operator decides itself, not the API server: `NotOwned` (see `ownership`).
    reason_override: str | None = None

    @property
    def permanent(self) -> bool:
        return self.code in PERMANENT_STATUSES

    @property
    def reason(self) -> str:
        """Condition and Event reason: ChildRejected (permanent), QuotaExceeded, ChildForbidden,
        or the operator's own (`reason_override`)."""
        if self.reason_override:
            return self.reason_override
        if self.permanent:
            return "ChildRejected"
        if "exceeded quota" in self.message:
            return "QuotaExceeded"
        return "ChildForbidden"

    @property
    def subject(self) -> str:
        return f"{self.kind} {self.name}"

    def describe(self) -> str:
        if self.reason_override:
            return f"{self.subject}: {self.message}"
        verdict = "rejected" if self.permanent else "refused"
        return f"{self.subject}: {verdict} by the API server (HTTP {self.code}): {self.message}"


def rejection_retry_seconds(refused_for_seconds: float) -> float:
    """Delay before the next create of a refused (403) child: as long as it has been refused,
    within [5 s, 300 s], so the retries thin out exponentially without any other memory."""
    return min(max(refused_for_seconds, REJECTION_RETRY_MIN_SECONDS), REJECTION_RETRY_MAX_SECONDS)
