"""Pods stuck Terminating on a node that is not Ready are force-deleted past a grace period, so the
gang restart can create its pods (same names); pods on a Ready node are left to their kubelet."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from operator_helpers import at, job
from test_operator_executor import FakeKube

from rlhf_api import contract
from rlhf_api.status import rfc3339
from rlhf_operator import stuck_pods
from rlhf_operator.executor import Executor


def pod(name: str, node: str = "n1", deleted_at: float | None = 0.0) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "uid": f"uid-{name}"}
    if deleted_at is not None:
        meta["deletionTimestamp"] = rfc3339(at(deleted_at))
    return {"metadata": meta, "spec": {"nodeName": node}, "status": {"phase": "Running"}}


def node(ready: str) -> dict[str, Any]:
    return {"status": {"conditions": [{"type": "Ready", "status": ready}]}}


@pytest.mark.parametrize(
    ("ready", "stuck"), [("False", True), ("Unknown", True), ("True", False), (None, True)]
)
def test_an_overdue_pod_is_stuck_only_where_its_node_is_not_ready(ready: str | None, stuck: bool) -> None:
    nodes = {"n1": node(ready)} if ready else {}
    found, wake = stuck_pods.find([pod("p")], at(stuck_pods.GRACE_SECONDS + 1), nodes.get)
    assert [s.pod["metadata"]["name"] for s in found] == (["p"] if stuck else [])
    assert wake is None
    if stuck:
        assert f"node n1 (Ready: {ready or 'missing'})" in found[0].message
        assert "force-deleted" in found[0].message


def test_within_the_grace_nothing_is_read_and_the_pass_wakes_when_it_ends() -> None:
    reads: list[str] = []
    found, wake = stuck_pods.find([pod("p")], at(10), lambda n: reads.append(n) or node("False"))  # type: ignore[func-returns-value]
    assert found == [] and reads == []
    assert wake == pytest.approx(stuck_pods.GRACE_SECONDS - 10)


def test_live_unbound_and_unreadable_node_pods_are_left_alone() -> None:
    def unreadable(name: str) -> dict[str, Any] | None:
        raise PermissionError("nodes is forbidden")

    now = at(stuck_pods.GRACE_SECONDS + 5)
    assert stuck_pods.find([pod("live", deleted_at=None)], now, lambda n: node("False")) == ([], None)
    assert stuck_pods.find([pod("unbound", node="")], now, lambda n: node("False")) == ([], None)
    assert stuck_pods.find([pod("p")], now, unreadable) == ([], None)


class NodeKube(FakeKube):
    """FakeKube with Nodes and a delete that, like a kubelet that does not answer, only marks a
    pod Terminating unless its grace period is 0."""

    def __init__(self, body: dict[str, Any], ready: str) -> None:
        super().__init__(body)
        self.nodes = {"n": node(ready)}
        self.forced: list[str] = []
        self.now = at(0)

    def get_path(self, path: str) -> dict[str, Any] | None:
        return copy.deepcopy(self.nodes.get(path.rsplit("/", 1)[-1]))

    def delete(self, obj: dict[str, Any], grace_period_seconds: int | None = None) -> None:
        key = (obj.get("kind", "Pod"), obj["metadata"]["name"])
        if key[0] == "Pod" and grace_period_seconds != 0 and key in self.objects:
            self.objects[key]["metadata"].setdefault("deletionTimestamp", rfc3339(self.now))
            return
        if grace_period_seconds == 0:
            self.forced.append(key[1])
        super().delete(obj)


def _restart_on_a_dead_node(ready: str) -> NodeKube:
    fake = NodeKube(job(), ready)
    ex = Executor(fake)  # type: ignore[arg-type]
    ex.reconcile("ns", "j", now=at(0))
    fake.set_pods("Running")
    ex.reconcile("ns", "j", now=at(1))
    ex.reconcile("ns", "j", now=at(2))
    assert fake.job is not None and fake.job["status"]["phase"] == "Running"
    # The node stops answering; the taint manager deletes a worker (its kubelet never confirms).
    actor = fake.objects[("Pod", "j-actor-0")]
    actor["metadata"]["deletionTimestamp"] = rfc3339(at(3))
    for t in (4, 5, 40, 80, 120, 200):
        fake.now = at(t)
        ex.reconcile("ns", "j", now=at(t))
    return fake


def test_a_gang_restart_on_a_not_ready_node_force_deletes_and_recreates_every_pod() -> None:
    fake = _restart_on_a_dead_node("Unknown")
    assert fake.job is not None
    status = fake.job["status"]
    assert status["restarts"] == 1
    pods = [o for (k, _), o in fake.objects.items() if k == "Pod"]
    assert pods and all(p["metadata"]["labels"][contract.RESTART_ATTEMPT] == "1" for p in pods)
    assert "j-actor-0" in fake.forced and "j-controller" in fake.forced
    forced = [m for t, r, m in fake.events if r == "PodForceDeleted"]
    assert forced and all("Ready: Unknown" in m for m in forced)


def test_on_a_ready_node_terminating_pods_are_waited_for() -> None:
    fake = _restart_on_a_dead_node("True")
    assert fake.job is not None and fake.job["status"]["phase"] == "Restarting"
    assert fake.forced == []
    pods = [o for (k, _), o in fake.objects.items() if k == "Pod"]
    assert all(p["metadata"]["labels"][contract.RESTART_ATTEMPT] == "0" for p in pods)
