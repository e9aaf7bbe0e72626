"""The failure policy on its own (`failure_policy.py`): what a pod's state says went wrong (its
reason and its cause, the word `failurePolicy.rules[].onReasons` uses), the backoff, and which
action the rules give a set of failures. Pod statuses are written the way the kubelet, the
scheduler, the eviction API and the pod GC write them."""

from __future__ import annotations

from typing import Any

import pytest
from operator_helpers import T0
from operator_helpers import bare_pod as pod

from rlhf_api.fields import SpecError
from rlhf_api.loader import parse_spec
from rlhf_api.roles import FAILURE_REASONS, FailurePolicySpec
from rlhf_operator import failure_policy
from rlhf_operator.failure_policy import PodFailure


def disrupted(reason: str) -> list[dict[str, Any]]:
    """The DisruptionTarget condition the control plane adds before it takes a pod away."""
    return [{"type": "DisruptionTarget", "status": "True", "reason": reason, "message": "..."}]


def exited(code: int, reason: str = "Error") -> list[dict[str, Any]]:
    return [{"name": "trainer", "state": {"terminated": {"reason": reason, "exitCode": code}}}]


@pytest.mark.parametrize(
    "restarts,expected",
    [(0, 0), (1, 10), (2, 20), (3, 40), (4, 60), (10, 60)],
)
def test_backoff_doubles_and_is_capped(restarts: int, expected: float) -> None:
    policy = FailurePolicySpec(max_restarts=10, backoff_seconds=10, max_backoff_seconds=60)
    assert failure_policy.backoff_seconds(policy, restarts) == expected


@pytest.mark.parametrize("restarts,done", [(0, False), (2, False), (3, True), (4, True)])
def test_exhausted(restarts: int, done: bool) -> None:
    assert failure_policy.exhausted(FailurePolicySpec(max_restarts=3), restarts) is done


# (observed pod, reason, cause, exit code); reason None: healthy.
CLASSIFICATION = [
    ("running", pod("a", phase="Running"), None, None, None),
    ("pending", pod("a", phase="Pending"), None, None, None),
    ("succeeded", pod("a", phase="Succeeded"), None, None, None),
    (
        "kubelet eviction",
        pod("a", phase="Failed", reason="Evicted", message="low memory"),
        "Evicted",
        "Evicted",
        None,
    ),
    (
        "evicted by a drain",
        pod("a", phase="Running", deleting=True, conditions=disrupted("EvictionByEvictionAPI")),
        "EvictionByEvictionAPI",
        "Evicted",
        None,
    ),
    (
        "preempted by the scheduler",
        pod("a", phase="Running", deleting=True, conditions=disrupted("PreemptionByScheduler")),
        "PreemptionByScheduler",
        "Preempted",
        None,
    ),
    (
        # SIGTERM's exit reads as a container failure; the disruption is the cause.
        "preempted, then Failed",
        pod(
            "a", phase="Failed", conditions=disrupted("PreemptionByScheduler"), containerStatuses=exited(143)
        ),
        "ContainerFailed",
        "Preempted",
        None,
    ),
    (
        "node unreachable (taint manager)",
        pod("a", phase="Running", deleting=True, conditions=disrupted("DeletionByTaintManager")),
        "DeletionByTaintManager",
        "NodeLost",
        None,
    ),
    (
        "node deleted (pod GC)",
        pod("a", phase="Running", deleting=True, conditions=disrupted("DeletionByPodGC")),
        "DeletionByPodGC",
        "NodeLost",
        None,
    ),
    ("node lost", pod("a", phase="Failed", reason="NodeLost"), "NodeLost", "NodeLost", None),
    ("graceful node shutdown", pod("a", phase="Failed", reason="Terminated"), "Terminated", "NodeLost", None),
    ("deleted by a user", pod("a", phase="Running", deleting=True), "PodDeleted", "PodDeletedByUser", None),
    (
        "oom killed",
        pod("a", phase="Failed", containerStatuses=exited(137, "OOMKilled")),
        "OOMKilled",
        "OOMKilled",
        137,
    ),
    (
        "exit code 3",
        pod("a", phase="Failed", containerStatuses=exited(3)),
        "ContainerFailed",
        "ContainerExitCode",
        3,
    ),
    (
        "runtime could not start it",
        pod("a", phase="Failed", containerStatuses=exited(128, "StartError")),
        "PodStartFailed",
        "PodStartFailed",
        None,
    ),
    ("failed, nothing said", pod("a", phase="Failed"), "PodFailed", "PodFailed", None),
    (
        "unknown disruption",
        pod("a", phase="Running", deleting=True, conditions=disrupted("SomethingNew")),
        "SomethingNew",
        "PodFailed",
        None,
    ),
]


