"""The reconcile of one RLTrainingJob, as a pure function: observed state in, a `Plan` out.

`plan(job, pods, now)` looks at the job (spec and the status it last wrote) and at the pods that
carry the job's label, and returns what to do: the new status, the pods to create and delete, the
Events to emit, and when to look again. It never relies on having seen an event: whatever the
operator finds after a restart, the same function computes the way forward (level-based).

The handler applies a plan in this order: status first (with the job's resourceVersion, so a plan
computed from a stale view is rejected), then pod deletions and creations. A crash between the
two leaves a status that the next pass completes.

Phases::

    Pending ──all pods exist──> Scheduling ──all running──> Running ──controller pod Succeeded──> Succeeded
       ^                            │ timeout: Unschedulable (wait | fail)  │
       │                            └──────── gang pod failed/lost ─────────┴─> Restarting ─backoff─> (pods recreated)
       └─ spec.suspend=false ── Suspended <── spec.suspend=true (any unfinished phase)
                                            maxRestarts exhausted ──> Failed
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass, field
from typing import Any

from rlhf_operator import children, failure_policy, gang, labels, rollout, suspend, ttl
from rlhf_operator.status import (
    FAILED,
    FINISHED,
    RESTARTING,
    RUNNING,
    SCHEDULED,
    SUCCEEDED,
    SUSPENDED,
    UNSCHEDULABLE,
    condition_is,
    get_condition,
    parse_time,
    rfc3339,
    set_condition,
    summary,
)
from rlhf_trainer.spec import RLTrainingJob, SpecError, parse_job

#: The status keys the operator owns (progress and rollout.syncedGeneration belong to the controller pod).
OPERATOR_KEYS = (
    "phase",
    "conditions",
    "observedGeneration",
    "restarts",
    "startTime",
    "completionTime",
    "rollout",
    "summary",
)
ROLLOUT_KEYS = ("desired", "ready", "selector", "generation")


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
    #: The spec is invalid: the status says so, and the handler stops with a PermanentError.
    invalid: str | None = None
    #: Parsed job (None when invalid); the handler uses it to build the static children.
    job: RLTrainingJob | None = None

    def requeue(self, seconds: float) -> None:
        seconds = max(seconds, 0.0)
        self.requeue_after = seconds if self.requeue_after is None else min(self.requeue_after, seconds)


def operator_status(status: dict[str, Any]) -> dict[str, Any]:
    """The part of a status the operator writes, as the API server stores it after a merge patch
    (null values removed): compare an old status with a plan's through this."""
    out = {k: status[k] for k in OPERATOR_KEYS if k in status and k != "rollout"}
    if "rollout" in status:
        out["rollout"] = {k: v for k, v in (status.get("rollout") or {}).items() if k in ROLLOUT_KEYS}
    return _without_nulls(out)


def _without_nulls(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _without_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_without_nulls(v) for v in value]
    return value


def _labels(pod: dict[str, Any]) -> dict[str, str]:
    return (pod.get("metadata") or {}).get("labels") or {}


def _attempt(pod: dict[str, Any]) -> int:
    try:
        return int(_labels(pod).get(labels.RESTART_ATTEMPT, "0"))
    except ValueError:
        return -1


def _deleting(pod: dict[str, Any]) -> bool:
    return bool((pod.get("metadata") or {}).get("deletionTimestamp"))


def _terminal(pod: dict[str, Any]) -> bool:
    return (pod.get("status") or {}).get("phase") in ("Succeeded", "Failed")


