"""One tenant cannot take the shared operator down: bounds on what a job asks for (pods, host
paths), numbers in its status clamped before arithmetic, condition messages clipped. Pure
functions and `reconcile.plan`, no cluster (tests/cluster/test_operator_tenant_bounds.py runs the
same jobs against a real API server and a running operator)."""

from __future__ import annotations

import copy
import time
from typing import Any

import pytest
from operator_helpers import BASE_SPEC, at, job, running

from rlhf_api.fields import MAX_PODS_PER_JOB, MAX_REPLICAS, SpecError
from rlhf_api.job import JobSpec
from rlhf_api.loader import parse_job, parse_spec
from rlhf_api.roles import FailurePolicyRuleSpec, FailurePolicySpec
from rlhf_api.schema import openapi_schema
from rlhf_api.status import FAILED
from rlhf_operator import children, failure_policy, pass_state, reconcile, tenant_limits
from rlhf_operator.status import get_condition, set_condition, summary
from rlhf_operator.tenant_limits import Limits, clamp_int, host_path_allowed


def _with(path: str, value: Any, body: dict[str, Any] | None = None) -> dict[str, Any]:
    body = copy.deepcopy(body or job())
    *head, last = path.split(".")
    obj = body
    for key in head:
        obj = obj[int(key)] if isinstance(obj, list) else obj.setdefault(key, {})
    obj[last] = value
    return body


def _refused(body: dict[str, Any], limits: Limits | None = None) -> tuple[str, str]:
    out = reconcile.plan(body, [], at(0), limits=limits)
    cond = get_condition(out.status, FAILED) or {}
    return str(cond.get("reason")), str(cond.get("message"))


# -- replica bounds: the CRD's maximum, the per-job sum, the operator's own bound ------------------


@pytest.mark.parametrize(
    ("path", "value", "expect"),
    [
        ("spec.roles.actor.replicas", 10**6, "spec.roles.actor.replicas: 1000000 is above the maximum 1024"),
        (
            "spec.roles.rollout.maxReplicas",
            10**18,
            "spec.roles.rollout.maxReplicas: 1000000000000000000 is above",
        ),
        (
            "spec.roles.reference.replicas",
            1025,
            "spec.roles.reference.replicas: 1025 is above the maximum 1024",
        ),
        # Each role under its bound, the job over: the CRD's per-job rule names the sum.
        ("spec.roles.actor.replicas", 1020, "this one asks for 1026 pods"),
    ],
)
def test_replica_counts_above_the_bounds_are_refused_naming_the_bound(
    path: str, value: int, expect: str
) -> None:
    with pytest.raises(SpecError) as err:
        parse_job(_with(path, value))
    assert any(expect in e for e in err.value.errors), err.value.errors


def test_the_crd_carries_the_bounds() -> None:
    schema = openapi_schema(JobSpec)
    roles = schema["properties"]["roles"]["properties"]
    assert roles["actor"]["properties"]["replicas"]["maximum"] == MAX_REPLICAS
    assert roles["rollout"]["properties"]["maxReplicas"]["maximum"] == MAX_REPLICAS
    rules = [r["rule"] for r in schema["x-kubernetes-validations"]]
    assert any(r.endswith(f"<= {MAX_PODS_PER_JOB}") and "maxReplicas" in r for r in rules)


