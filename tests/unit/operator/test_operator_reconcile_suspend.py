"""Suspend then an immediate resume, while the suspension's pods are still terminating: never a
gang restart (driven through the pure `reconcile.plan`)."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from operator_helpers import names, phase
from test_operator_reconcile import ALL, pods_of, running_job, scheduled, step

from rlhf_operator import suspend


def terminating(pod: dict[str, Any], pod_phase: str = "Running") -> dict[str, Any]:
    p = phase(pod, pod_phase) if pod_phase != "Running" else copy.deepcopy(pod)
    p["metadata"]["deletionTimestamp"] = "2025-01-01T12:00:10Z"
    return p


@pytest.mark.parametrize("dying_phase", ["Running", "Failed"])  # SIGTERM's exit 143 can read Failed
def test_resume_while_the_suspended_pods_terminate_is_not_a_restart(dying_phase: str) -> None:
    body, pods = running_job()
    body["spec"]["suspend"] = True
    plan, body = step(body, pods, t=10)
    assert body["status"]["phase"] == "Suspended" and names(plan.delete) == ALL
    dying = [terminating(p, dying_phase) for p in pods]

    body["spec"]["suspend"] = False  # resumed at once: every old pod still terminating
    for t in (11, 12, 40):
        plan, body = step(body, dying, t=t)
        assert body["status"]["phase"] == "Pending", t
        assert body["status"]["restarts"] == 0, t
        assert plan.create == [] and plan.delete == []  # the names are still held
        assert not [e for e in plan.events if e.type == "Warning"], plan.events
    # Half of them are gone: those are recreated, still no restart.
    plan, body = step(body, dying[3:], t=41)
    assert names(plan.create) == sorted(p["metadata"]["name"] for p in dying[:3])
    assert body["status"]["restarts"] == 0
    plan, body = step(body, [], t=42)
    assert names(plan.create) == ALL
    _, body = step(body, pods_of(body, state=scheduled), t=43)
    _, body = step(body, pods_of(body), t=44)
    assert body["status"]["phase"] == "Running" and body["status"]["restarts"] == 0
    assert {p["metadata"]["labels"]["rlhf.dev/restart-attempt"] for p in pods_of(body)} == {"0"}


def test_a_pod_deleted_under_a_running_gang_still_restarts_it() -> None:
    body, pods = running_job()
    pods[0] = terminating(pods[0])
    plan, body = step(body, pods, t=10)
    assert body["status"]["phase"] == "Restarting" and body["status"]["restarts"] == 1
    assert [e.reason for e in plan.events] == ["GangRestart"]


def test_awaiting_removal_only_while_pending() -> None:
    pod = {"metadata": {"name": "a", "deletionTimestamp": "2025-01-01T12:00:00Z"}}
    assert suspend.awaiting_removal(pod, "Pending")
    assert not suspend.awaiting_removal(pod, "Running")
    assert not suspend.awaiting_removal(pod, "Scheduling")
    assert not suspend.awaiting_removal({"metadata": {"name": "a"}}, "Pending")
