"""The reconcile of one RLTrainingJob, as a pure function: observed state in, a `Plan` out.

`plan(job, pods, now)` looks at the job (spec and the status it last wrote) and at the pods that
carry the job's label, and returns what to do: the new status, the pods to create and delete, the
Events to emit, and when to look again. It never relies on having seen an event: whatever the
operator finds after a restart, the same function computes the way forward (level-based).

The pass is a sequence of small named steps (`STEPS`), each a short function of a `Pass` (what
was observed, and the status and plan being built: `pass_state`) that either hands on to the next
step or ends the pass: parse_spec, sort_attempts, finished, suspended, resumed, kueue_stopped,
controller_succeeded, desired_pods, collect_failures, act_on_failures, report_problems,
restart_backoff, shared_storage, rollout_fleet, create_missing, count_members, all_created, all_scheduled,
all_running. Each has its own table-driven test (tests/unit/operator/test_operator_reconcile_steps.py).

The executor applies a plan in this order: status first (with the job's resourceVersion, so a plan
computed from a stale view is rejected), then pod deletions and creations. A crash between the
two leaves a status that the next pass completes. What the creates met (a refused child) is
reported afterwards (`child_failures`).

Phases::

    Pending ──all pods exist──> Scheduling ──all running──> Running ──controller pod Succeeded──> Succeeded
       ^                            │ timeout: Unschedulable (wait | fail)  │
       │                            └──────── gang pod failed/lost ─────────┴─> Restarting ─backoff─> (pods recreated)
       └─ spec.suspend=false ── Suspended <── spec.suspend=true (any unfinished phase)
                                            maxRestarts exhausted ──> Failed
"""

from __future__ import annotations

import datetime as dt
from typing import Any

from rlhf_api import contract, storage
from rlhf_api.fields import MAX_REPLICAS, SpecError
from rlhf_api.status import (
    FAILED,
    FINISHED,
    POD_FAILURE,
    QUEUED,
    RESTARTING,
    RUNNING,
    SCHEDULED,
    STORAGE_NOT_SHARED,
    SUCCEEDED,
    SUSPENDED,
    UNSCHEDULABLE,
    parse_time,
    rfc3339,
)
from rlhf_operator import (
    children,
    failure_policy,
    gang,
    images,
    kueue,
    ownership,
    parse_cache,
    pod_health,
    rollout,
    suspend,
    tenant_limits,
    ttl,
)
from rlhf_operator.pass_state import (
    DONE,
    NEXT,
    ClaimsForbidden,
    Event,
    Pass,
    Plan,
    Step,
    attempt_of,
    is_deleting,
    labels_of,
)
from rlhf_operator.status import condition_is

#: The largest rollout generation read from a status (a larger one is clamped to this).
MAX_GENERATION = 2**53
#: How often a job held back by its claims (`shared_storage`) looks at them again: a claim's
#: change wakes no pass (the operator watches no claims), so the fix is picked up within this.
CLAIM_RECHECK_SECONDS = 15.0


def parse_spec(p: Pass) -> bool:
    """An invalid spec fails the job (`InvalidSpec`, every problem named), and so does a job with
    no image on an operator with no default one (`images`), or one the operator's bounds refuse
    (`tenant_limits.refusal`: too many pods, a hostPath not allowed), or one whose checkpoint or run
    directory is not on a volume its writers share (`storage.cluster_storage_findings`, the rule
    `rlhf validate --cluster` applies: the trainer would fail at its first checkpoint), before a
    single pod is built; the pass ends there."""
    try:
        job = parse_cache.parse(p.body, admitted=p.admitted)
        no_image = images.missing_image(job.spec)
        if no_image:
            raise SpecError([no_image])
        not_shared = storage.cluster_storage_findings(job.spec, job.metadata_name).errors
        if not_shared:
            raise SpecError(not_shared)
        p.plan.job = job
    except SpecError as err:
        _invalid(p, "InvalidSpec", "; ".join(err.errors))
        return DONE
    refused = tenant_limits.refusal(p.job.spec, p.limits)
    if refused is not None:
        p.plan.job = None  # nothing is built from it: no pods, no static children
        _invalid(p, *refused)
        return DONE
    return NEXT


def _invalid(p: Pass, reason: str, message: str) -> None:
    p.plan.invalid = message
    if p.phase != "Failed":
        p.status["completionTime"] = rfc3339(p.now)
    p.cond(FAILED, True, reason, message)
    p.transition("Failed", reason, message, warning=True)