def test_a_job_above_the_operators_bound_fails_before_a_pod_is_built(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_pods(*_: Any, **__: Any) -> None:
        raise AssertionError("a pod was built for a job the operator refuses")

    monkeypatch.setattr(children, "build_pod", no_pods)
    body = _with("spec.roles.actor.replicas", 8)  # 1 + 8 + 1 reference + 4 rollout max = 14 pods
    out = reconcile.plan(body, [], at(0), limits=Limits(max_pods_per_job=10))
    assert out.create == [] and out.job is None and out.invalid
    cond = get_condition(out.status, FAILED) or {}
    assert cond["reason"] == "TooManyPods" and out.status["phase"] == "Failed"
    assert "asks for 14 pods" in cond["message"] and "at most 10 pods per job" in cond["message"]
    assert tenant_limits.MAX_PODS_ENV in cond["message"]


def test_a_job_at_the_operators_bound_runs() -> None:
    body = _with("spec.roles.actor.replicas", 4)  # 1 + 4 + 1 + 4 = 10
    out = reconcile.plan(body, [], at(0), limits=Limits(max_pods_per_job=10))
    assert out.invalid is None and len(out.create) == 1 + 4 + 1 + 2  # the fleet starts at 2


def test_a_pass_over_a_big_running_job_builds_no_pod(monkeypatch: pytest.MonkeyPatch) -> None:
    """The gang is planned by name and count; a pod object is built only to be created."""
    body = _with("spec.roles.actor.replicas", 1000)  # 1 + 1000 + 1 + 2 of the fleet: 1004 pods
    body["status"] = {"phase": "Running", "restarts": 0, "rollout": {"desired": 2, "generation": 1}}
    pods = [running(x) for x in children.build_pods(parse_job(body)).values()]
    built: list[str] = []
    real = children.build_pod

    def counting(*args: Any, **kwargs: Any) -> dict[str, Any]:
        built.append(args[1])
        return real(*args, **kwargs)

    monkeypatch.setattr(children, "build_pod", counting)
    out = reconcile.plan(body, pods, at(0), admitted=True)
    assert out.status["phase"] == "Running" and out.create == [] and built == []
    body["status"]["phase"] = "Pending"  # one pod still to create: only it is built
    missing = [x for x in pods if x["metadata"]["name"] != "j-actor-7"]
    out = reconcile.plan(body, missing, at(0), admitted=True)
    assert built == ["actor"] and [x["metadata"]["name"] for x in out.create] == ["j-actor-7"]


@pytest.mark.parametrize(
    ("placement", "actor", "rollout_max", "pods"),
    [
        ("disaggregated", 2, 4, 1 + 2 + 1 + 4),
        ("colocated", 2, 4, 1 + 2 + 1),
        ("disaggregated", 1, 1021, 1024),  # at the CRD's bound
    ],
)
def test_pod_count_is_arithmetic_on_the_spec(placement: str, actor: int, rollout_max: int, pods: int) -> None:
    s = copy.deepcopy(BASE_SPEC)
    s["roles"]["placement"] = placement
    s["roles"]["actor"]["replicas"] = actor
    s["roles"]["rollout"]["maxReplicas"] = rollout_max
    assert tenant_limits.pod_count(parse_spec(s)) == pods


@pytest.mark.parametrize(
    ("env", "expect"),
    [
        ({}, Limits(MAX_PODS_PER_JOB, ())),
        ({"RLHF_OPERATOR_MAX_PODS_PER_JOB": "64"}, Limits(64, ())),
        (
            {"RLHF_OPERATOR_ALLOWED_HOST_PATHS": " /data , /models/shared,"},
            Limits(1024, ("/data", "/models/shared")),
        ),
    ],
)
def test_limits_from_the_environment(env: dict[str, str], expect: Limits) -> None:
    assert Limits.from_env(env) == expect


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"RLHF_OPERATOR_MAX_PODS_PER_JOB": "lots"}, "RLHF_OPERATOR_MAX_PODS_PER_JOB='lots' is not valid"),
        ({"RLHF_OPERATOR_MAX_PODS_PER_JOB": "0"}, "a positive integer"),
        ({"RLHF_OPERATOR_ALLOWED_HOST_PATHS": "data"}, "'data' is not valid; valid: absolute paths"),
    ],
)
def test_bad_limits_are_named(env: dict[str, str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Limits.from_env(env)


# -- hostPath: off by default, an allow-list of prefixes on path boundaries ------------------------

HOST_VOLUME = {"name": "host", "mountPath": "/host", "hostPath": {"path": "/proc"}}


@pytest.mark.parametrize(
    ("path", "allowed", "ok"),
    [
        ("/proc", (), False),
        ("/data", ("/data",), True),
        ("/data/models/x", ("/data",), True),
        ("/data/", ("/data",), True),
        ("/database", ("/data",), False),
        ("/data/../proc", ("/data",), False),
        ("/proc", ("/data", "/proc"), True),
        ("/anything", ("/",), True),
        ("/data", ("/data/models",), False),
    ],
)
def test_host_path_allowed_on_path_boundaries(path: str, allowed: tuple[str, ...], ok: bool) -> None:
    assert host_path_allowed(path, allowed) is ok


@pytest.mark.parametrize(
    "where", ["spec.pod.volumes", "spec.roles.rollout.pod.volumes", "spec.controller.pod.volumes"]
)
def test_a_host_path_is_refused_by_default_naming_the_field(where: str) -> None:
    shared = BASE_SPEC["pod"]["volumes"] if where == "spec.pod.volumes" else []  # the checkpoints' claim
    reason, message = _refused(_with(where, [HOST_VOLUME, *shared]))
    assert reason == "HostPathNotAllowed"
    assert f"{where}[0].hostPath.path: hostPath '/proc' is not allowed" in message
    assert "allowed host paths: none" in message


def test_a_host_path_the_allow_list_names_is_accepted() -> None:
    body = _with(
        "spec.pod.volumes",
        [*BASE_SPEC["pod"]["volumes"], {**HOST_VOLUME, "hostPath": {"path": "/data/models"}}],
    )
    out = reconcile.plan(body, [], at(0), limits=Limits(allowed_host_paths=("/data",)))
    assert out.invalid is None and out.create
    vols = [v for v in out.create[0]["spec"]["volumes"] if v["name"] == "host"]
    assert vols[0]["hostPath"]["path"] == "/data/models"
    reason, message = _refused(body, Limits(allowed_host_paths=("/srv",)))
    assert reason == "HostPathNotAllowed" and "allowed host paths: /srv" in message


# -- numbers in status: clamped, never an exception, never 2 ** 10**12 ------------------------------


@pytest.mark.parametrize(
    ("value", "expect"),
    [
        (5, 5),
        (10**12, 100),
        (-3, 0),
        ("7", 7),
        ("1e400", 0),
        ("abc", 0),
        (float("nan"), 0),
        (float("inf"), 0),
        (1.5e308, 100),
        (True, 0),
        ([1], 0),
        (None, 0),
        ({"a": 1}, 0),
    ],
)
def test_clamp_int(value: Any, expect: int) -> None:
    assert clamp_int(value, 0, 100) == expect


def _restarting(restarts: Any, **status: Any) -> dict[str, Any]:
    st = {
        "phase": "Restarting",
        "restarts": restarts,
        "conditions": [
            {
                "type": "Restarting",
                "status": "True",
                "reason": "x",
                "message": "",
                "lastTransitionTime": "2025-01-01T11:00:00Z",
            }
        ],
        **status,
    }
    return job(status=st)


@pytest.mark.parametrize("restarts", [10**12, 10**30, "999999999999999999999", 1.5e308, "junk", [3]])
def test_a_forged_restart_count_costs_nothing(restarts: Any) -> None:
    started = time.perf_counter()
    out = reconcile.plan(_restarting(restarts), [], at(0), admitted=True)  # no CEL: the pass alone
    assert time.perf_counter() - started < 2.0
    assert 0 <= out.status["restarts"] <= pass_state.MAX_RESTARTS
    assert all(
        p["metadata"]["labels"]["rlhf.dev/restart-attempt"] == str(out.status["restarts"]) for p in out.create
    )


@pytest.mark.parametrize(
    ("backoff", "restarts", "expect"),
    [
        (10, 1, 10.0),
        (10, 3, 40.0),
        (10, 10**12, 60.0),
        (0, 1, failure_policy.MIN_BACKOFF_SECONDS),
        (0, 10**9, 1.0),
    ],
)
def test_backoff_is_capped_before_the_power_and_has_a_floor(
    backoff: int, restarts: int, expect: float
) -> None:
    policy = FailurePolicySpec(max_restarts=3, backoff_seconds=backoff, max_backoff_seconds=60)
    started = time.perf_counter()
    assert failure_policy.backoff_seconds(policy, restarts) == expect
    assert time.perf_counter() - started < 0.1


@pytest.mark.parametrize(
    "status",
    [
        {"progress": {"metrics": ["reward_mean", 1]}, "rollout": "x"},
        {"progress": {"step": "many", "totalSteps": [1], "reward": "NaN", "metrics": {"reward_mean": [2]}}},
        {
            "progress": {"reward": 1e400},
            "rollout": {"generation": "x", "syncedGeneration": 10**40, "desired": -5},
        },
        {"progress": "junk"},
    ],
)
def test_wrong_typed_status_from_the_pod_never_wedges_a_pass(status: dict[str, Any]) -> None:
    body = job(status={"phase": "Running", **status})
    out = reconcile.plan(body, [], at(0))
    assert out.status["phase"] in ("Restarting", "Running", "Pending", "Failed")
    assert isinstance(out.status["summary"]["step"], str)
    # Suspension still works on the same status.
    suspended = reconcile.plan(_with("spec.suspend", True, body), [], at(0))
    assert suspended.status["phase"] == "Suspended"


@pytest.mark.parametrize(
    ("progress", "reward"),
    [
        ({"reward": 0.5}, 0.5),
        ({"metrics": {"reward_mean": "0.25"}}, 0.25),
        ({"metrics": ["x"]}, None),
        ({"reward": True}, None),
    ],
)
def test_summary_reads_progress_defensively(progress: dict[str, Any], reward: float | None) -> None:
    assert summary({"progress": progress}, 10)["reward"] == reward


def test_uncounted_restarts_are_capped() -> None:
    policy = FailurePolicySpec(
        max_restarts=3,
        rules=[FailurePolicyRuleSpec(action="RestartGangNoCount", on_reasons=["NodeLost"])],
    )
    failure = failure_policy.missing_pod("j-actor-0", "actor")
    assert failure.cause == "NodeLost"
    free = failure_policy.decide(policy, [failure], 0, failure_policy.MAX_UNCOUNTED_RESTARTS - 1)
    assert free.action == failure_policy.RESTART_GANG_NO_COUNT
    capped = failure_policy.decide(policy, [failure], 0, failure_policy.MAX_UNCOUNTED_RESTARTS)
    assert capped.action == failure_policy.RESTART_GANG
    assert failure_policy.decide(policy, [failure], 3, 100).action == failure_policy.FAIL_JOB


# -- condition messages fit the schema -------------------------------------------------------------


@pytest.mark.parametrize("length", [10, 4096, 4097, 100_000])
def test_condition_messages_are_clipped_to_the_schema(length: int) -> None:
    conds = set_condition([], FAILED, True, "R" * 500, "m" * length, at(0))
    assert len(conds[0]["message"]) == min(length, tenant_limits.MAX_MESSAGE)
    assert len(conds[0]["reason"]) <= 128
    if length > tenant_limits.MAX_MESSAGE:
        assert conds[0]["message"].endswith("(clipped)")


@pytest.mark.parametrize(
    ("flag", "message"),
    [
        ("--max-pods-per-job=lots", "RLHF_OPERATOR_MAX_PODS_PER_JOB='lots' is not valid"),
        ("--allowed-host-paths=data", "'data' is not valid; valid: absolute paths"),
    ],
)
def test_rlhf_operator_refuses_bad_bounds_at_start(flag: str, message: str) -> None:
    import subprocess
    import sys

    res = subprocess.run(
        [sys.executable, "-m", "rlhf_trainer.cli", "operator", flag],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 2 and message in res.stderr, res.stderr
