"""`jobs.parse`: the spec's parse (schema and CEL rules) once per distinct job, not once per pass."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from operator_helpers import job

from rlhf_operator import jobs
from rlhf_trainer import spec as spec_module
from rlhf_trainer.spec import SpecError


@pytest.fixture
def counted(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    calls: list[dict[str, Any]] = []
    real = spec_module.parse_job

    def parse_job(doc: dict[str, Any], old: dict[str, Any] | None = None) -> Any:
        calls.append(doc)
        return real(doc, old)

    monkeypatch.setattr(jobs, "parse_job", parse_job)
    jobs.clear()
    return calls


def test_an_unchanged_job_is_parsed_once_whatever_its_status_and_resource_version(
    counted: list[dict[str, Any]],
) -> None:
    body = job()
    first = jobs.parse(body)
    later = copy.deepcopy(body)
    later["status"] = {"phase": "Running"}
    later["metadata"]["resourceVersion"] = "99"
    later["metadata"]["managedFields"] = [{"manager": "rlhf-operator"}]
    assert jobs.parse(later) is first
    assert len(counted) == 1 and "status" not in counted[0]


def test_a_changed_spec_is_parsed_again(counted: list[dict[str, Any]]) -> None:
    body = job()
    jobs.parse(body)
    scaled = copy.deepcopy(body)
    scaled["spec"]["roles"]["rollout"]["replicas"] = 3
    assert jobs.parse(scaled).spec.roles.rollout.replicas == 3
    assert len(counted) == 2


def test_an_invalid_spec_is_remembered_with_its_errors(counted: list[dict[str, Any]]) -> None:
    bad = job(failurePolicy={"maxRestarts": -1})
    with pytest.raises(SpecError) as first:
        jobs.parse(bad)
    with pytest.raises(SpecError) as second:
        jobs.parse(copy.deepcopy(bad))
    assert first.value.errors == second.value.errors and first.value.errors
    assert len(counted) == 1


def test_one_entry_per_job_dropped_when_forgotten(counted: list[dict[str, Any]]) -> None:
    body = job()
    jobs.parse(body)
    scaled = copy.deepcopy(body)
    scaled["spec"]["roles"]["rollout"]["replicas"] = 3
    jobs.parse(scaled)
    assert len(jobs._parsed) == 1  # the job's latest parse only
    jobs.forget("ns", "j")
    jobs.parse(scaled)
    assert len(counted) == 3