def sort_attempts(p: Pass) -> bool:
    """The current attempt's pods (label restart-attempt = restarts) count; older ones are deleted."""
    p.attempt = p.status["restarts"]
    p.current = [x for x in p.pods if attempt_of(x) == p.attempt]
    p.plan.delete.extend(x for x in p.pods if attempt_of(x) != p.attempt and not is_deleting(x))
    p.by_name = {x["metadata"]["name"]: x for x in p.pods}
    return NEXT


def finished(p: Pass) -> bool:
    """Succeeded or Failed: free the nodes, keep terminated pods for their logs, honour the TTL."""
    if p.phase not in FINISHED:
        return NEXT
    p.plan.delete.extend(p.unfinished())
    left = ttl.seconds_left(parse_time(p.old.get("completionTime")), p.spec.ttl_seconds_after_finished, p.now)
    if left is not None:
        if left <= 0:
            p.plan.delete_job = True
        else:
            p.plan.requeue(left)
    return DONE


def suspended(p: Pass) -> bool:
    """spec.suspend: remove every pod (checkpoints stay), phase Suspended."""
    if not p.spec.suspend:
        return NEXT
    p.plan.delete.extend(suspend.pods_to_remove(p.current))
    p.cond(SUSPENDED, True, "Suspended", "spec.suspend is true: pods removed, checkpoints kept")
    p.clear(SCHEDULED, "Suspended")
    p.clear(RUNNING, "Suspended")
    p.transition("Suspended", "Suspended", "job suspended; its pods are being removed")
    return DONE


def resumed(p: Pass) -> bool:
    """The pass that ends a suspension starts the job over from Pending (not a restart)."""
    if suspend.resumed(p.phase, p.spec.suspend):
        p.cond(
            SUSPENDED,
            False,
            "Resumed",
            "spec.suspend is false: pods recreated; training resumes from the last checkpoint",
        )
        p.transition("Pending", "Resumed", "job resumed from its last checkpoint")
        p.phase = "Pending"
    return NEXT


def kueue_stopped(p: Pass) -> bool:
    """Kueue stopped the gang's pod group (preemption, eviction: it marks the pods
    `TerminationTarget` and deletes them). A suspension, not a failure: the pods go, no restart
    is counted, and the next pass resumes the job as a new pod group, which Kueue queues until it
    admits it again (`kueue`)."""
    if not p.spec.scheduling.queue_name:
        return NEXT
    group = p.kueue_group
    hit = next((c for x in p.current if kueue.group_of(x) == group and (c := kueue.stopped(x))), None)
    if hit is None:
        return NEXT
    why = ": ".join(str(v) for v in (hit.get("reason"), hit.get("message")) if v) or "stopped"
    message = f"Kueue stopped pod group {group} ({why}): pods removed, checkpoints kept; the job queues again"
    p.plan.delete.extend(suspend.pods_to_remove(p.current))
    p.cond(SUSPENDED, True, "StoppedByKueue", message)
    p.clear(SCHEDULED, "StoppedByKueue")
    p.clear(RUNNING, "StoppedByKueue")
    p.transition("Suspended", "StoppedByKueue", message)
    return DONE


def controller_succeeded(p: Pass) -> bool:
    """The controller pod of the current attempt decides success."""
    controller = p.by_name.get(p.controller_name)
    if (
        controller is None
        or attempt_of(controller) != p.attempt
        or (controller.get("status") or {}).get("phase") != "Succeeded"
    ):
        return NEXT
    name = p.controller_name
    p.finish_job(
        SUCCEEDED,
        "ControllerSucceeded",
        f"pod {name} completed the training run",
        event=("Succeeded", f"training finished (pod {name} succeeded)"),
    )
    return DONE


def desired_pods(p: Pass) -> bool:
    """The gang's pods of this attempt (rollout pods are the fleet's: `rollout_fleet`)."""
    counts = children.role_replicas(p.spec)
    p.rollout_desired = counts.get("rollout", 0)
    p.desired_gang = {
        children.pod_name(p.name, role, i): (role, i)
        for role, n in counts.items()
        if role != "rollout"
        for i in range(n)
    }
    return NEXT