@pytest.mark.parametrize(
    "observed,reason,cause,code", [c[1:] for c in CLASSIFICATION], ids=[c[0] for c in CLASSIFICATION]
)
def test_pod_failure_reason_and_cause(
    observed: dict[str, Any], reason: str | None, cause: str | None, code: int | None
) -> None:
    f = failure_policy.pod_failure(observed)
    assert (f.reason if f else None, f.cause if f else None, f.exit_code if f else None) == (
        reason,
        cause,
        code,
    )
    if f:
        assert "pod a" in f.message
        assert f.cause in FAILURE_REASONS  # every cause is a word the rules can name


@pytest.mark.parametrize(
    "role,limits,hint",
    [
        ("actor", {"memory": "128Mi"}, "the memory limit is 128Mi (spec.roles.actor.resources.memory)"),
        ("controller", {"memory": "2Gi"}, "the memory limit is 2Gi (spec.controller.resources.memory)"),
        ("reward", {}, "raise spec.roles.reward.resources.memory"),
    ],
)
def test_an_oom_kill_names_the_memory_limit_and_its_field(
    role: str, limits: dict[str, str], hint: str
) -> None:
    """What a user raises after an OOM kill: the message says the limit and the manifest field."""
    observed = pod("a", role=role, phase="Failed", containerStatuses=exited(137, "OOMKilled"))
    observed["spec"]["containers"] = [{"name": "trainer", "resources": {"limits": limits}}]
    f = failure_policy.pod_failure(observed)
    assert f is not None and f.cause == "OOMKilled"
    assert f.message == f"pod a failed: container trainer exited with code 137 (OOMKilled); {hint}"
    # A container that failed otherwise gets no memory hint.
    observed["status"]["containerStatuses"] = exited(3)
    other = failure_policy.pod_failure(observed)
    assert other is not None and "memory" not in other.message


def test_missing_and_exited_workers_have_their_causes() -> None:
    assert failure_policy.missing_pod("j-actor-0", "actor").cause == "NodeLost"
    assert failure_policy.worker_exited("j-actor-0", "actor").cause == "WorkerExited"


def test_gang_roles() -> None:
    assert [
        r
        for r in ("controller", "actor", "critic", "reference", "reward", "rollout")
        if failure_policy.is_gang_role(r)
    ] == [
        "controller",
        "actor",
        "critic",
        "reference",
        "reward",
    ]


# -- rules ----------------------------------------------------------------------------------------


def failure(
    cause: str, code: int | None = None, restartable: bool = True, name: str = "j-actor-0"
) -> PodFailure:
    return PodFailure(name, "actor", cause, f"pod {name}: {cause}", restartable, cause=cause, exit_code=code)


def policy(*rules: dict[str, Any], max_restarts: int = 2) -> FailurePolicySpec:
    spec = parse_spec(
        {
            "model": {"path": "/m"},
            "data": {"path": "/d.jsonl"},
            "reward": {"functions": [{"path": "r.m:f"}]},
            "failurePolicy": {"maxRestarts": max_restarts, "rules": list(rules)},
        }
    )
    return spec.failure_policy


