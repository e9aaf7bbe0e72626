"""Pod health (detection) and the failure policy's verdict on it, from pod statuses as the kubelet
writes them: waiting reasons with their messages, terminated states, init containers, timeouts."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from operator_helpers import T0, at

from rlhf_api.status import rfc3339
from rlhf_operator import failure_policy, pod_health

IMAGE = "docker.io/library/nope:1"
PULL_ERROR = (
    f'failed to pull and unpack image "{IMAGE}": failed to resolve reference "{IMAGE}": pull access '
    "denied, repository does not exist or may require authorization: server message: insufficient_scope: "
    "authorization failed"
)


def bound_pod(
    name: str = "j-actor-0",
    containers: list[dict[str, Any]] | None = None,
    init: list[dict[str, Any]] | None = None,
    phase: str = "Pending",
    bound: float = 0,
) -> dict[str, Any]:
    """A pod bound to node gpu-0 at T0 + `bound`, with the given container statuses."""
    spec: dict[str, Any] = {
        "nodeName": "gpu-0",
        "restartPolicy": "Never",
        "containers": [{"name": "trainer", "image": IMAGE}],
    }
    status: dict[str, Any] = {
        "phase": phase,
        "conditions": [
            {
                "type": "PodReadyToStartContainers",
                "status": "True",
                "lastTransitionTime": rfc3339(at(bound + 1)),
            },
            {"type": "Initialized", "status": "True", "lastTransitionTime": rfc3339(at(bound + 1))},
            {
                "type": "Ready",
                "status": "False",
                "reason": "ContainersNotReady",
                "message": "containers with unready status: [trainer]",
                "lastTransitionTime": rfc3339(at(bound + 1)),
            },
            {"type": "PodScheduled", "status": "True", "lastTransitionTime": rfc3339(at(bound))},
        ],
        "hostIP": "10.0.0.5",
        "startTime": rfc3339(at(bound + 1)),
        "containerStatuses": containers if containers is not None else [waiting("ContainerCreating")],
    }
    if init is not None:
        spec["initContainers"] = [{"name": c["name"], "image": c.get("image", "busybox:1")} for c in init]
        status["initContainerStatuses"] = init
    return {
        "metadata": {
            "name": name,
            "labels": {"rlhf.dev/role": "actor", "rlhf.dev/replica-index": "0"},
            "creationTimestamp": rfc3339(T0),
        },
        "spec": spec,
        "status": status,
    }


def waiting(reason: str, message: str | None = None, name: str = "trainer", **extra: Any) -> dict[str, Any]:
    state: dict[str, Any] = {"reason": reason}
    if message:
        state["message"] = message
    return {
        "name": name,
        "image": IMAGE,
        "imageID": "",
        "ready": False,
        "restartCount": 0,
        "started": False,
        "state": {"waiting": state},
        **extra,
    }


def terminated(reason: str, code: int, name: str = "trainer", message: str | None = None) -> dict[str, Any]:
    term: dict[str, Any] = {
        "exitCode": code,
        "reason": reason,
        "startedAt": rfc3339(at(2)),
        "finishedAt": rfc3339(at(5)),
        "containerID": "containerd://abc",
    }
    if message:
        term["message"] = message
    return {"name": name, "image": IMAGE, "ready": False, "restartCount": 0, "state": {"terminated": term}}


def running_status(name: str = "trainer") -> dict[str, Any]:
    return {
        "name": name,
        "image": IMAGE,
        "ready": True,
        "restartCount": 0,
        "started": True,
        "state": {"running": {"startedAt": rfc3339(at(2))}},
    }


# -- detection ------------------------------------------------------------------------------------


def test_err_image_pull_names_pod_container_image_and_the_kubelet_message() -> None:
    p = pod_health.diagnose(bound_pod(containers=[waiting("ErrImagePull", PULL_ERROR)]), at(5), 300)
    assert p is not None
    assert (p.reason, p.kubelet_reason, p.container, p.image) == (
        "ImagePullFailed",
        "ErrImagePull",
        "trainer",
        IMAGE,
    )
    assert p.message.startswith(
        "pod j-actor-0 container trainer: image 'docker.io/library/nope:1' cannot be pulled"
    )
    assert "ErrImagePull: failed to pull and unpack image" in p.message and "insufficient_scope" in p.message
    assert p.subject == "pod j-actor-0 container trainer"
    assert not p.definite  # the kubelet retries; a registry blip clears
    assert p.bound_at == T0


@pytest.mark.parametrize(
    "reason,message,kind,definite",
    [
        ("ImagePullBackOff", f'Back-off pulling image "{IMAGE}"', "ImagePullFailed", False),
        (
            "InvalidImageName",
            'Failed to apply default image tag "Nope:1": couldn\'t parse image name "Nope:1": invalid reference format: '
            "repository name must be lowercase",
            "ImagePullFailed",
            True,
        ),
        (
            "ErrImageNeverPull",
            f'Container image "{IMAGE}" is not present with pull policy of Never',
            "ImagePullFailed",
            True,
        ),
        ("CreateContainerConfigError", 'secret "hf-token" not found', "PodStartFailed", False),
        (
            "CreateContainerConfigError",
            "couldn't find key HF_TOKEN in Secret ns/hf-token",
            "PodStartFailed",
            False,
        ),
        (
            "CreateContainerError",
            'failed to generate container "abc" spec: failed to apply OCI options: no such file or directory',
            "PodStartFailed",
            False,
        ),
        (
            "RunContainerError",
            "failed to create containerd task: failed to create shim task: OCI runtime create failed: runc create "
            'failed: unable to start container process: exec: "rlhf": executable file not found in $PATH: unknown',
            "PodStartFailed",
            False,
        ),
    ],
)
def test_waiting_reasons(reason: str, message: str, kind: str, definite: bool) -> None:
    p = pod_health.diagnose(bound_pod(containers=[waiting(reason, message)]), at(5), 300)
    assert p is not None
    assert (p.reason, p.kubelet_reason, p.definite) == (kind, reason, definite)
    assert p.message.startswith("pod j-actor-0 container trainer: ")
    assert f"({reason}: " in p.message and message.split(":")[0] in p.message


# A multi-GB image pull looks like this to the operator: the pod bound, Pending, its containers
# waiting ContainerCreating (an init container's pull: the app containers PodInitializing); the
# kubelet's "Pulling" Event is all it says meanwhile. Such a pod is measured against
# spec.scheduling.imagePullTimeoutSeconds (here 1800), not the start timeout (300): a slow pull is
# no failure and no gang restart. (case, container statuses, init statuses, t) -> (problem reason
# or None, message part, seconds to the timeout)
PULLING = [
    ("pulling, past the start timeout", [waiting("ContainerCreating")], None, 600, (None, None, 1200)),
    (
        "an init container pulling",
        [waiting("PodInitializing")],
        [waiting("ContainerCreating", name="setup")],
        1799,
        (None, None, 1),
    ),
    (
        "pulling past the image-pull timeout: named, with the image",
        [waiting("ContainerCreating")],
        None,
        1800,
        (
            "PodStartTimeout",
            "pod j-actor-0: bound to node gpu-0 but not Running after 1800s (spec.scheduling.imagePullTimeoutSeconds); "
            f"still being created (pulling its image or mounting its volumes): trainer ContainerCreating "
            f"(image '{IMAGE}')",
            0,
        ),
    ),
    (
        "one container pulled but waiting otherwise: the start timeout",
        [waiting("ContainerCreating"), waiting("Waiting", name="side")],
        None,
        300,
        (
            "PodStartTimeout",
            "pod j-actor-0: bound to node gpu-0 but not Running after 300s (spec.scheduling.timeoutSeconds); "
            "waiting: trainer ContainerCreating, side Waiting",
            0,
        ),
    ),
    (
        "sandbox not ready (a volume that never mounts): the start timeout",
        "no-sandbox",
        None,
        300,
        (
            "PodStartTimeout",
            "not Running after 300s (spec.scheduling.timeoutSeconds); waiting: trainer ContainerCreating",
            0,
        ),
    ),
    (
        "no container status yet: the start timeout",
        [],
        None,
        300,
        ("PodStartTimeout", "not Running after 300s (spec.scheduling.timeoutSeconds)", 0),
    ),
]


@pytest.mark.parametrize("containers,init,t,want", [c[1:] for c in PULLING], ids=[c[0] for c in PULLING])
def test_a_pod_still_being_created_waits_for_the_image_pull_timeout(
    containers: list[dict[str, Any]], init: list[dict[str, Any]] | None, t: float, want: tuple[Any, ...]
) -> None:
    no_sandbox = containers == "no-sandbox"
    pod = bound_pod(containers=[waiting("ContainerCreating")] if no_sandbox else containers, init=init)
    if no_sandbox:
        conds = pod["status"]["conditions"]
        conds[0] = {**conds[0], "status": "False"}  # PodReadyToStartContainers
    reason, message, left = want
    p = pod_health.diagnose(pod, at(t), 300, 1800)
    assert (p.reason if p else None) == reason
    assert message is None or (p is not None and message in p.message and p.definite), p
    assert pod_health.seconds_to_start_timeout(pod, at(t), 300, 1800) == left
    f = failure_policy.pod_failure(pod, at(t), 300, 1800)  # what the gang acts on
    assert (f is not None and f.acting) is (reason is not None)


def test_no_separate_pull_bound_given_the_start_timeout_applies() -> None:
    pod = bound_pod(containers=[waiting("ContainerCreating")])
    assert pod_health.diagnose(pod, at(299), 300) is None
    p = pod_health.diagnose(pod, at(300), 300)
    assert p is not None and p.reason == "PodStartTimeout" and p.definite
    assert pod_health.diagnose(pod, at(300), None) is None  # no timeout given: not checked


def test_unbound_and_running_pods_have_no_start_timeout() -> None:
    unbound = bound_pod()
    del unbound["spec"]["nodeName"]
    assert pod_health.diagnose(unbound, at(10_000), 300) is None  # the scheduler's (gang.py)
    assert pod_health.seconds_to_start_timeout(unbound, at(10), 300) is None
    running = bound_pod(containers=[running_status()], phase="Running")
    assert pod_health.diagnose(running, at(10_000), 300) is None
    assert pod_health.seconds_to_start_timeout(running, at(10), 300) is None


def test_bind_time_falls_back_to_start_time() -> None:
    pod = bound_pod(bound=100)
    pod["status"]["conditions"] = [c for c in pod["status"]["conditions"] if c["type"] != "PodScheduled"]
    assert pod_health.bound_at(pod) == at(101)


def test_crash_loop_of_a_sidecar_init_container() -> None:
    """A restartable init container (sidecar) can crash-loop even with restartPolicy Never."""
    sidecar = waiting(
        "CrashLoopBackOff",
        "back-off 40s restarting failed container=log-shipper pod=j-actor-0_ns(uid)",
        name="log-shipper",
        restartCount=3,
        lastState={"terminated": {"exitCode": 2, "reason": "Error", "message": "config missing"}},
    )
    pod = bound_pod(init=[sidecar], containers=[running_status()], phase="Running")
    p = pod_health.diagnose(pod, at(60), 300)
    assert p is not None and (p.reason, p.kubelet_reason, p.definite) == (
        "ContainerFailed",
        "CrashLoopBackOff",
        True,
    )
    assert p.subject == "pod j-actor-0 init container log-shipper"
    assert "crash-looping after 3 restarts, last exited with code 2 (Error): config missing" in p.message


def test_init_container_image_pull() -> None:
    init = [waiting("ErrImagePull", PULL_ERROR, name="fetch-model", image="registry.example/fetch:2")]
    pod = bound_pod(init=init, containers=[waiting("PodInitializing")])
    pod["spec"]["initContainers"][0]["image"] = "registry.example/fetch:2"
    p = pod_health.diagnose(pod, at(5), 300)
    assert p is not None and p.reason == "ImagePullFailed" and p.image == "registry.example/fetch:2"
    assert p.message.startswith("pod j-actor-0 init container fetch-model: image 'registry.example/fetch:2'")


@pytest.mark.parametrize(
    "term,reason",
    [
        (terminated("OOMKilled", 137), "OOMKilled"),
        (terminated("Error", 1, message="Traceback ... RuntimeError: NCCL error"), "Error"),
    ],
)
def test_container_that_exited_early_while_the_pod_still_runs(term: dict[str, Any], reason: str) -> None:
    pod = bound_pod(containers=[term, running_status("sidecar")], phase="Running")
    p = pod_health.diagnose(pod, at(10), 300)
    assert p is not None and (p.reason, p.kubelet_reason, p.definite) == ("ContainerFailed", reason, True)
    assert p.message.startswith(
        f"pod j-actor-0 container trainer: exited with code {term['state']['terminated']['exitCode']}"
    )


def test_container_that_completed_is_not_a_problem() -> None:
    pod = bound_pod(containers=[terminated("Completed", 0), running_status("sidecar")], phase="Running")
    assert pod_health.diagnose(pod, at(10), 300) is None


def test_long_kubelet_messages_are_clipped() -> None:
    p = pod_health.diagnose(bound_pod(containers=[waiting("ErrImagePull", "x" * 5000)]), at(5), 300)
    assert p is not None and len(p.message) < 600 and p.message.endswith("...)")


def test_a_long_log_tail_keeps_its_end() -> None:
    """With terminationMessagePolicy FallbackToLogsOnError the message is the log's last lines:
    the traceback's last line is the one to keep."""
    tail = "INFO noise\n" * 300 + "RuntimeError: ray start failed: the raylet did not register"
    pod = bound_pod(containers=[terminated("Error", 1, message=tail)], phase="Failed")
    reason, detail = pod_health.describe_failed(pod)  # type: ignore[misc]
    assert reason == "ContainerFailed"
    assert detail.endswith("RuntimeError: ray start failed: the raylet did not register")
    assert len(detail) < pod_health.MAX_DETAIL + 80