def collect_failures(p: Pass) -> bool:
    """Failures of the gang: pods failed, being deleted, unable to start, or (once the gang has
    started) gone; a worker that exited before the controller; and, until the job runs, a rollout
    pod a replacement would not cure (it cannot start without its fleet)."""
    started = p.phase in ("Scheduling", "Running")
    for name, (role, _) in p.desired_gang.items():
        pod = p.by_name.get(name)
        if pod is None or attempt_of(pod) != p.attempt:
            if started and pod is None:
                p.failures.append(failure_policy.missing_pod(name, role))
            continue
        if suspend.awaiting_removal(pod, p.phase):  # e.g. the suspension's pods, after a quick resume
            continue
        f = p.failure_of(pod)
        if f is None and name != p.controller_name and (pod.get("status") or {}).get("phase") == "Succeeded":
            f = failure_policy.worker_exited(name, labels_of(pod)[contract.ROLE])
        if f is not None:
            p.failures.append(f)
    for pod in p.current:
        if p.phase != "Running" and labels_of(pod).get(contract.ROLE) == "rollout":
            f = p.failure_of(pod)
            if f is not None and f.acting and not f.restartable:
                p.failures.append(f)
    return NEXT


def act_on_failures(p: Pass) -> bool:
    """The failure policy's decision on the failures that act now: a gang restart (counted or not)
    or the job Failed. A job already Restarting has acted; its next attempt's pods are not here yet."""
    acting = [f for f in p.failures if f.acting]
    if not acting or p.phase == "Restarting":
        return NEXT
    status = p.status
    decision = failure_policy.decide(
        p.spec.failure_policy,
        acting,
        status["countedRestarts"],
        status["restarts"] - status["countedRestarts"],
    )
    detail = "; ".join(f.message for f in acting[:3])
    if decision.action == failure_policy.FAIL_JOB:
        _fail(p, decision, detail)
    else:
        _restart(p, decision, detail)
    return DONE


def _fail(p: Pass, decision: failure_policy.Decision, detail: str) -> None:
    first = decision.verdict.failure
    policy = p.spec.failure_policy
    if decision.exhausted:
        reason = "MaxRestartsExceeded"
        message = f"{detail}; maxRestarts ({policy.max_restarts}) exhausted after {p.status['countedRestarts']} restarts"
    elif decision.verdict.rule is not None:
        reason = "FailedByRule"
        message = f"{first.message}; the job fails: {decision.verdict.describe()}"
    else:
        reason = first.reason
        message = (
            f"{first.message}; the job fails without a gang restart: the restarted pods "
            "would pull the same image (fix spec.image or its pull secret, then re-create the job)"
        )
    p.cond(POD_FAILURE, True, first.reason, first.message)
    p.finish_job(FAILED, reason, message)


def _restart(p: Pass, decision: failure_policy.Decision, detail: str) -> None:
    """Every pod of this attempt deleted; the next attempt's are created after the backoff."""
    first = decision.verdict.failure
    policy = p.spec.failure_policy
    status = p.status
    status["restarts"] += 1
    delay = failure_policy.backoff_seconds(policy, status["restarts"])
    if decision.action == failure_policy.RESTART_GANG:
        status["countedRestarts"] += 1
        counted = f"gang restart {status['countedRestarts']}/{policy.max_restarts}"
    else:  # a RestartGangNoCount rule
        counted = f"gang restart not counted against maxRestarts ({decision.verdict.describe()})"
    message = f"{detail}; {counted} from the last checkpoint in {delay:.0f}s"
    p.cond(RESTARTING, True, first.reason, message)
    p.cond(SCHEDULED, False, "Restarting", "the gang is restarting")
    p.clear(RUNNING, "Restarting", "the gang is restarting")
    p.clear(POD_FAILURE, "GangRestart", first.message)  # the next attempt's problems are new ones
    p.transition("Restarting", "GangRestart", message, warning=True)
    p.plan.delete.extend(x for x in p.current if not is_deleting(x))  # now stale: a new attempt begins
    status[contract.STATUS_ROLLOUT] = {
        contract.ROLLOUT_DESIRED: p.rollout_desired,
        contract.ROLLOUT_READY: 0,
        contract.ROLLOUT_SELECTOR: children.selector(p.name, "rollout"),
        contract.ROLLOUT_GENERATION: _generation(p.old, contract.ROLLOUT_GENERATION) + 1,
    }
    p.plan.requeue(delay)