PREEMPTION_FREE = {"action": "RestartGangNoCount", "onReasons": ["Preempted", "NodeLost", "Evicted"]}
FATAL_EXIT = {"action": "FailJob", "onReasons": ["ContainerExitCode"], "exitCodes": [42, 43]}
ANY_FAILS = {"action": "FailJob"}
RETRY_PULLS = {"action": "RestartGang", "onReasons": ["ImagePullFailed"]}

# (case, rules, failure) -> (action, index of the deciding rule or None)
VERDICTS = [
    ("no rules: counted restart", [], failure("Preempted"), ("RestartGang", None)),
    ("no rules: a pull failure fails", [], failure("ImagePullFailed", restartable=False), ("FailJob", None)),
    ("preemption not counted", [PREEMPTION_FREE], failure("Preempted"), ("RestartGangNoCount", 0)),
    ("node loss not counted", [PREEMPTION_FREE], failure("NodeLost"), ("RestartGangNoCount", 0)),
    ("other reasons keep the default", [PREEMPTION_FREE], failure("OOMKilled", 137), ("RestartGang", None)),
    (
        "listed exit code fails",
        [PREEMPTION_FREE, FATAL_EXIT],
        failure("ContainerExitCode", 43),
        ("FailJob", 1),
    ),
    (
        "other exit code: default",
        [PREEMPTION_FREE, FATAL_EXIT],
        failure("ContainerExitCode", 1),
        ("RestartGang", None),
    ),
    ("first match wins", [ANY_FAILS, PREEMPTION_FREE], failure("Preempted"), ("FailJob", 0)),
    ("empty onReasons matches all", [PREEMPTION_FREE, ANY_FAILS], failure("PodFailed"), ("FailJob", 1)),
    (
        "a rule may retry a pull",
        [RETRY_PULLS],
        failure("ImagePullFailed", restartable=False),
        ("RestartGang", 0),
    ),
    (
        "exitCodes filter only ContainerExitCode",
        [{"action": "RestartGangNoCount", "onReasons": ["ContainerExitCode", "Evicted"], "exitCodes": [9]}],
        failure("Evicted"),
        ("RestartGangNoCount", 0),
    ),
    (
        "ContainerExitCode without exitCodes: any code",
        [{"action": "FailJob", "onReasons": ["ContainerExitCode"]}],
        failure("ContainerExitCode", 1),
        ("FailJob", 0),
    ),
    (
        "OOMKilled is its own reason",
        [FATAL_EXIT | {"exitCodes": [137]}],
        failure("OOMKilled", 137),
        ("RestartGang", None),
    ),
]


@pytest.mark.parametrize("rules,f,expected", [c[1:] for c in VERDICTS], ids=[c[0] for c in VERDICTS])
def test_verdict_of_one_failure(
    rules: list[dict[str, Any]], f: PodFailure, expected: tuple[str, int | None]
) -> None:
    v = failure_policy.verdict(policy(*rules), f)
    assert (v.action, v.rule) == expected


# (case, rules, failures, counted restarts) -> (action, deciding pod, exhausted)
DECISIONS = [
    ("one counted restart", [], [failure("Preempted")], 0, ("RestartGang", "j-actor-0", False)),
    ("counted restarts spent", [], [failure("Preempted")], 2, ("FailJob", "j-actor-0", True)),
    (
        "uncounted restart even when spent",
        [PREEMPTION_FREE],
        [failure("Preempted")],
        2,
        ("RestartGangNoCount", "j-actor-0", False),
    ),
    (
        "a counted failure outweighs an uncounted one",
        [PREEMPTION_FREE],
        [failure("NodeLost", name="j-actor-0"), failure("OOMKilled", 137, name="j-actor-1")],
        0,
        ("RestartGang", "j-actor-1", False),
    ),
    (
        "FailJob outweighs everything",
        [PREEMPTION_FREE, FATAL_EXIT],
        [
            failure("NodeLost", name="j-actor-0"),
            failure("PodFailed", name="j-actor-1"),
            failure("ContainerExitCode", 42, name="j-controller"),
        ],
        0,
        ("FailJob", "j-controller", False),
    ),
    (
        "first of equals",
        [],
        [failure("PodFailed", name="j-actor-1"), failure("PodFailed", name="j-actor-0")],
        0,
        ("RestartGang", "j-actor-1", False),
    ),
]


