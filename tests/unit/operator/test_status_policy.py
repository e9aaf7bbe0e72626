"""The operator's start-up check of the status-writers ValidatingAdmissionPolicy (status_policy.py):
what it reports for each state of the API server, and the gauge it sets."""

from __future__ import annotations

import logging
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, Gauge

from rlhf_operator import status_policy

NAME = "rlhf-operator-job-status-writers"
POLICY = f"{status_policy.API}/validatingadmissionpolicies/{NAME}"
BINDING = f"{status_policy.API}/validatingadmissionpolicybindings/{NAME}"


@pytest.mark.parametrize(
    ("name", "served", "installed", "said"),
    [
        (NAME, {POLICY, BINDING}, True, "may write only status.progress"),
        (NAME, {POLICY}, False, f"ValidatingAdmissionPolicyBinding {NAME!r} is not installed"),
        # Kubernetes < 1.30 (no v1 API): every GET is a 404.
        (NAME, set(), False, f"ValidatingAdmissionPolicy {NAME!r} is not installed"),
        # The chart rendered none (rbac.statusWritersPolicy=false, or too old a Kubernetes).
        ("", {POLICY, BINDING}, False, "no status-writers ValidatingAdmissionPolicy configured"),
    ],
)
def test_check_reports_what_the_api_server_has(
    name: str, served: set[str], installed: bool, said: str
) -> None:
    asked: list[str] = []

    def read(path: str) -> dict[str, Any] | None:
        asked.append(path)
        return {"metadata": {"name": NAME}} if path in served else None

    state = status_policy.check(name, read)
    assert state.installed is installed
    assert said in state.message
    if not installed:
        assert f"Kubernetes >= {status_policy.MIN_KUBERNETES}" in state.message
    assert asked == ([] if not name else [POLICY, BINDING][: 1 + (POLICY in served)])


@pytest.mark.parametrize("installed", [True, False])
def test_report_sets_the_gauge_and_logs(installed: bool, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="rlhf_operator")
    gauge = Gauge("t_policy_installed", "test", registry=CollectorRegistry())
    gauge.set(7)
    status_policy.report(status_policy.PolicyState(installed, "said so"), gauge)
    assert gauge._value.get() == (1 if installed else 0)
    (record,) = [r for r in caplog.records if "status policy: said so" in r.getMessage()]
    assert record.levelname == ("INFO" if installed else "WARNING")


@pytest.mark.parametrize(
    ("env", "served", "gauge", "said"),
    [
        (
            {status_policy.ENV_POLICY: NAME, "RLHF_OPERATOR_TRAINER_IMAGE": "reg.example/t:1"},
            True,
            1,
            "reg.example/t:1",
        ),
        ({status_policy.ENV_POLICY: ""}, True, 0, "jobs must set spec.image"),
        ({status_policy.ENV_POLICY: NAME}, False, 0, "is not installed"),
    ],
)
def test_the_operator_says_at_start_what_it_works_with(
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    env: dict,
    served: bool,
    gauge: int,
    said: str,
) -> None:
    from rlhf_operator import handlers, metrics

    caplog.set_level(logging.INFO, logger="rlhf_operator")
    monkeypatch.delenv("RLHF_OPERATOR_TRAINER_IMAGE", raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)

    class Client:
        def get_path(self, path: str) -> dict[str, Any] | None:
            return {"metadata": {}} if served else None

    handlers._report_startup(Client())
    assert metrics.STATUS_POLICY_INSTALLED._value.get() == gauge
    assert said in caplog.text
