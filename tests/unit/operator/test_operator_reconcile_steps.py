"""Each step of `reconcile.plan` on its own, one table each. A case builds the job and its pods,
runs the pass up to the step under test (the earlier steps must hand on), runs the step, and
compares what it decided: whether it ended the pass, and what it wrote into the status and plan.
Whole passes are in test_operator_reconcile*.py."""

from __future__ import annotations

import copy
import sys
from collections.abc import Callable
from typing import Any

import pytest
from operator_helpers import (
    BASE_SPEC,
    T0,
    at,
    job,
    names,
    phase,
    running,
    scheduled,
    unschedulable,
    with_record,
)

from rlhf_api.loader import parse_job
from rlhf_api.status import rfc3339
from rlhf_operator import children, pass_state, reconcile

ALL = ["j-actor-0", "j-actor-1", "j-controller", "j-reference-0", "j-rollout-0", "j-rollout-1"]
GANG = ["j-actor-0", "j-actor-1", "j-controller", "j-reference-0"]
DONE, NEXT = pass_state.DONE, pass_state.NEXT
Pod = dict[str, Any]
State = Callable[[Pod], Pod]


def body_(
    phase_: str | None = None, restarts: int = 0, conditions: list[dict[str, Any]] | None = None, **spec: Any
) -> dict[str, Any]:
    """The test job (operator_helpers.BASE_SPEC with `spec` updates) with a status in `phase_`."""
    b = job(**spec)
    if phase_ is not None:
        b["status"] = {"phase": phase_, "restarts": restarts, "conditions": conditions or []}
        b = with_record(b, restarts)  # the operator's own record says the same
    return b


def pods_(b: dict[str, Any], attempt: int = 0, state: State = running, **by_name: State) -> list[Pod]:
    """Every pod of the job at `attempt`, in `state`; `by_name` (with '-' as '_') overrides one.
    A state returning None leaves that pod out."""
    out = []
    for name, p in children.build_pods(parse_job(b), attempt).items():
        got = by_name.get(name.replace("-", "_"), state)(p)
        if got is not None:
            out.append(got)
    return out


def run_to(
    step: pass_state.Step,
    b: dict[str, Any],
    pods: list[Pod],
    t: float = 0,
    claims: dict[str, list[str] | None] | None = None,
) -> tuple[pass_state.Pass, bool]:
    """The pass up to `step` (each earlier step must hand on), then `step`: (pass, whether it ended);
    `claims`: the access modes of the claims as the executor read them (None: not read)."""
    p = pass_state.Pass.start(b, pods, at(t))
    p.claims = claims
    for s in reconcile.STEPS:
        if s is step:
            return p, step(p)
        assert s(p) is NEXT, f"the pass ended at {s.__name__}, before {step.__name__}"
    raise AssertionError(f"{step.__name__} is not a step")


def cond(p: pass_state.Pass, type_: str) -> tuple[str, str] | None:
    c = p.condition(type_)
    return (c["status"], c["reason"]) if c else None


def events(p: pass_state.Pass) -> list[str]:
    return [e.reason for e in p.plan.events]


def deleting(p: Pod) -> Pod:
    p = running(p)
    p["metadata"]["deletionTimestamp"] = "2025-01-01T12:00:00Z"
    return p


def failed(p: Pod) -> Pod:
    return phase(p, "Failed", "Error")


def succeeded(p: Pod) -> Pod:
    return phase(p, "Succeeded")


def gone(p: Pod) -> None:
    return None


def pulling(p: Pod) -> Pod:
    """Bound at T0, its image pull failing (the kubelet retries: acts 60 s after the bind)."""
    p = scheduled(p)
    p["status"]["conditions"][0]["lastTransitionTime"] = rfc3339(T0)
    p["status"]["containerStatuses"] = [
        {"name": "trainer", "state": {"waiting": {"reason": "ErrImagePull", "message": "not found"}}}
    ]
    return p


def bad_image(p: Pod) -> Pod:
    p = pulling(p)
    p["status"]["containerStatuses"][0]["state"]["waiting"]["reason"] = "InvalidImageName"
    return p


def waiting(p: Pod) -> Pod:
    return unschedulable(p, "0/3 nodes are available: insufficient nvidia.com/gpu")


def foreign(p: Pod) -> Pod:
    p = running(p)
    p["metadata"]["ownerReferences"][0]["uid"] = "someone-else"
    return p


CKPT_PVC = {"name": "c", "mountPath": "/ckpt", "persistentVolumeClaim": {"claimName": "c"}}
RUNNING_TRUE = [{"type": "Running", "status": "True", "reason": "AllRunning", "lastTransitionTime": "x"}]


def restarting_since(t: float) -> list[dict[str, Any]]:
    return [{"type": "Restarting", "status": "True", "reason": "Error", "lastTransitionTime": rfc3339(at(t))}]


