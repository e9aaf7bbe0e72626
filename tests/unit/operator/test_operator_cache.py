"""The watch-fed pod cache (`rlhf_operator.cache`): what a pass reads instead of a LIST, and how a
seeding LIST and the watch's events are merged whichever comes first."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from operator_helpers import at, job, names, phase, running, scheduled, unschedulable, with_status

from rlhf_operator import pass_state, reconcile
from rlhf_operator.cache import PodCache, _trim


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def pod(name: str, rv: int, uid: str | None = None, job: str = "j", **status: Any) -> dict[str, Any]:
    return {
        "metadata": {
            "name": name,
            "namespace": "ns",
            "uid": uid or f"uid-{name}",
            "resourceVersion": str(rv),
            "labels": {"rlhf.dev/job-name": job},
            "managedFields": [{"manager": "kubelet"}],
        },
        "status": status,
    }


def state(cache: PodCache, job: str = "j") -> dict[str, tuple[str, str]] | None:
    pods = cache.pods("ns", job)
    if pods is None:
        return None
    return {
        p["metadata"]["name"]: (p["metadata"]["resourceVersion"], p["status"].get("phase", "")) for p in pods
    }


def test_a_job_is_listed_once_then_read_from_the_watch() -> None:
    clock = Clock()
    cache = PodCache(relist_seconds=300, clock=clock)
    cache.observe(None, pod("a", 5, phase="Pending"))  # kopf's initial listing
    assert state(cache) is None  # never seeded: the pass must list
    cache.seed("ns", "j", [pod("a", 5, phase="Pending"), pod("b", 6, phase="Pending")], "10")
    assert state(cache) == {"a": ("5", "Pending"), "b": ("6", "Pending")}
    cache.observe("MODIFIED", pod("a", 11, phase="Running"))
    cache.observe("ADDED", pod("c", 12, phase="Pending"))
    cache.observe("DELETED", pod("b", 13))
    assert state(cache) == {"a": ("11", "Running"), "c": ("12", "Pending")}
    assert state(cache, job="other") is None
    clock.now = 299
    assert state(cache) is not None
    clock.now = 300  # the periodic relist (drift repair)
    assert state(cache) is None


def test_an_older_list_neither_resurrects_a_deleted_pod_nor_rolls_a_pod_back() -> None:
    cache = PodCache()
    cache.observe("MODIFIED", pod("a", 20, phase="Running"))
    cache.observe("DELETED", pod("b", 21))
    cache.observe("ADDED", pod("c", 22, phase="Pending"))  # created after the list was taken
    cache.seed("ns", "j", [pod("a", 7, phase="Pending"), pod("b", 8, phase="Running")], "15")
    assert state(cache) == {"a": ("20", "Running"), "c": ("22", "Pending")}


def test_a_newer_list_wins_and_drops_pods_it_no_longer_has() -> None:
    cache = PodCache()
    cache.observe("MODIFIED", pod("a", 5, phase="Pending"))
    cache.observe("MODIFIED", pod("gone", 6, phase="Running"))  # its deletion was missed
    cache.seed("ns", "j", [pod("a", 9, phase="Running")], "30")
    assert state(cache) == {"a": ("9", "Running")}


def test_a_recreated_pod_of_the_same_name_replaces_the_old_one() -> None:
    cache = PodCache()
    cache.seed("ns", "j", [pod("a", 5, uid="old")], "5")
    cache.observe("DELETED", pod("a", 6, uid="old"))
    cache.observe("ADDED", pod("a", 7, uid="new", phase="Pending"))
    got = cache.pods("ns", "j")
    assert got is not None and [p["metadata"]["uid"] for p in got] == ["new"]


def test_copies_without_managed_fields_and_forget() -> None:
    cache = PodCache()
    cache.seed("ns", "j", [pod("a", 5)], "5")
    got = cache.pods("ns", "j")
    assert got is not None and "managedFields" not in got[0]["metadata"]
    got[0]["status"]["phase"] = "Failed"  # a pass may change what it read: the cache does not move
    assert state(cache) == {"a": ("5", "")}
    cache.forget("ns", "j")
    assert state(cache) is None


def test_pods_without_the_job_label_are_ignored() -> None:
    cache = PodCache()
    stray = pod("x", 1)
    del stray["metadata"]["labels"]["rlhf.dev/job-name"]
    cache.observe("ADDED", stray)
    cache.seed("ns", "j", [], "1")
    assert state(cache) == {}


def _states() -> list[tuple[str, dict[str, Any], list[dict[str, Any]], float]]:
    """A job's pods in the states the plan reads them in, as the API server returns them."""
    body = job(scheduling={"queueName": "team-a"})
    first = reconcile.plan(body, [], at(0))
    body = with_status(body, first.status)
    pods = [copy.deepcopy(p) for p in first.create]
    for p in pods:  # what the server adds to a created pod (ownership: the job's UID)
        p["metadata"].setdefault("uid", "uid-" + p["metadata"]["name"])
    pull = running(pods[1])
    pull["status"].update(
        phase="Pending",
        containerStatuses=[
            # No image here: the report names the spec's (`pod_health._image`).
            {"name": "trainer", "state": {"waiting": {"reason": "ErrImagePull", "message": "not found"}}}
        ],
    )
    gated = copy.deepcopy(pods[0])
    gated["spec"]["schedulingGates"] = [{"name": "kueue.x-k8s.io/admission"}]
    return [
        ("created", body, pods, 1),
        ("gated", body, [gated, *pods[1:]], 1),
        ("unschedulable", body, [unschedulable(p, "0/3 nodes are available") for p in pods], 120),
        ("bound", body, [scheduled(p) for p in pods], 2),
        ("running", body, [running(p) for p in pods], 3),
        ("image pull", body, [running(pods[0]), pull, *[running(p) for p in pods[2:]]], 400),
        ("failed", body, [phase(pods[0], "Failed", "Error"), *[running(p) for p in pods[1:]]], 4),
    ]


@pytest.mark.parametrize("name,body,pods,t", _states(), ids=[s[0] for s in _states()])
def test_the_plan_from_cached_pods_is_the_plan_from_whole_pods(
    name: str, body: dict[str, Any], pods: list[dict[str, Any]], t: float
) -> None:
    """The cache keeps only the fields of a pod the operator reads (`cache._trim`): a plan must not
    tell the two apart (a new read of another field fails here)."""
    whole = reconcile.plan(body, copy.deepcopy(pods), at(t))
    cached = reconcile.plan(body, [_trim(p) for p in pods], at(t))

    def seen(plan: pass_state.Plan) -> Any:
        return (
            plan.status,
            names(plan.create),
            names(plan.delete),
            names(plan.release),
            plan.events,
            plan.requeue_after,
            [b.describe() for b in plan.blocked],
        )

    assert seen(cached) == seen(whole)
    assert all(
        set(_trim(p)["spec"]) <= {"nodeName", "schedulingGates", "containers", "initContainers"} for p in pods
    )
