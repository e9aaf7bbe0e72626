"""The state of one reconcile pass, and what it decides.

`Pass` is what the steps of `reconcile.plan` share: what was observed (the job, its owned and
foreign pods, the status it last carried; read-only) and what is being built (the new status, its
conditions, the `Plan`). `Plan` is what a pass hands to the executor: the operator's keys of the new
status, the pods to create and delete, the `Event`s to post, when to look again. `OPERATOR_KEYS`
and `ROLLOUT_KEYS` are the status keys the operator owns (`operator_status` compares a status and
a plan's through them); the pod helpers read what a pass needs of a pod (its attempt, whether it
is terminal or being deleted).
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from rlhf_api import contract
from rlhf_api.job import JobSpec, RLTrainingJob
from rlhf_api.status import FAILED, FINISHED, PHASES, RUNNING, SUSPENDED, parse_time, rfc3339
from rlhf_operator import children, failure_policy, kueue, ownership, restart_record, tenant_limits
from rlhf_operator.status import get_condition, set_condition, summary

#: The status keys the operator owns (progress and rollout.syncedGeneration belong to the controller pod).
OPERATOR_KEYS = (
    "phase",
    "conditions",
    "observedGeneration",
    "restarts",
    "countedRestarts",
    "startTime",
    "completionTime",
    contract.STATUS_ROLLOUT,
    "summary",
)
ROLLOUT_KEYS = (
    contract.ROLLOUT_DESIRED,
    contract.ROLLOUT_READY,
    contract.ROLLOUT_SELECTOR,
    contract.ROLLOUT_GENERATION,
)
#: The most gang restarts a status may claim (a larger `status.restarts` is clamped to this).
MAX_RESTARTS = 1_000_000


@dataclass(frozen=True)
class Event:
    type: str  # Normal | Warning
    reason: str
    message: str


@dataclass
class Plan:
    """What one reconcile pass decided."""

    #: The operator's keys of the new status (see OPERATOR_KEYS).
    status: dict[str, Any]
    create: list[dict[str, Any]] = field(default_factory=list)
    delete: list[dict[str, Any]] = field(default_factory=list)
    events: list[Event] = field(default_factory=list)
    #: Look again after this many seconds even without an event (backoff, timeouts, TTL).
    requeue_after: float | None = None
    #: Delete the job itself (ttlSecondsAfterFinished).
    delete_job: bool = False
    #: The spec is invalid: the status says so, nothing is built, and the job's daemon waits for a
    #: corrected spec (`handlers`).
    invalid: str | None = None
    #: Parsed job (None when invalid); the executor builds the static children from it.
    job: RLTrainingJob | None = None
    #: Pods the job wants whose names are held by pods it does not own (`ownership`): not
    #: created, reported by the executor like a refused create.
    blocked: list[failure_policy.Rejection] = field(default_factory=list)
    #: The job's restart record to write (`restart_record`): annotations, after the status write
    #: and before any pod is created; None when the job's record already says so.
    record: dict[str, str] | None = None
    #: Pods of Kueue pod groups the job is done with, to annotate `retriable-in-group: "false"`
    #: before the deletions, so that Kueue finishes their Workloads and releases the quota (`kueue`).
    release: list[dict[str, Any]] = field(default_factory=list)

    def requeue(self, seconds: float) -> None:
        seconds = max(seconds, 0.0)
        self.requeue_after = seconds if self.requeue_after is None else min(self.requeue_after, seconds)


def operator_status(status: dict[str, Any]) -> dict[str, Any]:
    """The part of a status the operator writes, as the API server stores it after a merge patch
    (null values removed): compare an old status with a plan's through this."""
    out = {k: status[k] for k in OPERATOR_KEYS if k in status and k != contract.STATUS_ROLLOUT}
    if contract.STATUS_ROLLOUT in status:
        out[contract.STATUS_ROLLOUT] = {
            k: v for k, v in (status.get(contract.STATUS_ROLLOUT) or {}).items() if k in ROLLOUT_KEYS
        }
    return _without_nulls(out)


def _without_nulls(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _without_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_without_nulls(v) for v in value]
    return value


def labels_of(pod: dict[str, Any]) -> dict[str, str]:
    return (pod.get("metadata") or {}).get("labels") or {}


def attempt_of(pod: dict[str, Any]) -> int:
    try:
        return int(labels_of(pod).get(contract.RESTART_ATTEMPT, "0"))
    except ValueError:
        return -1


def is_deleting(pod: dict[str, Any]) -> bool:
    return bool((pod.get("metadata") or {}).get("deletionTimestamp"))


def is_terminal(pod: dict[str, Any]) -> bool:
    return (pod.get("status") or {}).get("phase") in ("Succeeded", "Failed")


