"""`spec.failurePolicy.rules` through the pure `reconcile.plan`: a running job meets one failure
(written the way the control plane writes it) and the rules decide whether the gang restarts
counted, restarts uncounted, or the job fails."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
from operator_helpers import at, job, names, phase, running, with_status

from rlhf_api.loader import parse_job
from rlhf_operator import children, pass_state, reconcile
from rlhf_operator.status import get_condition

ALL = ["j-actor-0", "j-actor-1", "j-controller", "j-reference-0", "j-rollout-0", "j-rollout-1"]

NO_COUNT_DISRUPTIONS = {"action": "RestartGangNoCount", "onReasons": ["Preempted", "NodeLost", "Evicted"]}
NO_COUNT_USER_DELETES = {"action": "RestartGangNoCount", "onReasons": ["PodDeletedByUser"]}
FATAL_EXIT = {"action": "FailJob", "onReasons": ["ContainerExitCode"], "exitCodes": [42]}
RETRY_PULLS = {"action": "RestartGang", "onReasons": ["ImagePullFailed"]}


def step(
    body: dict[str, Any], pods: list[dict[str, Any]], t: float
) -> tuple[pass_state.Plan, dict[str, Any]]:
    plan = reconcile.plan(body, pods, at(t))
    return plan, with_status(body, plan.status)


def running_job(
    rules: list[dict[str, Any]], restarts: int = 0
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """A job with these rules, Running at attempt `restarts` (all of them counted)."""
    body = job()
    body["spec"]["failurePolicy"]["rules"] = rules
    body["status"] = {"phase": "Running", "restarts": restarts}
    pods = [running(p) for p in children.build_pods(parse_job(body), restarts).values()]
    return body, pods


# -- how each failure looks on the pod -------------------------------------------------------------


def disrupted(reason: str) -> Callable[[dict[str, Any]], dict[str, Any]]:
    def f(p: dict[str, Any]) -> dict[str, Any]:
        p = copy.deepcopy(p)
        p["metadata"]["deletionTimestamp"] = "2025-01-01T12:00:00Z"
        p["status"]["conditions"].append({"type": "DisruptionTarget", "status": "True", "reason": reason})
        return p

    return f


def deleted_by_user(p: dict[str, Any]) -> dict[str, Any]:
    p = copy.deepcopy(p)
    p["metadata"]["deletionTimestamp"] = "2025-01-01T12:00:00Z"
    return p


def exit_code(code: int) -> Callable[[dict[str, Any]], dict[str, Any]]:
    def f(p: dict[str, Any]) -> dict[str, Any]:
        p = phase(p, "Failed")
        p["status"]["containerStatuses"] = [
            {"name": "trainer", "state": {"terminated": {"reason": "Error", "exitCode": code}}}
        ]
        return p

    return f


def evicted(p: dict[str, Any]) -> dict[str, Any]:
    return phase(p, "Failed", "Evicted")


def image_pull(p: dict[str, Any]) -> dict[str, Any]:
    p = copy.deepcopy(p)
    p["status"] = {
        "phase": "Pending",
        "conditions": [
            {"type": "PodScheduled", "status": "True", "lastTransitionTime": "2025-01-01T12:00:00Z"}
        ],
        "containerStatuses": [
            {"name": "trainer", "state": {"waiting": {"reason": "InvalidImageName", "message": "bad"}}}
        ],
    }
    return p


GONE = None  # the pod vanished (its node was deleted before the operator saw it terminate)

# (case, rules, restarts so far, how j-actor-1 fails) ->
#   (phase, restarts, countedRestarts (None: absent, = restarts), condition reason, words of its message)
CASES = [
    (
        "no rules: preemption counts",
        [],
        0,
        disrupted("PreemptionByScheduler"),
        ("Restarting", 1, None, "PreemptionByScheduler", "gang restart 1/2"),
    ),
    (
        "preemption not counted",
        [NO_COUNT_DISRUPTIONS],
        0,
        disrupted("PreemptionByScheduler"),
        ("Restarting", 1, 0, "PreemptionByScheduler", "not counted against maxRestarts"),
    ),
    (
        "preemption restarts even with maxRestarts spent",
        [NO_COUNT_DISRUPTIONS],
        2,
        disrupted("PreemptionByScheduler"),
        (
            "Restarting",
            3,
            2,
            "PreemptionByScheduler",
            "spec.failurePolicy.rules[0] (RestartGangNoCount on Preempted)",
        ),
    ),
    (
        "no rules: spent maxRestarts fail",
        [],
        2,
        disrupted("PreemptionByScheduler"),
        ("Failed", 2, None, "MaxRestartsExceeded", "maxRestarts (2) exhausted after 2 restarts"),
    ),
    (
        "drain eviction not counted",
        [NO_COUNT_DISRUPTIONS],
        0,
        disrupted("EvictionByEvictionAPI"),
        ("Restarting", 1, 0, "EvictionByEvictionAPI", "RestartGangNoCount on Evicted"),
    ),
    (
        "kubelet eviction not counted",
        [NO_COUNT_DISRUPTIONS],
        1,
        evicted,
        ("Restarting", 2, 1, "Evicted", "RestartGangNoCount on Evicted"),
    ),
    (
        "lost pod not counted",
        [NO_COUNT_DISRUPTIONS],
        0,
        GONE,
        ("Restarting", 1, 0, "PodLost", "RestartGangNoCount on NodeLost"),
    ),
    (
        "user deletion not counted",
        [NO_COUNT_USER_DELETES],
        0,
        deleted_by_user,
        ("Restarting", 1, 0, "PodDeleted", "RestartGangNoCount on PodDeletedByUser"),
    ),
    (
        "user deletion counted without the rule",
        [NO_COUNT_DISRUPTIONS],
        0,
        deleted_by_user,
        ("Restarting", 1, None, "PodDeleted", "gang restart 1/2"),
    ),
    (
        "fatal exit code fails at once",
        [NO_COUNT_DISRUPTIONS, FATAL_EXIT],
        0,
        exit_code(42),
        (
            "Failed",
            0,
            None,
            "FailedByRule",
            "spec.failurePolicy.rules[1] (FailJob on ContainerExitCode, exit code 42)",
        ),
    ),
    (
        "another exit code restarts",
        [FATAL_EXIT],
        0,
        exit_code(1),
        ("Restarting", 1, None, "ContainerFailed", "gang restart 1/2"),
    ),
    (
        "a rule retries an image that cannot be pulled",
        [RETRY_PULLS],
        0,
        image_pull,
        ("Restarting", 1, None, "ImagePullFailed", "gang restart 1/2"),
    ),
    (
        "no rules: an image that cannot be pulled fails",
        [],
        0,
        image_pull,
        ("Failed", 0, None, "ImagePullFailed", "without a gang restart"),
    ),
]


@pytest.mark.parametrize("rules,restarts,sick,expected", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_rules_decide_what_a_failure_does(
    rules: list[dict[str, Any]],
    restarts: int,
    sick: Callable[[dict[str, Any]], dict[str, Any]] | None,
    expected: tuple[str, int, int | None, str, str],
) -> None:
    body, pods = running_job(rules, restarts)
    observed = [(sick(p) if sick else None) if p["metadata"]["name"] == "j-actor-1" else p for p in pods]
    plan, body = step(body, [p for p in observed if p is not None], 100)
    st = body["status"]
    want_phase, want_restarts, want_counted, want_reason, words = expected
    decided = get_condition(st, "Failed" if want_phase == "Failed" else "Restarting")
    assert decided is not None
    assert (st["phase"], st["restarts"], st.get("countedRestarts"), decided["reason"]) == (
        want_phase,
        want_restarts,
        want_counted,
        want_reason,
    )
    assert words in decided["message"], decided["message"]
    assert "j-actor-1" in decided["message"]
    event = "GangRestart" if want_phase == "Restarting" else want_reason
    assert [(e.type, e.reason) for e in plan.events] == [("Warning", event)]
    if want_phase == "Failed":
        assert st["completionTime"] == "2025-01-01T12:01:40Z"


def test_uncounted_restarts_leave_the_count_to_counted_ones() -> None:
    """maxRestarts 2: three preemptions (not counted), then two crashes (counted), then a third
    crash fails the job; the attempt number and the backoff follow every restart."""
    body, pods = running_job([NO_COUNT_DISRUPTIONS])
    t = 0.0
    history = []
    for sick in [disrupted("PreemptionByScheduler")] * 3 + [exit_code(1)] * 3:
        attempt = body["status"]["restarts"]
        pods = [running(p) for p in children.build_pods(parse_job(body), attempt).values()]
        pods = [sick(p) if p["metadata"]["name"] == "j-actor-1" else p for p in pods]
        t += 1000  # well past any backoff
        plan, body = step(body, pods, t)
        st = body["status"]
        history.append(
            (st["phase"], st["restarts"], st.get("countedRestarts", st["restarts"]), plan.requeue_after)
        )
        if st["phase"] == "Failed":
            break
        # the new attempt's pods run again
        plan, body = step(body, [], t + 500)
        assert names(plan.create) == ALL
        new = [running(p) for p in plan.create]
        _, body = step(body, new, t + 501)
        _, body = step(body, new, t + 502)
        assert body["status"]["phase"] == "Running"
    assert history == [
        ("Restarting", 1, 0, 10),
        ("Restarting", 2, 0, 20),
        ("Restarting", 3, 0, 40),
        ("Restarting", 4, 1, 60),
        ("Restarting", 5, 2, 60),
        ("Failed", 5, 2, None),
    ]
    failed = get_condition(body["status"], "Failed")
    assert failed is not None and failed["reason"] == "MaxRestartsExceeded"
    assert "exhausted after 2 restarts" in failed["message"]


def test_counted_restarts_absent_while_every_restart_counted() -> None:
    """Jobs without uncounted restarts keep the status they had before rules existed."""
    body, pods = running_job([])
    pods = [exit_code(1)(p) if p["metadata"]["name"] == "j-actor-1" else p for p in pods]
    plan, body = step(body, pods, 100)
    assert body["status"]["restarts"] == 1
    assert "countedRestarts" not in plan.status and "countedRestarts" not in body["status"]