def scheduled_clock(t: float) -> list[dict[str, Any]]:
    return [
        {
            "type": "Scheduled",
            "status": "False",
            "reason": "WaitingForScheduler",
            "lastTransitionTime": rfc3339(at(t)),
        }
    ]


def test_every_step_has_its_table() -> None:
    here = sys.modules[__name__]
    assert [s.__name__ for s in reconcile.STEPS if not hasattr(here, f"test_{s.__name__}")] == []


# -- parse_spec: (case, body) -> (ended, phase, invalid mentions, completionTime) -------------------

PARSE = [
    ("valid", body_("Running"), (NEXT, "Running", None, None)),
    (
        "invalid",
        body_("Running", roles={"actor": {"replicas": "two"}}),
        (DONE, "Failed", "spec.roles.actor.replicas", "2025-01-01T12:00:00Z"),
    ),
    (
        "invalid from the start",
        body_(None, algorithm={"name": "nope"}),
        (DONE, "Failed", "spec.algorithm.name", T0),
    ),
    (
        "checkpoints on each pod's own emptyDir (no shared volume): the storage rule of rlhf validate --cluster",
        body_(None, pod={}),
        (
            DONE,
            "Failed",
            "spec.checkpoint.dir: '<output.dir>/checkpoints' (/workspace/runs/j/checkpoints in the "
            "pods) is on the emptyDir 'workspace' of the controller pod and actor pods: every pod has its own",
            T0,
        ),
    ),
    (
        "checkpoints on the read-only root filesystem",
        body_(None, checkpoint={"dir": "/ckpt"}),
        (DONE, "Failed", "spec.checkpoint.dir: '/ckpt' is on the read-only root filesystem", T0),
    ),
    (
        "the claim in the actor pods only",
        body_(
            None,
            pod={},
            checkpoint={"dir": "/ckpt"},
            output={"dir": "/ckpt/runs/{name}"},
            roles={
                **BASE_SPEC["roles"],
                "actor": {**BASE_SPEC["roles"]["actor"], "pod": {"volumes": [CKPT_PVC]}},
            },
        ),
        (
            DONE,
            "Failed",
            "spec.checkpoint.dir: '/ckpt' is on the read-only root filesystem of the controller pod",
            T0,
        ),
    ),
    ("a claim all pods mount (BASE_SPEC)", body_(None), (NEXT, "Pending", None, None)),
]


@pytest.mark.parametrize("b,want", [c[1:] for c in PARSE], ids=[c[0] for c in PARSE])
def test_parse_spec(b: dict[str, Any], want: tuple[bool, str, str | None, Any]) -> None:
    p, ended = run_to(reconcile.parse_spec, b, [])
    mentions = want[2]
    assert (ended, p.status["phase"], p.status.get("completionTime")) == (
        want[0],
        want[1],
        rfc3339(T0) if want[3] else None,
    )
    assert (p.plan.invalid is None) if mentions is None else (mentions in (p.plan.invalid or ""))
    assert (cond(p, "Failed") == ("True", "InvalidSpec")) is (mentions is not None)


def test_parse_spec_keeps_the_completion_time_of_a_failed_job() -> None:
    b = body_("Failed", algorithm={"name": "nope"})
    b["status"]["completionTime"] = "2024-12-31T00:00:00Z"
    p, _ = run_to(reconcile.parse_spec, b, [])
    assert p.status["completionTime"] == "2024-12-31T00:00:00Z"


# -- sort_attempts: (case, restarts, pods) -> (current, deleted) --------------------------------------

B = body_("Running")
B1 = body_("Running", restarts=1)
SORT = [
    ("one attempt", 0, pods_(B), (ALL, [])),
    ("old attempt deleted", 1, pods_(B1, 0) + pods_(B1, 1), (ALL, ALL)),
    ("old pod already going", 1, pods_(B1, 0, state=deleting), ([], [])),
]


@pytest.mark.parametrize("restarts,pods,want", [c[1:] for c in SORT], ids=[c[0] for c in SORT])
def test_sort_attempts(restarts: int, pods: list[Pod], want: tuple[list[str], list[str]]) -> None:
    p, ended = run_to(reconcile.sort_attempts, body_("Running", restarts=restarts), pods)
    assert (ended, p.attempt, names(p.current), names(p.plan.delete)) == (NEXT, restarts, *want)


# -- finished: (case, phase, ttl, now, pods) -> (ended, deleted, requeue, delete the job) -------------

FINISHED = [
    ("running: not finished", "Running", None, 0, running, (NEXT, [], None, False)),
    ("pods freed, terminated kept", "Succeeded", None, 0, running, (DONE, ALL, None, False)),
    ("terminated pods kept", "Failed", None, 0, failed, (DONE, [], None, False)),
    ("TTL ahead", "Succeeded", 30, 10, succeeded, (DONE, [], 20.0, False)),
    ("TTL over", "Failed", 30, 45, failed, (DONE, [], None, True)),
]