def report_problems(p: Pass) -> bool:
    """What does not act yet (the kubelet still retries; a rollout pod a new one would not cure)
    sets the PodFailure condition, with one Warning Event per occurrence; wake up when it acts,
    and when a bound pod reaches its start timeout."""
    reported = [f for f in p.failures if not f.acting or p.phase == "Restarting"]
    for pod in p.current:
        f = p.failure_of(pod) if labels_of(pod).get(contract.ROLE) == "rollout" else None
        if f is not None and p.replace_alone(pod) is None and f not in reported:
            reported.append(f)
    for f in reported:
        if not f.acting:
            p.plan.requeue(f.act_in)
    timeout, pull_timeout = p.spec.scheduling.timeout_seconds, p.spec.scheduling.image_pull_timeout_seconds
    for pod in p.current:
        left = pod_health.seconds_to_start_timeout(pod, p.now, timeout, pull_timeout)
        if left is not None and left > 0:
            p.plan.requeue(left)
    if reported:
        _report(p, reported)
    else:
        p.clear(POD_FAILURE, "PodsHealthy", "no pod of the current attempt has a problem")
    return NEXT


def _report(p: Pass, reported: list[failure_policy.PodFailure]) -> None:
    was = p.condition(POD_FAILURE)

    def reported_before(f: failure_policy.PodFailure) -> bool:
        return (
            was.get("status") == "True"
            and was.get("reason") == f.reason
            and str(was.get("message", "")).startswith(f.subject + ":")
        )

    # Keep naming the occurrence already reported while it lasts (pods of a gang show the same
    # problem one after the other); the others are listed.
    report = next((f for f in reported if reported_before(f)), reported[0])
    same = reported_before(report)
    message = report.message
    others = sorted({f.pod for f in reported} - {report.pod})
    if others:
        more = f" and {len(others) - 5} more" if len(others) > 5 else ""
        message += f"; also pods {', '.join(others[:5])}{more}"
    if not same:
        p.plan.events.append(Event("Warning", report.reason, message))
    elif "BackOff" in message and "BackOff" not in str(was.get("message")):
        message = str(was.get("message"))  # keep the pull error itself, not the kubelet's back-off line
    p.cond(POD_FAILURE, True, report.reason, message)


def restart_backoff(p: Pass) -> bool:
    """A restarting gang waits out its backoff (from when Restarting turned True)."""
    if p.phase != "Restarting":
        return NEXT
    since = p.since(RESTARTING)
    wait = failure_policy.backoff_seconds(p.spec.failure_policy, p.status["restarts"])
    left = wait - ((p.now - since).total_seconds() if since else wait)
    if left > 0:
        p.plan.requeue(left)
        return DONE
    return NEXT


def shared_storage(p: Pass) -> bool:
    """Before the gang's pods are created (Pending, Restarting): each claim that several pods
    write is one they can all mount, ReadWriteMany (`storage.claim_findings`, from the claims as
    read from the cluster). Otherwise `StorageNotShared` names the claim and its access mode, no
    pod is created, and the pass looks again in `CLAIM_RECHECK_SECONDS`: the job goes on by itself
    once the claim is fixed (or the spec)."""
    if p.claims is None or p.phase not in ("Pending", "Restarting"):
        return NEXT
    if isinstance(p.claims, ClaimsForbidden):
        reason, message = CLAIMS_FORBIDDEN, claims_forbidden_message(p.claims)
    else:
        problems = storage.claim_findings(p.spec, p.name, p.claims)
        if not problems:
            p.clear(
                STORAGE_NOT_SHARED, "ClaimsShared", "every claim that several pods write is ReadWriteMany"
            )
            return NEXT
        reason, message = "ClaimNotShared", "; ".join(problems) + "; no pod is created until then"
    was = p.condition(STORAGE_NOT_SHARED)
    if was.get("status") != "True" or was.get("message") != message:
        p.plan.events.append(Event("Warning", reason, message))
    p.cond(STORAGE_NOT_SHARED, True, reason, message)
    p.plan.requeue(CLAIM_RECHECK_SECONDS)
    return DONE


#: `StorageNotShared`'s reason while the operator may not read the job's claims (its RBAC).
CLAIMS_FORBIDDEN = "ClaimsForbidden"


def claims_forbidden_message(denied: ClaimsForbidden) -> str:
    """What `StorageNotShared` says when the API server refused the operator's read of a claim."""
    return (
        f"the operator may not get the persistentVolumeClaim {denied.claim!r} in namespace "
        f"{denied.namespace!r} (HTTP 403: {tenant_limits.clip(denied.message, 500)}): its ClusterRole "
        "lacks the verb get on persistentvolumeclaims (a ClusterRole of an older chart); upgrade the "
        "chart's RBAC or grant that verb, so that the operator can check that the job's pods can all "
        f"write the claim; no pod is created until then (checked again every {CLAIM_RECHECK_SECONDS:.0f} s)"
    )


