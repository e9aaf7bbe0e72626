"""`parse_cache.parse`: the spec's parse (schema and CEL rules) once per distinct job, not once per pass."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from operator_helpers import job

from rlhf_api import loader
from rlhf_api.fields import SpecError
from rlhf_operator import crd, kube, parse_cache


@pytest.fixture
def counted(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    calls: list[dict[str, Any]] = []
    real = loader.parse_job

    def parse_job(doc: dict[str, Any], old: dict[str, Any] | None = None, *, admitted: bool = False) -> Any:
        calls.append(doc)
        return real(doc, old, admitted=admitted)

    monkeypatch.setattr(parse_cache, "parse_job", parse_job)
    parse_cache.clear()
    return calls


def test_an_unchanged_job_is_parsed_once_whatever_its_status_and_resource_version(
    counted: list[dict[str, Any]],
) -> None:
    body = job()
    first = parse_cache.parse(body)
    later = copy.deepcopy(body)
    later["status"] = {"phase": "Running"}
    later["metadata"]["resourceVersion"] = "99"
    later["metadata"]["managedFields"] = [{"manager": "rlhf-operator"}]
    assert parse_cache.parse(later) is first
    assert len(counted) == 1 and "status" not in counted[0]


def test_a_changed_spec_is_parsed_again(counted: list[dict[str, Any]]) -> None:
    body = job()
    parse_cache.parse(body)
    scaled = copy.deepcopy(body)
    scaled["spec"]["roles"]["rollout"]["replicas"] = 3
    assert parse_cache.parse(scaled).spec.roles.rollout.replicas == 3
    assert len(counted) == 2


def test_an_invalid_spec_is_remembered_with_its_errors(counted: list[dict[str, Any]]) -> None:
    bad = job(failurePolicy={"maxRestarts": -1})
    with pytest.raises(SpecError) as first:
        parse_cache.parse(bad)
    with pytest.raises(SpecError) as second:
        parse_cache.parse(copy.deepcopy(bad))
    assert first.value.errors == second.value.errors and first.value.errors
    assert len(counted) == 1


def test_one_entry_per_job_dropped_when_forgotten(counted: list[dict[str, Any]]) -> None:
    body = job()
    parse_cache.parse(body)
    scaled = copy.deepcopy(body)
    scaled["spec"]["roles"]["rollout"]["replicas"] = 3
    parse_cache.parse(scaled)
    assert len(parse_cache._parsed) == 1  # the job's latest parse only
    parse_cache.forget("ns", "j")
    parse_cache.parse(scaled)
    assert len(counted) == 3


# -- the API server's rules, trusted when the installed CRD is this operator's -----------------

#: A job the CRD's CEL rules refuse (PPO trains a critic) and the typed loader alone accepts:
#: what a parse does with it tells whether the rules were evaluated.
PPO_WITHOUT_CRITIC = {"algorithm": {"name": "ppo"}}


def ppo_without_critic() -> dict[str, Any]:
    return job(**PPO_WITHOUT_CRITIC)


def test_admitted_skips_only_the_crd_rules_the_api_server_enforced() -> None:
    parse_cache.clear()
    with pytest.raises(SpecError) as refused:
        parse_cache.parse(ppo_without_critic())
    assert any("critic" in e for e in refused.value.errors)
    assert parse_cache.parse(ppo_without_critic(), admitted=True).spec.algorithm.name == "ppo"
    # The typed loader's own checks still run on an admitted job.
    with pytest.raises(SpecError):
        parse_cache.parse(job(failurePolicy={"maxRestarts": "two"}), admitted=True)


def test_a_parse_is_not_reused_across_modes(counted: list[dict[str, Any]]) -> None:
    body = ppo_without_critic()
    parse_cache.parse(body, admitted=True)
    with pytest.raises(SpecError):  # the installed CRD changed: every rule evaluated again
        parse_cache.parse(body, admitted=False)
    assert len(counted) == 2


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def installed(
    annotations: dict[str, str] | None, reads: list[int], clock: Clock | None = None
) -> parse_cache.InstalledRules:
    def read() -> dict[str, str] | None:
        reads.append(1)
        return annotations

    return parse_cache.InstalledRules(read, recheck_seconds=60, clock=clock or Clock())


def test_the_rules_are_enforced_only_when_the_installed_crd_carries_this_operators_digest() -> None:
    mine = {crd.SCHEMA_DIGEST_ANNOTATION: crd.expected_schema_digest(), "other": "x"}
    assert installed(mine, []).enforced()
    older = {crd.SCHEMA_DIGEST_ANNOTATION: "sha256:" + "0" * 64}
    assert not installed(older, []).enforced()
    assert not installed({}, []).enforced()  # a CRD of a release before the digest
    assert not installed(None, []).enforced()  # no CRD at all


def test_a_crd_that_cannot_be_read_means_every_rule_is_evaluated() -> None:
    def forbidden() -> dict[str, str] | None:
        raise kube.Rejected("GET: HTTP 403: forbidden", 403, "forbidden")

    assert not parse_cache.InstalledRules(forbidden).enforced()


def test_the_installed_crd_is_read_again_after_the_recheck_period(caplog: pytest.LogCaptureFixture) -> None:
    clock, reads = Clock(), []
    annotations = {crd.SCHEMA_DIGEST_ANNOTATION: crd.expected_schema_digest()}
    rules = installed(annotations, reads, clock)
    assert rules.enforced() and rules.enforced()
    assert len(reads) == 1
    annotations[crd.SCHEMA_DIGEST_ANNOTATION] = "sha256:older"  # the CRD was replaced
    clock.t = 59
    assert rules.enforced()
    clock.t = 60
    with caplog.at_level("WARNING", logger="rlhf_operator"):
        assert not rules.enforced()
        assert not rules.enforced()
    assert len(reads) == 2
    assert [r.message for r in caplog.records].count(caplog.records[0].message) == 1
    assert "sha256:older" in caplog.records[0].message


def test_a_failed_read_is_retried_soon_not_after_the_recheck_period() -> None:
    clock, calls = Clock(), []

    def read() -> dict[str, str] | None:
        calls.append(clock.t)
        if len(calls) == 1:
            raise kube.Retry("GET: connection refused")
        return {crd.SCHEMA_DIGEST_ANNOTATION: crd.expected_schema_digest()}

    rules = parse_cache.InstalledRules(read, recheck_seconds=60, clock=clock)
    assert not rules.enforced()
    clock.t = parse_cache.RETRY_SECONDS
    assert rules.enforced()
    clock.t += 59
    assert rules.enforced() and len(calls) == 2


def test_a_slow_crd_read_holds_up_no_other_pass() -> None:
    """One caller reads the installed CRD; passes asking meanwhile get the last answer at once
    (before the first one: every rule evaluated here) instead of waiting on the read."""
    import threading

    started, release = threading.Event(), threading.Event()
    clock = Clock()

    def slow() -> dict[str, str] | None:
        started.set()
        release.wait(30)
        return {crd.SCHEMA_DIGEST_ANNOTATION: crd.expected_schema_digest()}

    rules = parse_cache.InstalledRules(slow, recheck_seconds=60, clock=clock)
    reader = threading.Thread(target=rules.enforced, daemon=True)
    reader.start()
    assert started.wait(30)
    answers: list[bool] = []
    other = threading.Thread(target=lambda: answers.append(rules.enforced()), daemon=True)
    other.start()
    other.join(10)
    try:
        assert answers == [False], "a pass waited for another's CRD read"
    finally:
        release.set()
        reader.join(30)
    assert rules.enforced()  # the read's answer, once it is in