@pytest.mark.parametrize("phase_,ttl,t,state,want", [c[1:] for c in FINISHED], ids=[c[0] for c in FINISHED])
def test_finished(
    phase_: str, ttl: int | None, t: float, state: State, want: tuple[bool, list[str], Any, bool]
) -> None:
    b = body_(phase_, ttlSecondsAfterFinished=ttl) if ttl is not None else body_(phase_)
    b["status"]["completionTime"] = rfc3339(T0)
    p, ended = run_to(reconcile.finished, b, pods_(b, state=state), t)
    assert (ended, names(p.plan.delete), p.plan.requeue_after, p.plan.delete_job) == want


# -- suspended: (case, suspend, conditions, pods) -> (ended, phase, deleted, Suspended, Running, events)

SUSPENDED = [
    ("not suspended", False, [], running, (NEXT, "Running", [], None, None, [])),
    (
        "suspend a running job",
        True,
        RUNNING_TRUE,
        running,
        (DONE, "Suspended", ALL, ("True", "Suspended"), ("False", "Suspended"), ["Suspended"]),
    ),
    (
        "pods already going",
        True,
        [],
        deleting,
        (DONE, "Suspended", [], ("True", "Suspended"), None, ["Suspended"]),
    ),
]


@pytest.mark.parametrize(
    "suspend,conds,state,want", [c[1:] for c in SUSPENDED], ids=[c[0] for c in SUSPENDED]
)
def test_suspended(suspend: bool, conds: list[dict[str, Any]], state: State, want: tuple[Any, ...]) -> None:
    b = body_("Running", conditions=conds, suspend=suspend)
    p, ended = run_to(reconcile.suspended, b, pods_(b, state=state))
    got = (
        ended,
        p.status["phase"],
        names(p.plan.delete),
        cond(p, "Suspended"),
        cond(p, "Running"),
        events(p),
    )
    assert got == want


# -- resumed: (case, phase) -> (phase of the pass, phase written, Suspended, events) ------------------

RESUMED = [
    ("resume", "Suspended", ("Pending", "Pending", ("False", "Resumed"), ["Resumed"])),
    ("running", "Running", ("Running", "Running", None, [])),
]


@pytest.mark.parametrize("phase_,want", [c[1:] for c in RESUMED], ids=[c[0] for c in RESUMED])
def test_resumed(phase_: str, want: tuple[Any, ...]) -> None:
    b = body_(phase_)
    p, ended = run_to(reconcile.resumed, b, [])
    assert ended is NEXT
    assert (p.phase, p.status["phase"], cond(p, "Suspended"), events(p)) == want


# -- kueue_stopped: (case, queue, conditions, pod state) -> (ended, phase, deleted, Suspended, events) --

KUEUE_EVICTED = {
    "type": "TerminationTarget",
    "status": "True",
    "reason": "WorkloadEvicted",
    "message": "Preempted to accommodate a higher priority Workload",
}


def stopped_by_kueue(p: Pod) -> Pod:
    """What Kueue does to each pod of a group it stops: the TerminationTarget condition, then a delete."""
    p = deleting(p)
    p["status"]["conditions"].append(dict(KUEUE_EVICTED))
    return p


def gang_stopped_by_kueue(p: Pod) -> Pod:
    """Kueue stops the gang's group; the rollout pods are single Workloads it did not stop."""
    return running(p) if p["metadata"]["labels"]["rlhf.dev/role"] == "rollout" else stopped_by_kueue(p)


RESUMED_AT = [
    {
        "type": "Suspended",
        "status": "False",
        "reason": "Resumed",
        "lastTransitionTime": "2025-01-01T11:00:00Z",
    }
]
KUEUE_STOPPED = [
    (
        "no queue: a TerminationTarget is not Kueue's",
        None,
        [],
        gang_stopped_by_kueue,
        (NEXT, "Running", [], None, []),
    ),
    ("admitted and running", "team-a", [], running, (NEXT, "Running", [], None, [])),
    (
        "Kueue stopped the group: a suspension",
        "team-a",
        [],
        gang_stopped_by_kueue,
        (DONE, "Suspended", ["j-rollout-0", "j-rollout-1"], ("True", "StoppedByKueue"), ["StoppedByKueue"]),
    ),
    # Resumed since: the stopped pods belong to the group before the resume (a new one now).
    (
        "an older group's stopped pods",
        "team-a",
        RESUMED_AT,
        gang_stopped_by_kueue,
        (NEXT, "Running", [], ("False", "Resumed"), []),
    ),
]