@pytest.mark.parametrize(
    "rules,failures,counted,expected", [c[1:] for c in DECISIONS], ids=[c[0] for c in DECISIONS]
)
def test_decide(
    rules: list[dict[str, Any]], failures: list[PodFailure], counted: int, expected: tuple[str, str, bool]
) -> None:
    d = failure_policy.decide(policy(*rules), failures, counted)
    assert (d.action, d.verdict.failure.pod, d.exhausted) == expected


def test_verdict_describes_the_rule() -> None:
    v = failure_policy.verdict(policy(PREEMPTION_FREE, FATAL_EXIT), failure("ContainerExitCode", 42))
    assert v.describe() == "spec.failurePolicy.rules[1] (FailJob on ContainerExitCode, exit code 42)"
    assert failure_policy.verdict(policy(), failure("Preempted")).describe() == "the default (RestartGang)"


@pytest.mark.parametrize(
    "rule,error",
    [
        (
            {"action": "Restart"},
            "spec.failurePolicy.rules[0].action: 'Restart' is not valid; valid: RestartGang, RestartGangNoCount, FailJob",
        ),
        ({"onReasons": ["Preempted"]}, "spec.failurePolicy.rules[0].action: required field is missing"),
        (
            {"action": "FailJob", "onReasons": ["Preemption"]},
            "spec.failurePolicy.rules[0].onReasons[0]: 'Preemption' is not valid; valid: NodeLost, Evicted,",
        ),
        (
            {"action": "FailJob", "onReasons": ["Evicted"], "exitCodes": [1]},
            'spec.failurePolicy.rules[0].exitCodes: Invalid value: "array": failurePolicy.rules[].exitCodes needs ContainerExitCode in onReasons',
        ),
        (
            {"action": "FailJob", "onReasons": ["ContainerExitCode"], "exitCodes": [0, 256]},
            'spec.failurePolicy.rules[0].exitCodes: Invalid value: "array": failurePolicy.rules[].exitCodes: exit codes are 1 to 255; got 0',
        ),
        ({"action": "FailJob", "when": "always"}, "spec.failurePolicy.rules[0].when: unknown field"),
    ],
)
def test_invalid_rules_are_refused_naming_the_field(rule: dict[str, Any], error: str) -> None:
    with pytest.raises(SpecError) as err:
        policy(rule)
    assert any(e.startswith(error) for e in err.value.errors), err.value.errors


def test_a_crash_loop_is_a_container_exit_code_with_its_last_exit() -> None:
    crashing = pod(
        "a",
        phase="Running",
        node="n1",
        containerStatuses=[
            {
                "name": "trainer",
                "restartCount": 3,
                "state": {"waiting": {"reason": "CrashLoopBackOff", "message": "back-off 40s"}},
                "lastState": {"terminated": {"reason": "Error", "exitCode": 2}},
            }
        ],
    )
    f = failure_policy.pod_failure(crashing, T0, None)
    assert f is not None and (f.reason, f.cause, f.exit_code, f.acting) == (
        "ContainerFailed",
        "ContainerExitCode",
        2,
        True,
    )


def test_the_crd_carries_the_rules_schema() -> None:
    from rlhf_operator import crd

    spec = crd.build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    rules = spec["properties"]["failurePolicy"]["properties"]["rules"]
    item = rules["items"]
    assert item["required"] == ["action"]
    assert item["properties"]["action"]["enum"] == ["RestartGang", "RestartGangNoCount", "FailJob"]
    assert item["properties"]["onReasons"]["items"]["enum"] == list(FAILURE_REASONS)
    assert "'ContainerExitCode' in self.onReasons" in item["x-kubernetes-validations"][0]["rule"]