def plan(body: dict[str, Any], pods: list[dict[str, Any]], now: dt.datetime) -> Plan:
    """Reconcile one job. `body` is the job as read from the API server; `pods` its labelled pods."""
    meta = body.get("metadata") or {}
    old: dict[str, Any] = dict(body.get("status") or {})
    conditions: list[dict[str, Any]] = list(old.get("conditions") or [])
    phase = old.get("phase") or "Pending"
    st: dict[str, Any] = {
        "phase": phase,
        "observedGeneration": meta.get("generation", 0),
        "restarts": int(old.get("restarts") or 0),
    }
    for key in ("startTime", "completionTime"):
        if old.get(key):
            st[key] = old[key]
    out = Plan(status=st)

    def cond(type_: str, true: bool, reason: str, message: str, restart_clock: bool = False) -> None:
        nonlocal conditions
        if restart_clock:  # a new wait begins even if the status does not flip
            conditions = [c for c in conditions if c.get("type") != type_]
        conditions = set_condition(conditions, type_, true, reason, message, now)

    def clear(type_: str, reason: str, message: str = "") -> None:
        """Set a condition False only when it is present and True (no churn of absent ones)."""
        c = get_condition({"conditions": conditions}, type_)
        if c and c.get("status") == "True":
            cond(type_, False, reason, message)

    def transition(new_phase: str, reason: str, message: str, warning: bool = False) -> None:
        if st["phase"] != new_phase:
            out.events.append(Event("Warning" if warning else "Normal", reason, message))
        st["phase"] = new_phase

    def finish() -> Plan:
        st["conditions"] = conditions
        unique = {p["metadata"]["name"]: p for p in out.delete}
        out.delete[:] = list(unique.values())
        prev_rollout = old.get("rollout") or {}
        st.setdefault(
            "rollout",
            {k: prev_rollout[k] for k in ROLLOUT_KEYS if k in prev_rollout}
            or {"desired": 0, "ready": 0, "selector": children.selector(name, "rollout"), "generation": 0},
        )
        total = out.job.spec.training.steps if out.job else 0
        st["summary"] = summary({**old, **st, "progress": old.get("progress") or {}}, total)
        return out

    name = meta.get("name", "")
    try:
        job = parse_job({k: v for k, v in body.items() if k != "status"})
    except SpecError as err:
        message = "; ".join(err.errors)
        out.invalid = message
        if phase != "Failed":
            st["completionTime"] = rfc3339(now)
        cond(FAILED, True, "InvalidSpec", message)
        transition("Failed", "InvalidSpec", message, warning=True)
        return finish()
    out.job = job
    spec = job.spec
    attempt = st["restarts"]
    current = [p for p in pods if _attempt(p) == attempt]
    stale = [p for p in pods if _attempt(p) != attempt]
    out.delete.extend(p for p in stale if not _deleting(p))
    by_name = {p["metadata"]["name"]: p for p in pods}

    # -- finished: free the nodes, keep terminated pods for their logs, honour the TTL ---------------
    if phase in FINISHED:
        out.delete.extend(p for p in current if not _terminal(p) and not _deleting(p))
        left = ttl.seconds_left(parse_time(old.get("completionTime")), spec.ttl_seconds_after_finished, now)
        if left is not None:
            if left <= 0:
                out.delete_job = True
            else:
                out.requeue(left)
        return finish()

    # -- suspend ----------------------------------------------------------------------------------
    if spec.suspend:
        out.delete.extend(p for p in suspend.pods_to_remove(current))
        cond(SUSPENDED, True, "Suspended", "spec.suspend is true: pods removed, checkpoints kept")
        clear(SCHEDULED, "Suspended")
        clear(RUNNING, "Suspended")
        transition("Suspended", "Suspended", "job suspended; its pods are being removed")
        return finish()
    if suspend.resumed(phase, spec.suspend):
        cond(
            SUSPENDED,
            False,
            "Resumed",
            "spec.suspend is false: pods recreated; training resumes from the last checkpoint",
        )
        transition("Pending", "Resumed", "job resumed from its last checkpoint")
        phase = "Pending"

    # -- the controller pod decides success -----------------------------------------------------------
    controller_name = children.pod_name(name, labels.CONTROLLER_ROLE)
    controller = by_name.get(controller_name)
    if (
        controller is not None
        and _attempt(controller) == attempt
        and (controller.get("status") or {}).get("phase") == "Succeeded"
    ):
        st["completionTime"] = rfc3339(now)
        cond(SUCCEEDED, True, "ControllerSucceeded", f"pod {controller_name} completed the training run")
        clear(RUNNING, "Succeeded")
        transition("Succeeded", "Succeeded", f"training finished (pod {controller_name} succeeded)")
        out.delete.extend(p for p in current if not _terminal(p) and not _deleting(p))
        if spec.ttl_seconds_after_finished is not None:
            out.requeue(spec.ttl_seconds_after_finished)
        return finish()

    # -- desired pods ---------------------------------------------------------------------------
    replicas = children.role_replicas(spec)
    rollout_desired = replicas.get("rollout", 0)
    desired_gang = {
        n: p
        for n, p in children.build_pods(job, attempt, rollout_replicas=0).items()
        if _labels(p)[labels.ROLE] != "rollout"
    }
    started = phase in ("Scheduling", "Running")

    # -- gang failures ----------------------------------------------------------------------------
    failures: list[failure_policy.PodFailure] = []
    for pname in desired_gang:
        pod = by_name.get(pname)
        if pod is None or _attempt(pod) != attempt:
            if started and pod is None:
                failures.append(failure_policy.missing_pod(pname, _labels(desired_gang[pname])[labels.ROLE]))
            continue
        f = failure_policy.pod_failure(pod)
        if f is None and pname != controller_name and (pod.get("status") or {}).get("phase") == "Succeeded":
            f = failure_policy.PodFailure(
                pname, _labels(pod)[labels.ROLE], "WorkerExited", f"pod {pname} exited before the controller"
            )
        if f is not None:
            failures.append(f)
    if failures and phase != "Restarting":
        first = failures[0]
        detail = "; ".join(f.message for f in failures[:3])
        policy = spec.failure_policy
        rgen = int((old.get("rollout") or {}).get("generation") or 0)
        if failure_policy.exhausted(policy, st["restarts"]):
            message = (
                f"{detail}; maxRestarts ({policy.max_restarts}) exhausted after {st['restarts']} restarts"
            )
            st["completionTime"] = rfc3339(now)
            cond(FAILED, True, "MaxRestartsExceeded", message)
            clear(RUNNING, "Failed")
            transition("Failed", "MaxRestartsExceeded", message, warning=True)
            out.delete.extend(p for p in current if not _terminal(p) and not _deleting(p))
            if spec.ttl_seconds_after_finished is not None:
                out.requeue(spec.ttl_seconds_after_finished)
            return finish()
        st["restarts"] += 1
        delay = failure_policy.backoff_seconds(policy, st["restarts"])
        message = f"{detail}; gang restart {st['restarts']}/{policy.max_restarts} from the last checkpoint in {delay:.0f}s"
        cond(RESTARTING, True, first.reason, message)
        cond(SCHEDULED, False, "Restarting", "the gang is restarting")
        clear(RUNNING, "Restarting", "the gang is restarting")
        transition("Restarting", "GangRestart", message, warning=True)
        out.delete.extend(p for p in current if not _deleting(p))  # now stale: a new attempt begins
        st["rollout"] = {
            "desired": rollout_desired,
            "ready": 0,
            "selector": children.selector(name, "rollout"),
            "generation": rgen + 1,
        }
        out.requeue(delay)
        return finish()

    # -- restart backoff --------------------------------------------------------------------------
    if phase == "Restarting":
        since = parse_time(
            (get_condition({"conditions": conditions}, RESTARTING) or {}).get("lastTransitionTime")
        )
        wait = failure_policy.backoff_seconds(spec.failure_policy, st["restarts"])
        left = wait - ((now - since).total_seconds() if since else wait)
        if left > 0:
            out.requeue(left)
            return finish()

    # -- rollout fleet ------------------------------------------------------------------------------
    prev_rollout = old.get("rollout") or {}
    rollout_pods = [p for p in current if _labels(p).get(labels.ROLE) == "rollout"]
    rplan = rollout.plan_rollout(
        rollout_pods,
        desired=rollout_desired,
        previous_desired=prev_rollout.get("desired") if "generation" in prev_rollout else None,
        generation=int(prev_rollout.get("generation") or 0),
        synced_generation=int(prev_rollout.get("syncedGeneration") or 0),
        job_started=started,
    )
    out.delete.extend(rplan.delete)
    for msg in rplan.failures:
        out.events.append(Event("Warning", "RolloutReplicaFailed", msg))
    for msg in rplan.changes:
        out.events.append(
            Event("Normal", "RolloutMembershipChanged", f"{msg} (generation {rplan.generation})")
        )
    st["rollout"] = {
        "desired": rollout_desired,
        "ready": rplan.ready,
        "selector": children.selector(name, "rollout"),
        "generation": rplan.generation,
    }

    # -- create what is missing (a name still held by a terminating pod waits for the next pass) ------
    want = dict(desired_gang)
    for i in rplan.create:
        pod = children.build_pod(job, "rollout", i, attempt)
        want[pod["metadata"]["name"]] = pod
    leaving = set(rplan.draining) | {p["metadata"]["name"] for p in rplan.delete}
    out.create.extend(pod for pname, pod in want.items() if pname not in by_name)

    # -- phase ------------------------------------------------------------------------------------
    member_names = set(desired_gang) | {children.pod_name(name, "rollout", i) for i in range(rollout_desired)}
    members = [
        p for p in current if p["metadata"]["name"] in member_names and p["metadata"]["name"] not in leaving
    ]
    expected = len(desired_gang) + rollout_desired
    all_exist = len(members) == expected
    if phase in ("Pending", "Restarting"):
        if all_exist:
            if phase == "Restarting":
                cond(RESTARTING, False, "PodsRecreated", f"restart {st['restarts']}: every pod recreated")
            cond(SCHEDULED, False, "WaitingForScheduler", f"{expected} pods created", restart_clock=True)
            transition("Scheduling", "PodsCreated", f"all {expected} pods of attempt {attempt} created")
            phase = "Scheduling"
        else:
            return finish()
    state = gang.gang_state(members, expected)
    if phase == "Scheduling":
        if state.all_scheduled:
            cond(SCHEDULED, True, "AllScheduled", f"all {expected} pods bound to nodes")
            clear(UNSCHEDULABLE, "AllScheduled")
        else:
            since = parse_time(
                (get_condition({"conditions": conditions}, SCHEDULED) or {}).get("lastTransitionTime")
            )
            waited = (now - since).total_seconds() if since else 0.0
            timeout = spec.scheduling.timeout_seconds
            if gang.timed_out(waited, timeout):
                message = f"{expected - state.scheduled}/{expected} pods unscheduled after {timeout}s: {state.reason}"
                if not condition_is({"conditions": conditions}, UNSCHEDULABLE):
                    out.events.append(Event("Warning", "Unschedulable", message))
                cond(UNSCHEDULABLE, True, "Unschedulable", message)
                if spec.scheduling.on_timeout == "fail":
                    st["completionTime"] = rfc3339(now)
                    cond(FAILED, True, "Unschedulable", message)
                    transition("Failed", "Unschedulable", message, warning=True)
                    out.create.clear()
                    out.delete.extend(p for p in current if not _deleting(p) and p not in out.delete)
                    return finish()
            else:
                out.requeue(timeout - waited)
        if state.all_running:
            cond(RUNNING, True, "AllRunning", f"all {expected} pods running")
            st.setdefault("startTime", rfc3339(now))
            transition("Running", "Running", f"all {expected} pods running")
    return finish()
