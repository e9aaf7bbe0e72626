"""Pod health: why a pod that is not (yet) `Failed` will not run, read from what the kubelet wrote.

A pod can be bound to a node and never start: its image cannot be pulled, its container cannot
be created (a missing Secret key, a bad mount), its runtime refuses the command, a sidecar keeps
crashing, or it simply sits in `ContainerCreating`. None of this turns the pod `Failed` (the
kubelet keeps retrying), so the gang would wait in `Scheduling` forever, holding its GPUs.
`diagnose(pod, now, start_timeout_seconds)` names the first such problem, from:

* `status.initContainerStatuses[]` then `status.containerStatuses[]`, `state.waiting.reason`:
  image pull errors, container create/run errors, `CrashLoopBackOff`;
* a container `state.terminated` with a non-zero exit code (or `OOMKilled`) while the pod is not
  `Failed` yet (another container still runs);
* a pod bound to a node (`spec.nodeName`) that is not `Running` `start_timeout_seconds` after it
  was bound (`PodScheduled` condition's lastTransitionTime, else `status.startTime`); a pod whose
  sandbox is ready and whose containers are all still being created (`being_created`: a multi-GB
  image pull looks like this, `ContainerCreating` / `PodInitializing` while the kubelet's Event
  says `Pulling`; a volume that never mounts leaves the sandbox not ready) gets
  `pull_timeout_seconds` instead (spec.scheduling.imagePullTimeoutSeconds, longer), so a slow
  pull is no failure and no gang restart. The pod status shows no pull progress (only Events do),
  so the longer bound stands in for "the pull still makes progress". A pull that fails is the
  kubelet's `ErrImagePull` / `ImagePullBackOff`, an image pull problem at once, as before.

Detection only: whether and when the job acts on a problem is `failure_policy`'s decision.
Pods that are `Failed` or being deleted are `failure_policy.pod_failure`'s too; `describe_failed`
names the container that failed them.
"""

from __future__ import annotations

import datetime as dt
import functools
from dataclasses import dataclass
from typing import Any

from rlhf_api.status import parse_time

# Problem kinds (the job's condition reasons; one CamelCase word each).
IMAGE_PULL_FAILED = "ImagePullFailed"
POD_START_FAILED = "PodStartFailed"
CONTAINER_FAILED = "ContainerFailed"
POD_START_TIMEOUT = "PodStartTimeout"

#: Kubelet waiting reasons of an image that cannot be pulled (kubelet `images` package).
IMAGE_PULL_REASONS = frozenset(
    {
        "ErrImagePull",
        "ImagePullBackOff",
        "InvalidImageName",
        "ErrImageNeverPull",
        "ImageInspectError",
        "RegistryUnavailable",
        "SignatureValidationFailed",
    }
)
#: Kubelet waiting reasons of a container that cannot be created or started.
START_REASONS = frozenset(
    {
        "CreateContainerConfigError",
        "CreateContainerError",
        "RunContainerError",
        "PreStartHookError",
        "PostStartHookError",
    }
)
#: Kubelet waiting reasons of a container that is still being created: its image is being pulled
#: (or its volumes mounted); `PodInitializing`: an app container while the init containers start.
CREATING_REASONS = frozenset({"ContainerCreating", "PodInitializing"})
#: Reasons no retry of the kubelet can clear: the image reference itself is invalid, or the image
#: may never be pulled (imagePullPolicy: Never and absent), or the container already crashed.
DEFINITE_REASONS = frozenset({"InvalidImageName", "ErrImageNeverPull", "CrashLoopBackOff"})

#: Longest kubelet message carried into a condition (they can quote whole registry responses).
MAX_DETAIL = 400


@dataclass(frozen=True)
class PodProblem:
    """One reason a pod will not run. `message` is `subject: detail`, naming the container, the
    image (for pull errors) and the kubelet's own reason and message."""

    pod: str
    #: Container (or init container) the kubelet reported it for; "" for the whole pod (timeout).
    container: str
    #: IMAGE_PULL_FAILED, POD_START_FAILED, CONTAINER_FAILED or POD_START_TIMEOUT.
    reason: str
    #: What the kubelet wrote: `ErrImagePull`, `CrashLoopBackOff`, `OOMKilled`, `Error`, ...
    kubelet_reason: str
    #: `pod NAME`, `pod NAME container C` or `pod NAME init container C`: one occurrence's identity.
    subject: str
    message: str
    #: True when waiting cannot help (see DEFINITE_REASONS; a terminated container; the timeout).
    definite: bool
    #: When the pod was bound to its node (the clock of grace periods and the start timeout).
    bound_at: dt.datetime | None
    image: str = ""


def _time(value: Any) -> dt.datetime | None:
    try:
        return parse_time(value) if isinstance(value, str) else None
    except ValueError:
        return None