@pytest.mark.parametrize(
    "queue,conds,state,want", [c[1:] for c in KUEUE_STOPPED], ids=[c[0] for c in KUEUE_STOPPED]
)
def test_kueue_stopped(
    queue: str | None, conds: list[dict[str, Any]], state: State, want: tuple[Any, ...]
) -> None:
    spec = {"scheduling": {"timeoutSeconds": 60, **({"queueName": queue} if queue else {})}}
    b = body_("Running", conditions=conds, **spec)
    p, ended = run_to(reconcile.kueue_stopped, b, pods_(body_("Running", **spec), state=state))
    got = (ended, p.status["phase"], names(p.plan.delete), cond(p, "Suspended"), events(p))
    assert got == want


# -- controller_succeeded: (case, pods, ttl) -> (ended, phase, deleted, events, requeue) ---------------

B1_PODS_OLD_DONE = pods_(B1, 0, j_controller=succeeded) + pods_(B1, 1)
SUCCESS = [
    ("controller running", pods_(B), None, (NEXT, "Running", [], [], None)),
    (
        "controller succeeded",
        pods_(B, j_controller=succeeded),
        None,
        (DONE, "Succeeded", sorted(set(ALL) - {"j-controller"}), ["Succeeded"], None),
    ),
    (
        "with a TTL",
        pods_(B, j_controller=succeeded),
        60,
        (DONE, "Succeeded", sorted(set(ALL) - {"j-controller"}), ["Succeeded"], 60),
    ),
]


@pytest.mark.parametrize("pods,ttl,want", [c[1:] for c in SUCCESS], ids=[c[0] for c in SUCCESS])
def test_controller_succeeded(pods: list[Pod], ttl: int | None, want: tuple[Any, ...]) -> None:
    b = body_("Running", ttlSecondsAfterFinished=ttl) if ttl else body_("Running")
    p, ended = run_to(reconcile.controller_succeeded, b, pods)
    assert (ended, p.status["phase"], names(p.plan.delete), events(p), p.plan.requeue_after) == want
    if ended:
        assert cond(p, "Succeeded") == ("True", "ControllerSucceeded") and p.status["completionTime"]


def test_controller_succeeded_only_in_the_current_attempt() -> None:
    """A predecessor attempt's Succeeded controller decides nothing (it is deleted as stale)."""
    p, ended = run_to(reconcile.controller_succeeded, B1, B1_PODS_OLD_DONE)
    assert (ended, p.status["phase"]) == (NEXT, "Running")


# -- desired_pods: (case, spec updates) -> (gang, rollout replicas) -----------------------------------

DESIRED = [
    ("base", {}, (GANG, 2)),
    (
        "colocated: no fleet",
        {"roles": {**copy.deepcopy(B["spec"]["roles"]), "placement": "colocated"}},
        (GANG, 0),
    ),
    (
        "PPO: a critic",
        {
            "algorithm": {"name": "ppo"},
            "roles": {**copy.deepcopy(B["spec"]["roles"]), "critic": {"replicas": 1}},
        },
        (sorted(GANG + ["j-critic-0"]), 2),
    ),
    (
        "GRPO trains no critic, klCoef 0 reads no reference: neither gets a pod (spec.unused_roles)",
        {
            "algorithm": {"name": "grpo", "params": {"klCoef": 0}},
            "roles": {**copy.deepcopy(B["spec"]["roles"]), "critic": {"replicas": 1}},
        },
        (sorted(n for n in GANG if "-reference-" not in n), 2),
    ),
]


@pytest.mark.parametrize("spec,want", [c[1:] for c in DESIRED], ids=[c[0] for c in DESIRED])
def test_desired_pods(spec: dict[str, Any], want: tuple[list[str], int]) -> None:
    p, ended = run_to(reconcile.desired_pods, body_("Pending", **spec), [])
    assert (ended, sorted(p.desired_gang), p.rollout_desired) == (NEXT, *want)


# -- collect_failures: (case, phase, pods) -> [(pod, reason, acting)] ----------------------------------

COLLECT = [
    ("healthy", "Running", pods_(B), []),
    ("a gang pod lost once started", "Running", pods_(B, j_actor_1=gone), [("j-actor-1", "PodLost", True)]),
    ("not yet created while Pending", "Pending", pods_(B, j_actor_1=gone), []),
    ("failed", "Running", pods_(B, j_reference_0=failed), [("j-reference-0", "Error", True)]),
    (
        "a worker exited first",
        "Running",
        pods_(B, j_actor_0=succeeded),
        [("j-actor-0", "WorkerExited", True)],
    ),
    ("terminating while Pending: awaited", "Pending", pods_(B, j_actor_0=deleting), []),
    (
        "pull still retried",
        "Scheduling",
        pods_(B, j_actor_0=pulling),
        [("j-actor-0", "ImagePullFailed", False)],
    ),
    (
        "a rollout image never pulls",
        "Scheduling",
        pods_(B, j_rollout_0=bad_image),
        [("j-rollout-0", "ImagePullFailed", True)],
    ),
    ("a rollout pod is replaced alone", "Running", pods_(B, j_rollout_0=failed), []),
]