def _generation(status: dict[str, Any], key: str) -> int:
    """`status.rollout.<key>` as a bounded integer (0 when absent or not a number)."""
    prev = status.get(contract.STATUS_ROLLOUT)
    return tenant_limits.clamp_int(prev.get(key) if isinstance(prev, dict) else None, 0, MAX_GENERATION)


def rollout_fleet(p: Pass) -> bool:
    """The elastic fleet through the resharding protocol (`rollout.plan_rollout`): failed members
    replaced alone, leavers drained before deletion, the generation bumped on each change."""
    raw = p.old.get(contract.STATUS_ROLLOUT)
    prev: dict[str, Any] = raw if isinstance(raw, dict) else {}
    rplan = rollout.plan_rollout(
        [x for x in p.current if labels_of(x).get(contract.ROLE) == "rollout"],
        desired=p.rollout_desired,
        previous_desired=tenant_limits.clamp_int(prev.get(contract.ROLLOUT_DESIRED), 0, MAX_REPLICAS)
        if contract.ROLLOUT_GENERATION in prev
        else None,
        generation=_generation(p.old, contract.ROLLOUT_GENERATION),
        # Written by the controller pod (the pod contract's status key), read here: clamped.
        synced_generation=_generation(p.old, contract.ROLLOUT_SYNCED_GENERATION),
        job_started=p.phase in ("Scheduling", "Running"),
        failure_of=p.replace_alone,
    )
    p.plan.delete.extend(rplan.delete)
    for msg in rplan.failures:
        p.plan.events.append(Event("Warning", "RolloutReplicaFailed", msg))
    for msg in rplan.changes:
        p.plan.events.append(
            Event("Normal", "RolloutMembershipChanged", f"{msg} (generation {rplan.generation})")
        )
    p.status[contract.STATUS_ROLLOUT] = {
        contract.ROLLOUT_DESIRED: p.rollout_desired,
        contract.ROLLOUT_READY: rplan.ready,
        contract.ROLLOUT_SELECTOR: children.selector(p.name, "rollout"),
        contract.ROLLOUT_GENERATION: rplan.generation,
    }
    p.leaving = set(rplan.draining) | {x["metadata"]["name"] for x in rplan.delete}
    for i in rplan.create:
        pod = children.build_pod(p.job, "rollout", i, p.attempt, p.incarnation)
        p.desired_rollout[pod["metadata"]["name"]] = pod
    return NEXT


def create_missing(p: Pass) -> bool:
    """Create every wanted pod that does not exist; a name still held by a terminating pod waits
    for the next pass, one held by a pod the job does not own is reported (`ownership`)."""
    held = {x["metadata"]["name"]: x for x in p.foreign}
    for name, (role, index) in p.desired_gang.items():
        if name not in p.by_name and name not in held:
            p.plan.create.append(children.build_pod(p.job, role, index, p.attempt, p.incarnation))
    p.plan.create.extend(
        pod for name, pod in p.desired_rollout.items() if name not in p.by_name and name not in held
    )
    want = [*p.desired_gang, *p.desired_rollout]
    p.plan.blocked.extend(ownership.not_owned(held[name], p.uid) for name in sorted(want) if name in held)
    return NEXT


def count_members(p: Pass) -> bool:
    """The pods that make up the gang and the wanted fleet (not leaving, not awaiting removal)."""
    names = set(p.desired_gang) | {children.pod_name(p.name, "rollout", i) for i in range(p.rollout_desired)}
    p.members = [
        x
        for x in p.current
        if x["metadata"]["name"] in names
        and x["metadata"]["name"] not in p.leaving
        and not suspend.awaiting_removal(x, p.phase)  # held names: the gang is not all there yet
    ]
    p.expected = len(p.desired_gang) + p.rollout_desired
    return NEXT


def all_created(p: Pass) -> bool:
    """Pending or Restarting: once every pod exists, Scheduling (its clock starts now)."""
    if p.phase not in ("Pending", "Restarting"):
        return NEXT
    if len(p.members) != p.expected:
        return DONE
    if p.phase == "Restarting":
        p.cond(RESTARTING, False, "PodsRecreated", f"restart {p.status['restarts']}: every pod recreated")
    p.cond(SCHEDULED, False, "WaitingForScheduler", f"{p.expected} pods created", restart_clock=True)
    p.transition("Scheduling", "PodsCreated", f"all {p.expected} pods of attempt {p.attempt} created")
    p.phase = "Scheduling"
    return NEXT