def bound_at(pod: dict[str, Any]) -> dt.datetime | None:
    """When the pod was bound to its node, or None when it is not bound."""
    if not (pod.get("spec") or {}).get("nodeName"):
        return None
    status = pod.get("status") or {}
    for cond in status.get("conditions") or []:
        if (
            cond.get("type") == "PodScheduled"
            and cond.get("status") == "True"
            and (t := _time(cond.get("lastTransitionTime"))) is not None
        ):
            return t
    return _time(status.get("startTime")) or _time((pod.get("metadata") or {}).get("creationTimestamp"))


def being_created(pod: dict[str, Any]) -> bool:
    """The pod's sandbox is up (`PodReadyToStartContainers` True: its volumes are mounted and its
    network set up, so what remains is pulling images and creating containers), and every
    container the kubelet reports waits in `CREATING_REASONS`: none runs, none waits for anything
    else. A pod whose volumes never mount shows `ContainerCreating` too, but its sandbox is not
    ready: it keeps the start timeout (so does every pod on a kubelet older than 1.29, which
    writes no such condition)."""
    sandbox = any(
        c.get("type") == "PodReadyToStartContainers" and c.get("status") == "True"
        for c in (pod.get("status") or {}).get("conditions") or []
    )
    statuses = [cs for _, cs in _statuses(pod)]
    return (
        sandbox
        and bool(statuses)
        and all(
            ((cs.get("state") or {}).get("waiting") or {}).get("reason") in CREATING_REASONS
            for cs in statuses
        )
    )


def start_timeout(pod: dict[str, Any], timeout_seconds: int, pull_timeout_seconds: int | None) -> int:
    """The bound that applies to a pod waiting to start: the image-pull timeout while it is still
    being created (`being_created`), else the start timeout (also when no pull timeout is given)."""
    if pull_timeout_seconds is not None and being_created(pod):
        return max(timeout_seconds, pull_timeout_seconds)
    return timeout_seconds


def seconds_to_start_timeout(
    pod: dict[str, Any], now: dt.datetime, timeout_seconds: int, pull_timeout_seconds: int | None = None
) -> float | None:
    """Seconds until a bound, not yet Running pod reaches its start timeout (`start_timeout`;
    None: not waiting to start)."""
    status = pod.get("status") or {}
    since = bound_at(pod)
    if since is None or status.get("phase") != "Pending":
        return None
    return start_timeout(pod, timeout_seconds, pull_timeout_seconds) - (now - since).total_seconds()