def test_failed_pod_names_the_container_that_failed_it() -> None:
    pod = bound_pod(
        init=[terminated("Error", 1, name="fetch-model")],
        containers=[waiting("PodInitializing")],
        phase="Failed",
    )
    assert pod_health.describe_failed(pod) == (
        "ContainerFailed",
        "init container fetch-model exited with code 1 (Error)",
    )
    assert pod_health.diagnose(pod, at(5), 300) is None  # failure_policy's: the pod is Failed
    start_error = bound_pod(
        containers=[
            terminated("StartError", 128, message='exec: "rlhf": executable file not found in $PATH')
        ],
        phase="Failed",
    )
    reason, detail = pod_health.describe_failed(start_error)  # type: ignore[misc]
    assert reason == "PodStartFailed" and "executable file not found" in detail


# -- the failure policy's verdict -----------------------------------------------------------------


def test_image_pull_error_acts_after_the_grace_and_is_not_worth_a_restart() -> None:
    pod = bound_pod(containers=[waiting("ErrImagePull", PULL_ERROR)])
    f = failure_policy.pod_failure(pod, at(20), 300)
    assert f is not None and f.reason == "ImagePullFailed" and not f.restartable
    assert f.act_in == failure_policy.START_GRACE_SECONDS - 20 and not f.acting
    f = failure_policy.pod_failure(pod, at(60), 300)
    assert f is not None and f.acting
    # The grace never exceeds the start timeout.
    f = failure_policy.pod_failure(pod, at(20), 30)
    assert f is not None and f.act_in == 10


