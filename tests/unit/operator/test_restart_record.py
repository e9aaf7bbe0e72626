"""Restarts are counted from the operator's own record (annotations on the job), not from the
status a pod may write: a forged `status.restarts`/`countedRestarts` changes neither the pods'
attempt, nor the backoff, nor the restart budget (maxRestarts 2, backoff 10 s doubling here)."""

from __future__ import annotations

import copy
from typing import Any

from operator_helpers import at, job, merge_patch, names, phase, running, scheduled, with_record
from test_operator_executor import FakeKube, run

from rlhf_api.loader import parse_job
from rlhf_operator import children, pass_state, reconcile, restart_record
from rlhf_operator.executor import Executor
from rlhf_operator.status import get_condition


def pods_of(body: dict[str, Any], attempt: int = 0, state: Any = running) -> list[dict[str, Any]]:
    return [state(p) for p in children.build_pods(parse_job(body), attempt).values()]


def step(
    body: dict[str, Any], pods: list[dict[str, Any]], t: float
) -> tuple[pass_state.Plan, dict[str, Any]]:
    """One pass, its status and its record applied as the executor writes them."""
    plan = reconcile.plan(body, pods, at(t))
    out = copy.deepcopy(body)
    out["status"] = merge_patch(out.get("status") or {}, plan.status)
    if plan.record is not None:
        out["metadata"].setdefault("annotations", {}).update(plan.record)
    return plan, out


def forged(body: dict[str, Any], **status: Any) -> dict[str, Any]:
    """What the controller pod may write where the status policy is absent (no record change)."""
    out = copy.deepcopy(body)
    out["status"].update(status)
    return out


def running_job(restarts: int = 0) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    body = with_record(job(), restarts) if restarts else job()
    _, body = step(body, [], 0)
    _, body = step(body, pods_of(body, restarts, scheduled), 1)
    _, body = step(body, pods_of(body, restarts), 2)
    assert body["status"]["phase"] == "Running" and body["status"]["restarts"] == restarts
    return body, pods_of(body, restarts)


def test_a_forged_restart_count_moves_nothing_on_a_job_never_restarted() -> None:
    body, pods = running_job()
    plan, after = step(forged(body, restarts=40, countedRestarts=0), pods, 10)
    assert after["status"]["restarts"] == 0  # the operator's count written back
    assert plan.delete == [] and plan.create == []  # attempt 0 stays current: no gang restart
    assert restart_record.RESTARTS not in (after["metadata"].get("annotations") or {})


def test_the_backoff_and_the_attempt_follow_the_record_not_the_status() -> None:
    body, pods = running_job(restarts=1)
    body = forged(body, restarts=9, countedRestarts=0)
    pods = [phase(p, "Failed", "Error") if p["metadata"]["name"] == "j-actor-1" else p for p in pods]
    plan, body = step(body, pods, 100)
    assert body["status"]["restarts"] == 2 and body["status"]["phase"] == "Restarting"
    assert body["metadata"]["annotations"][restart_record.RESTARTS] == "2"
    assert plan.requeue_after == 20  # backoff 10 * 2 ** (2 - 1), not that of restart 10
    plan, body = step(body, [], 121)
    assert {p["metadata"]["labels"]["rlhf.dev/restart-attempt"] for p in plan.create} == {"2"}


def test_a_forged_counted_restarts_does_not_refill_the_budget() -> None:
    body, pods = running_job(restarts=2)  # maxRestarts 2: spent
    body = forged(body, restarts=0, countedRestarts=0)
    pods = [phase(p, "Failed", "Error") if p["metadata"]["name"] == "j-actor-0" else p for p in pods]
    _, body = step(body, pods, 50)
    failed = get_condition(body["status"], "Failed")
    assert body["status"]["phase"] == "Failed" and failed is not None
    assert failed["reason"] == "MaxRestartsExceeded"


def test_a_job_without_a_record_counts_its_pods_attempt() -> None:
    """A job an earlier release started (its status, no record): the pods' attempt label, which
    only the operator writes, is its count; the status is not read."""
    body, _ = running_job()
    legacy = forged(body, restarts=3)
    plan, after = step(legacy, pods_of(legacy, 3), 5)
    assert after["status"]["restarts"] == 3 and plan.delete == []
    assert plan.record == {restart_record.RESTARTS: "3", restart_record.COUNTED_RESTARTS: "3"}
    plan, after = step(forged(body, restarts=3), pods_of(body, 0), 5)
    assert after["status"]["restarts"] == 0 and plan.delete == []


def test_the_executor_writes_the_record_before_the_restarts_pods() -> None:
    fake = FakeKube(job())
    ex = Executor(fake)  # type: ignore[arg-type]
    run(ex)
    fake.set_pods("Running")
    run(ex, 1)
    run(ex, 2)
    assert fake.job is not None and fake.job["status"]["phase"] == "Running"
    assert not [e for e in fake.log if e.startswith("record")]  # nothing to record yet
    del fake.objects[("Pod", "j-actor-0")]  # lost with its node: a counted gang restart
    run(ex, 10)
    fake.objects = {k: o for k, o in fake.objects.items() if k[0] != "Pod"}  # the old gang gone
    run(ex, 30)
    log = fake.log
    record = log.index("record rlhf.dev/counted-restarts=1,rlhf.dev/restarts=1")
    assert log.index("status Restarting") < record
    assert record < min(i for i, e in enumerate(log) if e.startswith("create Pod") and i > record - 1)
    assert names([o for (k, _), o in fake.objects.items() if k == "Pod"])
    assert {
        o["metadata"]["labels"]["rlhf.dev/restart-attempt"]
        for (k, _), o in fake.objects.items()
        if k == "Pod"
    } == {"1"}
