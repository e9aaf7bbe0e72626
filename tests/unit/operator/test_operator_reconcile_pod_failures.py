"""The reconcile of pods that are bound but never start, and of children the API server refuses:
each problem becomes a condition and one Warning Event naming the pod, then the failure policy.
Pod statuses are written the way the kubelet writes them."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
from operator_helpers import at, job, names, running, with_status

from rlhf_api.loader import parse_job
from rlhf_api.status import rfc3339
from rlhf_operator import child_failures, children, failure_policy, pass_state, reconcile
from rlhf_operator.status import get_condition

ALL = ["j-actor-0", "j-actor-1", "j-controller", "j-reference-0", "j-rollout-0", "j-rollout-1"]
IMAGE = "trainer:test"
PULL_ERROR = (
    f'failed to pull and unpack image "docker.io/library/{IMAGE}": failed to resolve reference '
    f'"docker.io/library/{IMAGE}": docker.io/library/{IMAGE}: not found'
)


def step(
    body: dict[str, Any], pods: list[dict[str, Any]], t: float
) -> tuple[pass_state.Plan, dict[str, Any]]:
    plan = reconcile.plan(body, pods, at(t))
    return plan, with_status(body, plan.status)


def bound(pod: dict[str, Any], t: float, *states: dict[str, Any]) -> dict[str, Any]:
    """`pod` bound to a node at T0 + t, phase Pending, its container in `states[0]` (ContainerCreating
    when none given)."""
    p = copy.deepcopy(pod)
    p["metadata"]["uid"] = "uid-" + p["metadata"]["name"]
    p["spec"]["nodeName"] = "gpu-0"
    state = states[0] if states else {"waiting": {"reason": "ContainerCreating"}}
    p["status"] = {
        "phase": "Pending",
        "conditions": [
            {"type": "Initialized", "status": "True", "lastTransitionTime": rfc3339(at(t))},
            {"type": "PodScheduled", "status": "True", "lastTransitionTime": rfc3339(at(t))},
        ],
        "startTime": rfc3339(at(t)),
        "containerStatuses": [
            {
                "name": "trainer",
                "image": IMAGE,
                "ready": False,
                "restartCount": 0,
                "started": False,
                "state": state,
            }
        ],
    }
    return p


def pull_error(reason: str = "ErrImagePull") -> dict[str, Any]:
    message = PULL_ERROR if reason == "ErrImagePull" else f'Back-off pulling image "{IMAGE}"'
    return {"waiting": {"reason": reason, "message": message}}


def pods_at(
    body: dict[str, Any], state: Callable[[dict[str, Any]], dict[str, Any]], attempt: int = 0
) -> list[dict[str, Any]]:
    return [state(p) for p in children.build_pods(parse_job(body), attempt).values()]


def created_job() -> dict[str, Any]:
    """A job whose pods were all created at T0 (phase Scheduling)."""
    body = job()
    _, body = step(body, [], 0)
    _, body = step(body, pods_at(body, lambda p: p), 0)
    assert body["status"]["phase"] == "Scheduling"
    return body


def only(
    name: str, sick: Callable[[dict[str, Any]], dict[str, Any]]
) -> Callable[[dict[str, Any]], dict[str, Any]]:
    """Pod `name` in state `sick`, every other pod Running."""
    return lambda p: sick(p) if p["metadata"]["name"] == name else running(p)


def cond(body: dict[str, Any], type_: str) -> dict[str, Any]:
    c = get_condition(body["status"], type_)
    assert c is not None, f"no {type_} condition in {body['status'].get('conditions')}"
    return c


def test_image_pull_error_is_reported_at_once_then_fails_the_job_without_a_restart() -> None:
    body = created_job()
    sick = only("j-actor-1", lambda p: bound(p, 1, pull_error()))
    plan, body = step(body, pods_at(body, sick), 5)
    assert body["status"]["phase"] == "Scheduling"
    c = cond(body, "PodFailure")
    assert (c["status"], c["reason"]) == ("True", "ImagePullFailed")
    assert c["message"].startswith(
        "pod j-actor-1 container trainer: image 'trainer:test' cannot be pulled (ErrImagePull:"
    )
    assert "not found" in c["message"]
    assert [(e.type, e.reason) for e in plan.events] == [("Warning", "ImagePullFailed")]
    assert "j-actor-1" in plan.events[0].message and IMAGE in plan.events[0].message
    assert plan.requeue_after == 56  # the grace: 60 s after the pod was bound
    assert plan.delete == [] and plan.create == []

    # The kubelet backs off between pulls: the same occurrence, no second Event, and the
    # condition keeps the pull error rather than the back-off line.
    backoff = only("j-actor-1", lambda p: bound(p, 1, pull_error("ImagePullBackOff")))
    plan, body = step(body, pods_at(body, backoff), 30)
    assert plan.events == []
    assert "not found" in cond(body, "PodFailure")["message"]

    plan, body = step(body, pods_at(body, backoff), 61)
    st = body["status"]
    assert st["phase"] == "Failed" and st["restarts"] == 0
    failed = cond(body, "Failed")
    assert failed["reason"] == "ImagePullFailed"
    assert "j-actor-1" in failed["message"] and "without a gang restart" in failed["message"]
    assert [(e.type, e.reason) for e in plan.events] == [("Warning", "ImagePullFailed")]
    assert names(plan.delete) == ALL  # none terminated: every pod freed
    assert st["completionTime"] == "2025-01-01T12:01:01Z"


def test_invalid_image_name_fails_at_once_with_one_event() -> None:
    body = created_job()
    bad = {"waiting": {"reason": "InvalidImageName", "message": 'couldn\'t parse image name "Trainer:x"'}}
    plan, body = step(body, pods_at(body, only("j-controller", lambda p: bound(p, 1, bad))), 2)
    assert body["status"]["phase"] == "Failed"
    assert cond(body, "Failed")["reason"] == "ImagePullFailed"
    assert cond(body, "PodFailure")["reason"] == "ImagePullFailed"
    assert [e.reason for e in plan.events] == ["ImagePullFailed"]


def test_container_config_error_is_reported_then_restarts_the_gang() -> None:
    body = created_job()
    config = {"waiting": {"reason": "CreateContainerConfigError", "message": 'secret "hf-token" not found'}}
    sick = only("j-reference-0", lambda p: bound(p, 0, config))
    plan, body = step(body, pods_at(body, sick), 10)
    assert [e.reason for e in plan.events] == ["PodStartFailed"]
    c = cond(body, "PodFailure")
    assert c["reason"] == "PodStartFailed"
    assert c["message"] == (
        'pod j-reference-0 container trainer: cannot start (CreateContainerConfigError: secret "hf-token" not found)'
    )
    plan, body = step(body, pods_at(body, sick), 20)
    assert plan.events == [] and body["status"]["phase"] == "Scheduling"

    plan, body = step(body, pods_at(body, sick), 60)
    st = body["status"]
    assert st["phase"] == "Restarting" and st["restarts"] == 1
    assert [e.reason for e in plan.events] == ["GangRestart"]
    assert cond(body, "Restarting")["reason"] == "PodStartFailed"
    assert 'secret "hf-token" not found' in cond(body, "Restarting")["message"]
    assert cond(body, "PodFailure")["status"] == "False"  # the next attempt's problems are new
    assert names(plan.delete) == ALL

    # The new attempt hits the same problem: reported again (a new occurrence), once.
    _, body = step(body, [], 71)
    plan, body = step(
        body, pods_at(body, only("j-reference-0", lambda p: bound(p, 71, config)), attempt=1), 72
    )
    assert body["status"]["phase"] == "Scheduling"
    assert sorted(e.reason for e in plan.events) == ["PodStartFailed", "PodsCreated"]


def test_pod_bound_but_not_running_within_the_timeout_restarts_the_gang() -> None:
    body = created_job()
    stuck = only("j-actor-0", lambda p: bound(p, 2))  # ContainerCreating: e.g. a volume never mounts
    plan, body = step(body, pods_at(body, stuck), 30)
    assert plan.events == [] and get_condition(body["status"], "PodFailure") is None
    assert plan.requeue_after == 32  # wakes up at the pod's start timeout (bound at 2, timeout 60)
    plan, body = step(body, pods_at(body, stuck), 62)
    assert body["status"]["restarts"] == 1
    restarting = cond(body, "Restarting")
    assert restarting["reason"] == "PodStartTimeout"
    assert "pod j-actor-0: bound to node gpu-0 but not Running after 60s" in restarting["message"]
    assert "waiting: trainer ContainerCreating" in restarting["message"]


@pytest.mark.parametrize(
    "state,reason",
    [
        (
            {"terminated": {"exitCode": 137, "reason": "OOMKilled", "startedAt": "x", "finishedAt": "y"}},
            "OOMKilled",
        ),
        ({"terminated": {"exitCode": 1, "reason": "Error"}}, "ContainerFailed"),
    ],
)
def test_container_exit_fails_the_pod_and_restarts_the_gang_at_once(
    state: dict[str, Any], reason: str
) -> None:
    """restartPolicy Never: the kubelet makes the pod Failed; its container names the cause."""

    def failed(p: dict[str, Any]) -> dict[str, Any]:
        out = bound(p, 1, state)
        out["status"]["phase"] = "Failed"
        return out

    body = created_job()
    plan, body = step(body, pods_at(body, only("j-actor-0", failed)), 5)
    assert body["status"]["restarts"] == 1
    assert cond(body, "Restarting")["reason"] == reason
    assert (
        f"pod j-actor-0 failed: container trainer exited with code {state['terminated']['exitCode']}"
        in (cond(body, "Restarting")["message"])
    )
    assert [e.reason for e in plan.events] == ["GangRestart"]


def test_crash_looping_sidecar_restarts_the_gang_at_once() -> None:
    def looping(p: dict[str, Any]) -> dict[str, Any]:
        out = running(p)
        out["status"]["initContainerStatuses"] = [
            {
                "name": "log-shipper",
                "restartCount": 4,
                "state": {
                    "waiting": {"reason": "CrashLoopBackOff", "message": "back-off 1m20s restarting failed"}
                },
                "lastState": {"terminated": {"exitCode": 1, "reason": "Error"}},
            }
        ]
        return out

    body = created_job()
    _, body = step(body, pods_at(body, running), 1)
    assert body["status"]["phase"] == "Running"
    plan, body = step(body, pods_at(body, only("j-controller", looping)), 5)
    assert body["status"]["restarts"] == 1
    assert cond(body, "Restarting")["reason"] == "ContainerFailed"
    assert (
        "pod j-controller init container log-shipper: crash-looping after 4 restarts"
        in cond(body, "Restarting")["message"]
    )


def test_a_problem_that_clears_within_the_grace_is_cleared() -> None:
    body = created_job()
    _, body = step(body, pods_at(body, only("j-actor-1", lambda p: bound(p, 1, pull_error()))), 5)
    assert cond(body, "PodFailure")["status"] == "True"
    plan, body = step(body, pods_at(body, running), 20)  # the registry came back
    assert body["status"]["phase"] == "Running"
    c = cond(body, "PodFailure")
    assert (c["status"], c["reason"]) == ("False", "PodsHealthy")
    assert [e.reason for e in plan.events] == ["Running"]


def test_start_failures_count_against_max_restarts() -> None:
    body = with_status(created_job(), {"restarts": 2})
    config = {"waiting": {"reason": "CreateContainerConfigError", "message": 'configmap "extra" not found'}}
    pods = pods_at(body, only("j-actor-0", lambda p: bound(p, 0, config)), attempt=2)
    plan, body = step(body, pods, 61)
    assert body["status"]["phase"] == "Failed"
    assert cond(body, "Failed")["reason"] == "MaxRestartsExceeded"
    assert cond(body, "PodFailure")["reason"] == "PodStartFailed"
    assert [e.reason for e in plan.events] == ["MaxRestartsExceeded"]


def test_rollout_pod_that_cannot_start_is_replaced_alone_once_it_acts() -> None:
    body = created_job()
    _, body = step(body, pods_at(body, running), 1)
    config = {"waiting": {"reason": "CreateContainerConfigError", "message": 'secret "x" not found'}}
    sick = only("j-rollout-1", lambda p: bound(p, 1, config))
    plan, body = step(body, pods_at(body, sick), 10)
    assert body["status"]["phase"] == "Running" and plan.delete == []
    assert [e.reason for e in plan.events] == ["PodStartFailed"]
    plan, body = step(body, pods_at(body, sick), 61)
    assert body["status"]["restarts"] == 0 and body["status"]["phase"] == "Running"
    assert names(plan.delete) == ["j-rollout-1"]
    assert [e.reason for e in plan.events] == ["RolloutReplicaFailed"]
    assert "cannot start" in plan.events[0].message


def test_rollout_pod_whose_image_cannot_be_pulled_is_reported_not_replaced() -> None:
    """A new pod would pull the same image; the job keeps running on the other replicas."""
    body = created_job()
    _, body = step(body, pods_at(body, running), 1)
    sick = only("j-rollout-1", lambda p: bound(p, 1, pull_error()))
    plan, body = step(body, pods_at(body, sick), 200)
    assert body["status"]["phase"] == "Running" and plan.delete == []
    assert cond(body, "PodFailure")["reason"] == "ImagePullFailed"
    assert [e.reason for e in plan.events] == ["ImagePullFailed"]
    assert body["status"]["rollout"]["ready"] == 1


def test_several_pods_with_one_problem_name_the_others() -> None:
    body = created_job()
    plan, body = step(body, pods_at(body, lambda p: bound(p, 1, pull_error())), 5)
    message = cond(body, "PodFailure")["message"]
    assert message.startswith("pod j-controller container trainer: image")
    assert message.endswith("; also pods j-actor-0, j-actor-1, j-reference-0, j-rollout-0, j-rollout-1")
    assert len(plan.events) == 1


# -- children the API server refuses ---------------------------------------------------------------

QUOTA = 'pods "j-actor-0" is forbidden: exceeded quota: gpu, requested: requests.nvidia.com/gpu=8, used: 0, limited: 4'
INVALID = 'Pod "j-actor-0" is invalid: spec.affinity...operator: Invalid value: "Among": not a valid selector operator'


def test_forbidden_create_is_reported_once_and_retried_with_a_growing_delay() -> None:
    body = job()
    _, body = step(body, [], 0)
    refused = failure_policy.Rejection("Pod", "j-actor-0", 403, QUOTA)
    report = child_failures.report_children(body["status"], refused, True, at(1))
    assert [(e.type, e.reason) for e in report.events] == [("Warning", "QuotaExceeded")]
    assert "Pod j-actor-0: refused by the API server (HTTP 403): " + QUOTA in report.events[0].message
    assert report.requeue_after == 5
    assert report.status is not None and "phase" not in report.status  # still Pending
    body = with_status(body, report.status)
    c = cond(body, "ChildFailure")
    assert (c["status"], c["reason"]) == ("True", "QuotaExceeded")

    again = child_failures.report_children(body["status"], refused, True, at(41))
    assert again.events == [] and again.status is None  # same occurrence: no Event, no write
    assert again.requeue_after == 40

    other = failure_policy.Rejection("Pod", "j-actor-1", 403, QUOTA.replace("j-actor-0", "j-actor-1"))
    moved = child_failures.report_children(body["status"], other, True, at(42))
    assert [e.reason for e in moved.events] == ["QuotaExceeded"]  # a new object: a new occurrence

    created = child_failures.report_children(body["status"], None, True, at(50))
    assert created.status is not None
    c = cond(with_status(body, created.status), "ChildFailure")
    assert (c["status"], c["reason"]) == ("False", "ChildrenCreated")
    assert child_failures.report_children(body["status"], None, False, at(50)).status is None  # nothing tried


def test_invalid_child_fails_the_job() -> None:
    body = job()
    _, body = step(body, [], 0)
    report = child_failures.report_children(
        body["status"], failure_policy.Rejection("Pod", "j-actor-0", 422, INVALID), True, at(1)
    )
    assert report.status is not None and report.status["phase"] == "Failed"
    assert report.requeue_after == 0
    assert [(e.type, e.reason) for e in report.events] == [("Warning", "ChildRejected")]
    body = with_status(body, report.status)
    assert cond(body, "Failed")["reason"] == "ChildRejected"
    assert "HTTP 422" in cond(body, "ChildFailure")["message"]
    # The next pass frees what was created; a finished job reports nothing more.
    plan, _ = step(body, pods_at(body, running), 2)
    assert names(plan.delete) == ALL
    assert (
        child_failures.report_children(body["status"], None, True, at(3)) == child_failures.ChildrenReport()
    )


def test_pods_showing_the_same_problem_one_after_the_other_make_one_event() -> None:
    body = created_job()
    plan, body = step(body, pods_at(body, only("j-actor-1", lambda p: bound(p, 1, pull_error()))), 3)
    assert [e.reason for e in plan.events] == ["ImagePullFailed"]
    plan, body = step(body, pods_at(body, lambda p: bound(p, 1, pull_error())), 5)
    assert plan.events == []  # the controller pod (first in order) now shows it too: same occurrence
    message = cond(body, "PodFailure")["message"]
    assert (
        message.startswith("pod j-actor-1 container trainer:")
        and "also pods j-actor-0, j-controller" in message
    )


def test_rollout_pod_whose_image_cannot_be_pulled_fails_a_job_that_has_not_run() -> None:
    body = created_job()
    sick = only("j-rollout-0", lambda p: bound(p, 1, pull_error()))
    plan, body = step(body, pods_at(body, sick), 61)
    assert body["status"]["phase"] == "Failed"
    assert cond(body, "Failed")["reason"] == "ImagePullFailed"
    assert "pod j-rollout-0 container trainer" in cond(body, "Failed")["message"]