def test_invalid_image_name_acts_at_once() -> None:
    pod = bound_pod(containers=[waiting("InvalidImageName", "invalid reference format")])
    f = failure_policy.pod_failure(pod, at(1), 300)
    assert f is not None and f.acting and not f.restartable


@pytest.mark.parametrize(
    "containers,acting_at",
    [
        ([waiting("CreateContainerConfigError", 'secret "hf-token" not found')], 60),
        ([waiting("ContainerCreating")], 300),
        ([terminated("OOMKilled", 137), running_status("sidecar")], 0),
    ],
)
def test_restartable_problems(containers: list[dict[str, Any]], acting_at: float) -> None:
    pod = bound_pod(containers=containers, phase="Running" if len(containers) > 1 else "Pending")
    f = failure_policy.pod_failure(pod, at(acting_at), 300)
    assert f is not None and f.acting and f.restartable
    if acting_at:
        early = failure_policy.pod_failure(pod, at(acting_at - 1), 300)
        assert early is None or not early.acting


def test_without_a_clock_only_failed_and_deleted_pods_count() -> None:
    assert failure_policy.pod_failure(bound_pod(containers=[waiting("ErrImagePull", PULL_ERROR)])) is None


def test_failed_pod_reason_and_message_name_the_container() -> None:
    pod = bound_pod(containers=[terminated("OOMKilled", 137)], phase="Failed")
    f = failure_policy.pod_failure(pod, at(5), 300)
    assert f is not None and f.reason == "OOMKilled" and f.restartable and f.acting
    assert f.message == (
        "pod j-actor-0 failed: container trainer exited with code 137 (OOMKilled); "
        "raise spec.roles.actor.resources.memory"
    )
    evicted = copy.deepcopy(pod)
    evicted["status"].update(reason="Evicted", message="The node was low on resource: memory.")
    f = failure_policy.pod_failure(evicted)
    assert f is not None and f.reason == "Evicted" and f.message.endswith("low on resource: memory.")