@pytest.mark.parametrize("phase_,pods,want", [c[1:] for c in COLLECT], ids=[c[0] for c in COLLECT])
def test_collect_failures(phase_: str, pods: list[Pod], want: list[tuple[str, str, bool]]) -> None:
    p, ended = run_to(reconcile.collect_failures, body_(phase_), pods, t=1)
    assert ended is NEXT
    assert [(f.pod, f.reason, f.acting) for f in p.failures] == want


# -- act_on_failures: (case, phase, restarts, pods) -> (ended, phase, restarts, deleted, events) --------

ACT = [
    ("nothing acts", "Running", 0, pods_(B, j_actor_0=pulling), (NEXT, "Running", 0, [], [])),
    ("restart", "Running", 0, pods_(B, j_actor_0=failed), (DONE, "Restarting", 1, ALL, ["GangRestart"])),
    ("already restarting", "Restarting", 1, pods_(B1, 1, j_actor_0=failed), (NEXT, "Restarting", 1, [], [])),
    (
        "maxRestarts spent",
        "Running",
        2,
        pods_(body_("Running", 2), 2, j_actor_0=failed),
        (DONE, "Failed", 2, sorted(set(ALL) - {"j-actor-0"}), ["MaxRestartsExceeded"]),
    ),
    (
        "image never pulls",
        "Scheduling",
        0,
        pods_(B, j_actor_0=bad_image),
        (DONE, "Failed", 0, ALL, ["ImagePullFailed"]),
    ),
]


@pytest.mark.parametrize("phase_,restarts,pods,want", [c[1:] for c in ACT], ids=[c[0] for c in ACT])
def test_act_on_failures(phase_: str, restarts: int, pods: list[Pod], want: tuple[Any, ...]) -> None:
    p, ended = run_to(reconcile.act_on_failures, body_(phase_, restarts), pods, t=1)
    assert (ended, p.status["phase"], p.status["restarts"], names(p.plan.delete), events(p)) == want


def creating(p: Pod) -> Pod:
    """Bound at T0, its sandbox ready, its containers still being created: a multi-GB image pull."""
    p = scheduled(p)
    p["status"]["conditions"][0]["lastTransitionTime"] = rfc3339(T0)
    p["status"]["conditions"].append({"type": "PodReadyToStartContainers", "status": "True"})
    p["status"]["containerStatuses"] = [
        {"name": "trainer", "state": {"waiting": {"reason": "ContainerCreating"}}}
    ]
    return p


# A slow pull against the start timeout: BASE_SPEC's scheduling.timeoutSeconds is 60, its
# imagePullTimeoutSeconds the default 1800. (case, actor-0's state, t) -> (ended, phase, restarts,
# events, requeue after report_problems)
SLOW_PULL = [
    (
        "pulling 10 min, past the start timeout: no failure",
        creating,
        600,
        (NEXT, "Scheduling", 0, [], 1200.0),
    ),
    (
        "pulling past imagePullTimeoutSeconds: a start failure, the gang restarts",
        creating,
        1800,
        (DONE, "Restarting", 1, ["GangRestart"], 10.0),
    ),
    (
        "a pull error stays a failure (no gang restart: the job fails)",
        pulling,
        61,
        (DONE, "Failed", 0, ["ImagePullFailed"], None),
    ),
]


@pytest.mark.parametrize("state,t,want", [c[1:] for c in SLOW_PULL], ids=[c[0] for c in SLOW_PULL])
def test_a_slow_image_pull_is_not_a_start_timeout(state: State, t: float, want: tuple[Any, ...]) -> None:
    b = body_("Scheduling", conditions=scheduled_clock(0))
    pods = pods_(B, j_actor_0=state)
    p, ended = run_to(reconcile.act_on_failures, b, pods, t=t)
    if ended is NEXT:
        assert reconcile.report_problems(p) is NEXT
    got = (ended, p.status["phase"], p.status["restarts"], events(p), p.plan.requeue_after)
    assert got == want
    if want[1] == "Restarting":
        message = p.condition("Restarting")["message"]
        assert "spec.scheduling.imagePullTimeoutSeconds" in message and "(image 'trainer:test')" in message


# -- report_problems: (case, conditions, pods, t) -> (PodFailure, events, requeue) ---------------------