def _statuses(pod: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    status = pod.get("status") or {}
    out: list[tuple[str, dict[str, Any]]] = []
    for kind in ("initContainerStatuses", "containerStatuses"):
        out.extend(
            ("init container" if kind.startswith("init") else "container", cs)
            for cs in status.get(kind) or []
        )
    return out


def _image(pod: dict[str, Any], container: str, cs: dict[str, Any]) -> str:
    spec = pod.get("spec") or {}
    for c in (spec.get("initContainers") or []) + (spec.get("containers") or []):
        if c.get("name") == container and c.get("image"):
            return str(c["image"])
    return str(cs.get("image") or "")


def _clip(text: str) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= MAX_DETAIL else text[: MAX_DETAIL - 3] + "..."


def _exit(term: dict[str, Any]) -> str:
    reason = term.get("reason") or "Error"
    out = f"exited with code {term.get('exitCode')} ({reason})"
    if term.get("message"):  # the end of a log tail (FallbackToLogsOnError) says the most
        text = " ".join(str(term["message"]).split())
        out += ": " + (text if len(text) <= MAX_DETAIL else "..." + text[-(MAX_DETAIL - 3) :])
    return out


def _early_exit(term: dict[str, Any]) -> bool:
    return term.get("reason") == "OOMKilled" or int(term.get("exitCode") or 0) != 0


def diagnose(
    pod: dict[str, Any],
    now: dt.datetime,
    start_timeout_seconds: int | None,
    pull_timeout_seconds: int | None = None,
) -> PodProblem | None:
    """The first problem of a pod that is neither Failed nor being deleted, or None while it is
    healthy (waiting for the scheduler, pulling its image within `pull_timeout_seconds`, starting
    within `start_timeout_seconds`, running, succeeded)."""
    meta = pod.get("metadata") or {}
    status = pod.get("status") or {}
    name = meta.get("name", "")
    if status.get("phase") in ("Failed", "Succeeded") or meta.get("deletionTimestamp"):
        return None
    problem = functools.partial(_problem, name, bound_at(pod))

    for what, cs in _statuses(pod):
        container = str(cs.get("name") or "")
        subject = f"pod {name} {what} {container}"
        state = cs.get("state") or {}
        waiting = state.get("waiting") or {}
        reason = str(waiting.get("reason") or "")
        said = f"{reason}: {_clip(waiting['message'])}" if waiting.get("message") else reason
        if reason in IMAGE_PULL_REASONS:
            image = _image(pod, container, cs)
            return problem(
                container,
                IMAGE_PULL_FAILED,
                reason,
                subject,
                f"image {image!r} cannot be pulled ({said})",
                reason in DEFINITE_REASONS,
                image,
            )
        if reason in START_REASONS:
            return problem(container, POD_START_FAILED, reason, subject, f"cannot start ({said})", False)
        if reason == "CrashLoopBackOff":
            last = (cs.get("lastState") or {}).get("terminated") or {}
            detail = f"crash-looping after {cs.get('restartCount', 0)} restarts"
            if last:
                detail += f", last {_exit(last)}"
            return problem(container, CONTAINER_FAILED, reason, subject, f"{detail} ({said})", True)
        term = state.get("terminated")
        if term and _early_exit(term):
            reason = str(term.get("reason") or "Error")
            return problem(container, _exit_kind(reason), reason, subject, _exit(term), True)
    if start_timeout_seconds is not None:
        left = seconds_to_start_timeout(pod, now, start_timeout_seconds, pull_timeout_seconds)
        if left is not None and left <= 0:
            detail = _start_timeout_detail(pod, start_timeout_seconds, pull_timeout_seconds)
            return problem("", POD_START_TIMEOUT, "Pending", f"pod {name}", detail, True)
    return None


def _problem(
    pod: str,
    since: dt.datetime | None,
    container: str,
    reason: str,
    kubelet: str,
    subject: str,
    detail: str,
    definite: bool,
    image: str = "",
) -> PodProblem:
    return PodProblem(
        pod, container, reason, kubelet, subject, f"{subject}: {detail}", definite, since, image
    )


def _start_timeout_detail(
    pod: dict[str, Any], start_timeout_seconds: int, pull_timeout_seconds: int | None
) -> str:
    """What a pod past its start bound is waiting on: its images, past the image-pull timeout;
    else its waiting containers."""
    node = (pod.get("spec") or {}).get("nodeName")
    bound = start_timeout(pod, start_timeout_seconds, pull_timeout_seconds)
    if bound != start_timeout_seconds:  # the image-pull timeout: name the images
        creating = [
            f"{cs.get('name')} {cs['state']['waiting']['reason']} (image {_image(pod, str(cs.get('name') or ''), cs)!r})"
            for _, cs in _statuses(pod)
        ]
        return (
            f"bound to node {node} but not Running after {bound}s (spec.scheduling.imagePullTimeoutSeconds); "
            f"still being created (pulling its image or mounting its volumes): {', '.join(creating)}"
        )
    detail = f"bound to node {node} but not Running after {bound}s (spec.scheduling.timeoutSeconds)"
    waiting_on = [
        f"{cs.get('name')} {(cs.get('state') or {}).get('waiting', {}).get('reason') or 'waiting'}"
        for _, cs in _statuses(pod)
        if (cs.get("state") or {}).get("waiting")
    ]
    if waiting_on:
        detail += f"; waiting: {', '.join(waiting_on)}"
    return detail


def _exit_kind(terminated_reason: str) -> str:
    """The problem kind of a terminated container: the runtime could not start it, or it failed."""
    return POD_START_FAILED if terminated_reason in ("StartError", "ContainerCannotRun") else CONTAINER_FAILED


def _failed_container(pod: dict[str, Any]) -> tuple[str, dict[str, Any], dict[str, Any]] | None:
    """(what, container status, its `terminated` state) of the first container that exited early."""
    for what, cs in _statuses(pod):
        term = (cs.get("state") or {}).get("terminated")
        if term and _early_exit(term):
            return what, cs, term
    return None


def describe_failed(pod: dict[str, Any]) -> tuple[str, str] | None:
    """(reason, detail) of the container that made a `Failed` pod fail, init containers first:
    ("OOMKilled", "container trainer exited with code 137 (OOMKilled)"); the reason is `OOMKilled`,
    PodStartFailed (the runtime could not start it) or ContainerFailed."""
    found = _failed_container(pod)
    if found is None:
        return None
    what, cs, term = found
    reason = str(term.get("reason") or "Error")
    kind = "OOMKilled" if reason == "OOMKilled" else _exit_kind(reason)
    return kind, f"{what} {cs.get('name')} {_exit(term)}"


def exit_code(pod: dict[str, Any]) -> int | None:
    """Exit code of the first container (init containers first) that exited non-zero or is
    crash-looping (its last exit); None when none did."""
    for _, cs in _statuses(pod):
        state = cs.get("state") or {}
        term = state.get("terminated")
        if not (term and _early_exit(term)):
            crash_loop = (state.get("waiting") or {}).get("reason") == "CrashLoopBackOff"
            term = (cs.get("lastState") or {}).get("terminated") if crash_loop else None
        if term and term.get("exitCode") is not None:
            try:
                return int(term["exitCode"])
            except (TypeError, ValueError):
                return None
    return None