# -- refused children ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "code,message,reason,permanent",
    [
        (
            422,
            'Pod "j-actor-0" is invalid: spec.affinity.nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution'
            '.nodeSelectorTerms[0].matchExpressions[0].operator: Invalid value: "Among": not a valid selector operator',
            "ChildRejected",
            True,
        ),
        (400, "the server rejected our request due to an error in our request", "ChildRejected", True),
        (
            403,
            'pods "j-actor-0" is forbidden: exceeded quota: gpu-quota, requested: requests.nvidia.com/gpu=8, '
            "used: requests.nvidia.com/gpu=8, limited: requests.nvidia.com/gpu=8",
            "QuotaExceeded",
            False,
        ),
        (
            403,
            'admission webhook "validate.kyverno.svc" denied the request: policy require-team-label failed',
            "ChildForbidden",
            False,
        ),
    ],
)
def test_rejection_classification(code: int, message: str, reason: str, permanent: bool) -> None:
    r = failure_policy.Rejection("Pod", "j-actor-0", code, message)
    assert (r.reason, r.permanent) == (reason, permanent)
    assert r.describe().startswith("Pod j-actor-0: ") and f"(HTTP {code}): {message}" in r.describe()


@pytest.mark.parametrize("refused_for,delay", [(0, 5), (3, 5), (20, 20), (100, 100), (1000, 300)])
def test_rejection_retry_grows_with_how_long_it_has_been_refused(refused_for: float, delay: float) -> None:
    assert failure_policy.rejection_retry_seconds(refused_for) == delay