REPORTED = [
    {
        "type": "PodFailure",
        "status": "True",
        "reason": "ImagePullFailed",
        "message": "pod j-actor-0 container trainer: x",
    }
]
REPORT = [
    ("nothing to report", [], pods_(B), 1, (None, [], None)),
    (
        "a pull error, acting in 59 s",
        [],
        pods_(B, j_actor_0=pulling),
        1,
        (("True", "ImagePullFailed"), ["ImagePullFailed"], 59.0),
    ),
    (
        "the same occurrence: no second Event",
        REPORTED,
        pods_(B, j_actor_0=pulling),
        30,
        (("True", "ImagePullFailed"), [], 30.0),
    ),
    ("it cleared", REPORTED, pods_(B), 30, (("False", "PodsHealthy"), [], None)),
    ("a bound pod's start timeout", [], pods_(B, j_actor_0=scheduled), 20, (None, [], 40.0)),
]


@pytest.mark.parametrize("conds,pods,t,want", [c[1:] for c in REPORT], ids=[c[0] for c in REPORT])
def test_report_problems(
    conds: list[dict[str, Any]], pods: list[Pod], t: float, want: tuple[Any, ...]
) -> None:
    for x in pods:  # bound at T0: the start timeout (60 s) counts from there
        for c in x["status"].get("conditions", []):
            c.setdefault("lastTransitionTime", rfc3339(T0))
    p, ended = run_to(reconcile.report_problems, body_("Scheduling", conditions=conds), pods, t)
    assert ended is NEXT
    assert (cond(p, "PodFailure"), events(p), p.plan.requeue_after) == want


# -- restart_backoff: (case, phase, t) -> (ended, requeue); restarts 1: backoff 10 s --------------------

BACKOFF = [
    ("not restarting", "Running", 0, (NEXT, None)),
    ("backoff running", "Restarting", 4, (DONE, 6.0)),
    ("backoff over", "Restarting", 10, (NEXT, None)),
]


@pytest.mark.parametrize("phase_,t,want", [c[1:] for c in BACKOFF], ids=[c[0] for c in BACKOFF])
def test_restart_backoff(phase_: str, t: float, want: tuple[bool, float | None]) -> None:
    b = body_(phase_, restarts=1, conditions=restarting_since(0))
    pods = pods_(b, 1) if phase_ == "Running" else []
    p, ended = run_to(reconcile.restart_backoff, b, pods, t)
    assert (ended, p.plan.requeue_after) == want


# -- shared_storage: (case, phase, claims read, spec) -> (ended, StorageNotShared, message mentions,
#    events, requeue); BASE_SPEC's checkpoints are on claim "work", written by the controller and 2 actor pods

RWX, RWO = ["ReadWriteMany"], ["ReadWriteOnce"]
NOT_SHARED_TRUE = [
    {
        "type": "StorageNotShared",
        "status": "True",
        "reason": "ClaimNotShared",
        "lastTransitionTime": "x",
        "message": "old",
    }
]
SHARED = [
    ("ReadWriteMany: the pods are created", "Pending", {"work": RWX}, {}, (NEXT, None, None, [], None)),
    (
        "ReadWriteOnce for three pods: no pod, the claim and its mode named",
        "Pending",
        {"work": RWO},
        {},
        (
            DONE,
            ("True", "ClaimNotShared"),
            "spec.checkpoint.dir: '<output.dir>/checkpoints' (/workspace/runs/j/checkpoints in the pods) is on the "
            "persistentVolumeClaim 'work' with access mode ReadWriteOnce, which the controller pod and actor pods "
            "cannot all write: every restart would fail at its first checkpoint; valid: a claim with access mode "
            "ReadWriteMany (so that pods on different nodes all mount it), or all trained roles and the controller "
            "in one pod; no pod is created until then",
            ["ClaimNotShared"],
            reconcile.CLAIM_RECHECK_SECONDS,
        ),
    ),
    (
        "ReadWriteOncePod is not shared either",
        "Restarting",
        {"work": ["ReadWriteOncePod"]},
        {},
        (DONE, ("True", "ClaimNotShared"), "with access mode ReadWriteOncePod", ["ClaimNotShared"], 15.0),
    ),
    (
        "the claim does not exist",
        "Pending",
        {"work": None},
        {},
        (
            DONE,
            ("True", "ClaimNotShared"),
            "persistentVolumeClaim 'work', which does not exist; create it",
            ["ClaimNotShared"],
            15.0,
        ),
    ),
    (
        "fixed: the condition turns False and the pods are created",
        "Pending",
        {"work": ["ReadWriteOnce", "ReadWriteMany"]},
        {"conditions": NOT_SHARED_TRUE},
        (NEXT, ("False", "ClaimsShared"), None, [], None),
    ),
    (
        "still not shared: no second Event for the same message",
        "Pending",
        {"work": RWO},
        {"conditions": [{**NOT_SHARED_TRUE[0], "message": None}]},
        (DONE, ("True", "ClaimNotShared"), "access mode ReadWriteOnce", [], 15.0),
    ),
    ("claims not read: nothing checked", "Pending", None, {}, (NEXT, None, None, [], None)),
    ("Running: the gang exists, nothing to gate", "Running", {"work": RWO}, {}, (NEXT, None, None, [], None)),
]