def all_scheduled(p: Pass) -> bool:
    """Scheduling: every pod bound, or past scheduling.timeoutSeconds Unschedulable (then wait or
    fail, per onTimeout)."""
    if p.phase != "Scheduling":
        return NEXT
    if _queued(p):
        return NEXT
    state = gang.gang_state(p.members, p.expected)
    if state.all_scheduled:
        p.cond(SCHEDULED, True, "AllScheduled", f"all {p.expected} pods bound to nodes")
        p.clear(UNSCHEDULABLE, "AllScheduled")
        return NEXT
    since = max((t for t in (p.since(SCHEDULED), p.since(QUEUED)) if t is not None), default=None)
    waited = (p.now - since).total_seconds() if since else 0.0
    timeout = p.spec.scheduling.timeout_seconds
    if not gang.timed_out(waited, timeout):
        p.plan.requeue(timeout - waited)
        return NEXT
    message = f"{p.expected - state.scheduled}/{p.expected} pods unscheduled after {timeout}s: {state.reason}"
    if not condition_is({"conditions": p.conditions}, UNSCHEDULABLE):
        p.plan.events.append(Event("Warning", "Unschedulable", message))
    p.cond(UNSCHEDULABLE, True, "Unschedulable", message)
    if p.spec.scheduling.on_timeout != "fail":
        return NEXT
    p.status["completionTime"] = rfc3339(p.now)
    p.cond(FAILED, True, "Unschedulable", message)
    p.transition("Failed", "Unschedulable", message, warning=True)
    p.plan.create.clear()
    p.plan.delete.extend(x for x in p.current if not is_deleting(x) and x not in p.plan.delete)
    return DONE


def _queued(p: Pass) -> bool:
    """Pods Kueue holds back (its admission gate) wait for quota, not for a node: the Queued
    condition, and no scheduling timeout until Kueue admits them (then it counts from there)."""
    gated = sorted(x["metadata"]["name"] for x in p.members if kueue.is_gated(x))
    if gated:
        more = f" and {len(gated) - 5} more" if len(gated) > 5 else ""
        queue = p.spec.scheduling.queue_name or "?"
        p.cond(
            QUEUED,
            True,
            "WaitingForKueue",
            f"{len(gated)}/{p.expected} pods wait for Kueue to admit them (LocalQueue {queue}): "
            f"{', '.join(gated[:5])}{more}",
        )
        return True
    if p.condition(QUEUED).get("status") == "True":
        p.cond(QUEUED, False, "Admitted", "Kueue admitted the pods")
    return False


def all_running(p: Pass) -> bool:
    """Scheduling: once every pod runs, Running (startTime set once)."""
    if p.phase == "Scheduling" and gang.gang_state(p.members, p.expected).all_running:
        p.cond(RUNNING, True, "AllRunning", f"all {p.expected} pods running")
        p.status.setdefault("startTime", rfc3339(p.now))
        p.transition("Running", "Running", f"all {p.expected} pods running")
    return DONE


#: The pass, in order. Each step is short and has its own table-driven test
#: (tests/unit/operator/test_operator_reconcile_steps.py).
STEPS: tuple[Step, ...] = (
    parse_spec,
    sort_attempts,
    finished,
    suspended,
    resumed,
    kueue_stopped,
    controller_succeeded,
    desired_pods,
    collect_failures,
    act_on_failures,
    report_problems,
    restart_backoff,
    shared_storage,
    rollout_fleet,
    create_missing,
    count_members,
    all_created,
    all_scheduled,
    all_running,
)


def plan(
    body: dict[str, Any],
    pods: list[dict[str, Any]],
    now: dt.datetime,
    admitted: bool = False,
    limits: tenant_limits.Limits | None = None,
    claims: dict[str, list[str] | None] | ClaimsForbidden | None = None,
) -> Plan:
    """Reconcile one job. `body` is the job as read from the API server; `pods` its labelled pods
    (only those whose controller owner reference carries the job's UID count; see `ownership`);
    `admitted`: the API server enforced the CRD's rules on `body` (see `parse_cache.parse`); `limits`:
    the operator's bounds on a job (default: `tenant_limits.Limits()`); `claims`: the access modes of
    the claims several of its pods write (`storage.shared_claims`; `ClaimsForbidden`: the operator may
    not read them; None: not read, not checked)."""
    p = Pass.start(body, pods, now)
    p.admitted = admitted
    p.limits = limits or tenant_limits.Limits()
    p.claims = claims
    for step in STEPS:
        if step(p) is DONE:
            break
    return p.finish()