# -- one pass -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ClaimsForbidden:
    """The API server refused the operator's GET of a claim the job's pods write (HTTP 403): the
    operator's ClusterRole lacks `get` on persistentvolumeclaims (an older chart's), so the storage
    check cannot be made. `message`: the server's."""

    namespace: str
    claim: str
    message: str


@dataclass
class Pass:
    """The state of one reconcile pass, shared by its steps: what was observed (read-only) and the
    status, conditions and plan being built. Steps run in the order of `reconcile.STEPS`; each reads what
    the earlier ones recorded here."""

    now: dt.datetime
    #: The job as read from the API server.
    body: dict[str, Any]
    meta: dict[str, Any]
    #: The status as the job carries it (written by the last pass and by the controller pod).
    old: dict[str, Any]
    #: Pods whose controller owner reference carries the job's UID (`ownership`).
    pods: list[dict[str, Any]]
    #: Labelled pods the job does not own: their names are held, never adopted.
    foreign: list[dict[str, Any]]
    #: The plan being built; its `status` (the operator's keys of the new status) is `status`.
    plan: Plan
    #: The conditions of the new status, written into it when the pass finishes.
    conditions: list[dict[str, Any]]
    #: The phase the pass works from: the job's, until a step moves it (resume, all pods created).
    phase: str
    # Recorded by the steps:
    attempt: int = 0
    current: list[dict[str, Any]] = field(default_factory=list)
    by_name: dict[str, dict[str, Any]] = field(default_factory=dict)
    #: The gang's pods of this attempt by name: (role, replica index). Pods are built only when
    #: created (`create_missing`), so a pass over a big job costs names, not pod objects.
    desired_gang: dict[str, tuple[str, int]] = field(default_factory=dict)
    rollout_desired: int = 0
    #: Rollout pods the fleet adds this pass, by name.
    desired_rollout: dict[str, dict[str, Any]] = field(default_factory=dict)
    failures: list[failure_policy.PodFailure] = field(default_factory=list)
    leaving: set[str] = field(default_factory=set)
    members: list[dict[str, Any]] = field(default_factory=list)
    expected: int = 0
    #: The API server has enforced the CRD's rules on `body` (`parse_cache.InstalledRules`).
    admitted: bool = False
    #: The operator's bounds on one job (`tenant_limits`).
    limits: tenant_limits.Limits = field(default_factory=tenant_limits.Limits)
    #: The access modes of the claims several pods write (`storage.shared_claims`), as read from
    #: the cluster (None for a claim that does not exist); `ClaimsForbidden`: the operator may not
    #: read them (its RBAC); None: not read (the pass checks nothing).
    claims: dict[str, list[str] | None] | ClaimsForbidden | None = None

    @classmethod
    def start(cls, body: dict[str, Any], pods: list[dict[str, Any]], now: dt.datetime) -> Pass:
        meta = body.get("metadata") or {}
        owned, foreign = ownership.split(pods, meta.get("uid", ""))
        old: dict[str, Any] = dict(body.get("status") or {})
        phase = old.get("phase") or "Pending"
        # The restarts come from the operator's own record (annotations on the job), never from
        # `status.restarts`, which a pod may write where the status policy is absent.
        restarts, counted = restart_record.read(meta, owned, MAX_RESTARTS)
        status: dict[str, Any] = {
            "phase": phase if phase in PHASES else "Pending",
            "observedGeneration": meta.get("generation", 0),
            "restarts": restarts,
            "countedRestarts": counted,
        }
        for key in ("startTime", "completionTime"):
            if old.get(key):
                status[key] = old[key]
        conditions = list(old.get("conditions") or [])
        return cls(now, body, meta, old, owned, foreign, Plan(status=status), conditions, phase)

    # -- what the steps read -------------------------------------------------------------------

    @property
    def status(self) -> dict[str, Any]:
        """The new status being built (the operator's keys; the plan's `status`)."""
        return self.plan.status

    @property
    def name(self) -> str:
        return str(self.meta.get("name", ""))

    @property
    def uid(self) -> str:
        return str(self.meta.get("uid", ""))

    @property
    def job(self) -> RLTrainingJob:
        assert self.plan.job is not None, "a step after parse_spec"
        return self.plan.job

    @property
    def spec(self) -> JobSpec:
        return self.job.spec

    @property
    def incarnation(self) -> str:
        """When the gang was last resumed (after spec.suspend or Kueue's stop): part of its Kueue
        pod group's name, so a resumed gang is a new group (`kueue.group_name`)."""
        return str(self.condition(SUSPENDED).get("lastTransitionTime") or "")

    @property
    def kueue_group(self) -> str:
        return children.kueue_group(self.job, self.attempt, self.incarnation)

    @property
    def controller_name(self) -> str:
        return children.pod_name(self.name, contract.CONTROLLER_ROLE)

    def condition(self, type_: str) -> dict[str, Any]:
        return get_condition({"conditions": self.conditions}, type_) or {}

    def since(self, type_: str) -> dt.datetime | None:
        """When condition `type_` last flipped."""
        return parse_time(self.condition(type_).get("lastTransitionTime"))

    def failure_of(self, pod: dict[str, Any]) -> failure_policy.PodFailure | None:
        scheduling = self.spec.scheduling
        return failure_policy.pod_failure(
            pod, self.now, scheduling.timeout_seconds, scheduling.image_pull_timeout_seconds
        )

    def replace_alone(self, pod: dict[str, Any]) -> failure_policy.PodFailure | None:
        """A rollout pod's failure that a new pod can cure (it is replaced alone), else None."""
        f = self.failure_of(pod)
        return f if f is not None and f.acting and f.restartable else None

    def unfinished(self) -> list[dict[str, Any]]:
        """Pods of the current attempt that still hold a node and are not being deleted yet."""
        return [p for p in self.current if not is_terminal(p) and not is_deleting(p)]

    # -- what the steps write ------------------------------------------------------------------

    def cond(self, type_: str, true: bool, reason: str, message: str, restart_clock: bool = False) -> None:
        if restart_clock:  # a new wait begins even if the status does not flip
            self.conditions = [c for c in self.conditions if c.get("type") != type_]
        self.conditions = set_condition(self.conditions, type_, true, reason, message, self.now)

    def clear(self, type_: str, reason: str, message: str = "") -> None:
        """Set a condition False only when it is present and True (no churn of absent ones)."""
        if self.condition(type_).get("status") == "True":
            self.cond(type_, False, reason, message)

    def transition(self, new_phase: str, reason: str, message: str, warning: bool = False) -> None:
        if self.status["phase"] != new_phase:
            self.plan.events.append(Event("Warning" if warning else "Normal", reason, message))
        self.status["phase"] = new_phase

    def finish_job(self, phase: str, reason: str, message: str, event: tuple[str, str] | None = None) -> None:
        """Succeeded or Failed: the completion time, the phase's condition (and its Event, or
        `event`'s reason and message), the nodes freed, the TTL's wake-up."""
        self.status["completionTime"] = rfc3339(self.now)
        self.cond(phase, True, reason, message)
        self.clear(RUNNING, phase)
        self.transition(phase, *(event or (reason, message)), warning=phase == FAILED)
        self.plan.delete.extend(self.unfinished())
        if self.spec.ttl_seconds_after_finished is not None:
            self.plan.requeue(self.spec.ttl_seconds_after_finished)

    def _done_with(self) -> list[dict[str, Any]]:
        """Pods the job is done with: deleted by this plan, being deleted, terminated, or all of
        them once the job is suspended or finished (their Kueue pod groups get released)."""
        if self.status["phase"] in (*FINISHED, "Suspended"):
            return self.pods
        deleting = {x["metadata"]["name"] for x in self.plan.delete}
        return [x for x in self.pods if x["metadata"]["name"] in deleting or is_deleting(x) or is_terminal(x)]

    def finish(self) -> Plan:
        status, old = self.status, self.old
        status["conditions"] = self.conditions
        self.plan.record = restart_record.to_write(self.meta, status["restarts"], status["countedRestarts"])
        if status["countedRestarts"] == status["restarts"]:  # written only once a restart went uncounted
            del status["countedRestarts"]
            if "countedRestarts" in old:
                status["countedRestarts"] = None  # the merge patch removes it
        unique = {p["metadata"]["name"]: p for p in self.plan.delete}
        self.plan.delete[:] = list(unique.values())
        self.plan.release = kueue.to_release(self._done_with())
        prev_rollout = old.get(contract.STATUS_ROLLOUT) or {}
        status.setdefault(
            contract.STATUS_ROLLOUT,
            {k: prev_rollout[k] for k in ROLLOUT_KEYS if k in prev_rollout}
            or {
                contract.ROLLOUT_DESIRED: 0,
                contract.ROLLOUT_READY: 0,
                contract.ROLLOUT_SELECTOR: children.selector(self.name, "rollout"),
                contract.ROLLOUT_GENERATION: 0,
            },
        )
        total = self.plan.job.spec.training.steps if self.plan.job else 0
        status["summary"] = summary(
            {**old, **status, contract.STATUS_PROGRESS: old.get(contract.STATUS_PROGRESS) or {}}, total
        )
        return self.plan


#: A step of the pass: True ends the pass (the plan is complete), False hands on to the next.
Step = Callable[[Pass], bool]
DONE, NEXT = True, False