@pytest.mark.parametrize("phase_,claims,extra,want", [c[1:] for c in SHARED], ids=[c[0] for c in SHARED])
def test_shared_storage(
    phase_: str, claims: dict[str, Any] | None, extra: dict[str, Any], want: tuple[Any, ...]
) -> None:
    b = body_(phase_, restarts=1 if phase_ == "Restarting" else 0, conditions=restarting_since(-100))
    if extra.get("conditions"):
        b["status"]["conditions"] += copy.deepcopy(extra["conditions"])
    if extra.get("conditions") and extra["conditions"][0]["message"] is None:  # the message it will write
        p0, _ = run_to(reconcile.shared_storage, body_(phase_), [], claims=claims)
        b["status"]["conditions"][-1]["message"] = p0.condition("StorageNotShared")["message"]
    pods = pods_(b) if phase_ == "Running" else []
    p, ended = run_to(reconcile.shared_storage, b, pods, claims=claims)
    got = p.condition("StorageNotShared")
    mentions = want[2]
    assert (ended, cond(p, "StorageNotShared"), events(p), p.plan.requeue_after) == (
        want[0],
        want[1],
        want[3],
        want[4],
    )
    assert mentions is None or mentions in got["message"], got


# -- rollout_fleet: (case, rollout status, pods) -> (generation, ready, to create, leaving, events) ----

FLEET = [
    ("first pass", None, [], (1, 0, ["j-rollout-0", "j-rollout-1"], set(), [])),
    (
        "steady",
        {"desired": 2, "generation": 3, "syncedGeneration": 3},
        pods_(B),
        (3, 2, [], set(), []),
    ),
    (
        "a failed replica replaced alone",
        {"desired": 2, "generation": 3, "syncedGeneration": 3},
        pods_(B, j_rollout_1=failed),
        (3, 1, [], {"j-rollout-1"}, ["RolloutReplicaFailed"]),
    ),
]


@pytest.mark.parametrize("rollout,pods,want", [c[1:] for c in FLEET], ids=[c[0] for c in FLEET])
def test_rollout_fleet(rollout: dict[str, Any] | None, pods: list[Pod], want: tuple[Any, ...]) -> None:
    b = body_("Running" if pods else "Pending")
    if rollout:
        b["status"]["rollout"] = rollout
    p, ended = run_to(reconcile.rollout_fleet, b, pods)
    got = (
        p.status["rollout"]["generation"],
        p.status["rollout"]["ready"],
        sorted(p.desired_rollout),
        p.leaving,
        events(p),
    )
    assert (ended, *got) == (NEXT, *want)


# -- create_missing: (case, pods) -> (created, blocked) ----------------------------------------------

CREATE = [
    ("nothing yet", [], (ALL, [])),
    ("half there", pods_(B)[:3], (sorted(set(ALL) - set(names(pods_(B)[:3]))), [])),
    ("a terminating pod holds its name", pods_(B, j_actor_0=deleting), ([], [])),
    ("a pod the job does not own", pods_(B, j_actor_0=foreign), ([], ["j-actor-0"])),
]


@pytest.mark.parametrize("pods,want", [c[1:] for c in CREATE], ids=[c[0] for c in CREATE])
def test_create_missing(pods: list[Pod], want: tuple[list[str], list[str]]) -> None:
    b = body_("Pending")
    p, ended = run_to(reconcile.create_missing, b, pods)
    assert (ended, names(p.plan.create), sorted(r.name for r in p.plan.blocked)) == (NEXT, *want)
    assert all(r.reason == "NotOwned" for r in p.plan.blocked)


# -- count_members: (case, phase, pods) -> (members, expected) ----------------------------------------

COUNT = [
    ("all", "Running", pods_(B), (ALL, 6)),
    (
        "terminating while Pending: not yet a member",
        "Pending",
        pods_(B, j_actor_0=deleting),
        (sorted(set(ALL) - {"j-actor-0"}), 6),
    ),
]


@pytest.mark.parametrize("phase_,pods,want", [c[1:] for c in COUNT], ids=[c[0] for c in COUNT])
def test_count_members(phase_: str, pods: list[Pod], want: tuple[list[str], int]) -> None:
    p, ended = run_to(reconcile.count_members, body_(phase_), pods)
    assert (ended, names(p.members), p.expected) == (NEXT, *want)


def test_count_members_leaves_out_a_leaving_replica() -> None:
    b = body_(
        "Running",
        roles={
            **copy.deepcopy(B["spec"]["roles"]),
            "rollout": {**B["spec"]["roles"]["rollout"], "replicas": 1},
        },
    )
    b["status"]["rollout"] = {"desired": 2, "generation": 3, "syncedGeneration": 3}
    p, _ = run_to(reconcile.count_members, b, pods_(B))  # two rollout pods, one wanted
    assert (names(p.members), p.expected, p.leaving) == (
        sorted(set(ALL) - {"j-rollout-1"}),
        5,
        {"j-rollout-1"},
    )


# -- all_created: (case, phase, pods) -> (ended, phase, Restarting, events) ----------------------------

CREATED = [
    ("some missing", "Pending", pods_(B)[:3], (DONE, "Pending", None, [])),
    ("all there", "Pending", pods_(B, state=lambda x: x), (NEXT, "Scheduling", None, ["PodsCreated"])),
    (
        "all recreated",
        "Restarting",
        pods_(B1, 1, state=lambda x: x),
        (NEXT, "Scheduling", ("False", "PodsRecreated"), ["PodsCreated"]),
    ),
    ("running", "Running", pods_(B), (NEXT, "Running", None, [])),
]


@pytest.mark.parametrize("phase_,pods,want", [c[1:] for c in CREATED], ids=[c[0] for c in CREATED])
def test_all_created(phase_: str, pods: list[Pod], want: tuple[Any, ...]) -> None:
    b = body_(
        phase_,
        restarts=1 if phase_ == "Restarting" else 0,
        conditions=restarting_since(-100) if phase_ == "Restarting" else [],
    )
    p, ended = run_to(reconcile.all_created, b, pods)
    assert (ended, p.status["phase"], cond(p, "Restarting"), events(p)) == want
    if p.phase == "Scheduling" and phase_ != "Scheduling":
        assert cond(p, "Scheduled") == ("False", "WaitingForScheduler")
        assert p.condition("Scheduled")["lastTransitionTime"] == rfc3339(T0)  # the scheduling clock starts


# -- all_scheduled: (case, onTimeout, pods, t) -> (ended, phase, Scheduled, Unschedulable, events, requeue)

SCHEDULE = [
    (
        "all bound",
        "wait",
        pods_(B, state=scheduled),
        5,
        (NEXT, "Scheduling", ("True", "AllScheduled"), None, [], None),
    ),
    (
        "waiting",
        "wait",
        pods_(B, j_actor_1=waiting),
        20,
        (NEXT, "Scheduling", ("False", "WaitingForScheduler"), None, [], 40.0),
    ),
    (
        "timed out, waits",
        "wait",
        pods_(B, j_actor_1=waiting),
        60,
        (
            NEXT,
            "Scheduling",
            ("False", "WaitingForScheduler"),
            ("True", "Unschedulable"),
            ["Unschedulable"],
            None,
        ),
    ),
    (
        "timed out, fails",
        "fail",
        pods_(B, j_actor_1=waiting),
        61,
        (
            DONE,
            "Failed",
            ("False", "WaitingForScheduler"),
            ("True", "Unschedulable"),
            ["Unschedulable", "Unschedulable"],
            None,
        ),
    ),
]


@pytest.mark.parametrize("on_timeout,pods,t,want", [c[1:] for c in SCHEDULE], ids=[c[0] for c in SCHEDULE])
def test_all_scheduled(on_timeout: str, pods: list[Pod], t: float, want: tuple[Any, ...]) -> None:
    b = body_(
        "Scheduling",
        conditions=scheduled_clock(0),
        scheduling={"timeoutSeconds": 60, "onTimeout": on_timeout},
    )
    p, ended = run_to(reconcile.all_scheduled, b, pods, t)
    got = (
        ended,
        p.status["phase"],
        cond(p, "Scheduled"),
        cond(p, "Unschedulable"),
        events(p),
        p.plan.requeue_after,
    )
    assert got == want
    if ended:
        assert p.plan.create == [] and names(p.plan.delete) == ALL


# -- all_running: (case, phase, pods) -> (phase, Running, startTime, events) ---------------------------

RUN = [
    ("all running", "Scheduling", pods_(B), ("Running", ("True", "AllRunning"), rfc3339(T0), ["Running"])),
    ("one still pending", "Scheduling", pods_(B, j_actor_0=scheduled), ("Scheduling", None, None, [])),
    ("already running", "Running", pods_(B), ("Running", None, None, [])),
]


@pytest.mark.parametrize("phase_,pods,want", [c[1:] for c in RUN], ids=[c[0] for c in RUN])
def test_all_running(phase_: str, pods: list[Pod], want: tuple[Any, ...]) -> None:
    b = body_(phase_, conditions=scheduled_clock(0) if phase_ == "Scheduling" else [])
    p, ended = run_to(reconcile.all_running, b, pods)
    assert ended is DONE  # the last step
    assert (p.status["phase"], cond(p, "Running"), p.status.get("startTime"), events(p)) == want
