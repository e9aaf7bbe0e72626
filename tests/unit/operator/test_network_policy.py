"""The per-job NetworkPolicy: who may connect to a job's pods, from the operator's settings."""

from __future__ import annotations

import pytest

from rlhf_api import contract
from rlhf_operator.network_policy import Settings, SettingsError, build_network_policy, ingress_peers


def test_settings_from_the_chart_environment():
    s = Settings.from_env(
        {
            "RLHF_OPERATOR_NAMESPACE": "rlhf-system",
            "RLHF_OPERATOR_POD_SELECTOR": "app.kubernetes.io/name=rlhf-operator,app.kubernetes.io/instance=r",
            "RLHF_OPERATOR_MONITORING_NAMESPACES": "monitoring, observability ,",
        }
    )
    assert s.enabled
    assert s.operator_namespace == "rlhf-system"
    assert dict(s.operator_pod_labels) == {
        "app.kubernetes.io/name": "rlhf-operator",
        "app.kubernetes.io/instance": "r",
    }
    assert s.monitoring_namespaces == ("monitoring", "observability")
    assert not Settings.from_env({"RLHF_OPERATOR_NETWORK_POLICY": "false"}).enabled
    # A developer's operator process (no namespace of its own): only the job's pods and monitoring.
    assert Settings.from_env({}) == Settings()


@pytest.mark.parametrize(
    ("env", "named"),
    [
        (
            {"RLHF_OPERATOR_NETWORK_POLICY": "maybe"},
            "RLHF_OPERATOR_NETWORK_POLICY='maybe': expected true or false",
        ),
        ({"RLHF_OPERATOR_POD_SELECTOR": "app"}, "RLHF_OPERATOR_POD_SELECTOR: 'app' is not key=value"),
    ],
)
def test_bad_settings_name_the_variable_and_the_value(env, named):
    with pytest.raises(SettingsError, match=named.replace("(", r"\(").replace(")", r"\)")):
        Settings.from_env(env)


def test_the_policy_selects_the_jobs_pods_and_admits_only_its_peers():
    settings = Settings(
        operator_namespace="rlhf-system",
        operator_pod_labels={"app.kubernetes.io/name": "rlhf-operator"},
        monitoring_namespaces=("monitoring",),
    )
    meta = {"name": "j", "namespace": "team-a"}
    pol = build_network_policy("j", meta, settings)
    assert pol["kind"] == "NetworkPolicy" and pol["metadata"] is meta
    assert pol["spec"]["podSelector"] == {"matchLabels": {contract.JOB_NAME: "j"}}
    assert pol["spec"]["policyTypes"] == ["Ingress"]  # egress stays open (API server, DNS, stores)
    own, metrics = pol["spec"]["ingress"]
    # The job's own pods: every port (Ray, NCCL and the weight sync pick theirs at run time).
    assert own == {"from": [{"podSelector": {"matchLabels": {contract.JOB_NAME: "j"}}}]}
    # The operator and the monitoring namespaces: the controller's /metrics port, nothing else.
    assert metrics == {
        "from": [
            {
                "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "rlhf-system"}},
                "podSelector": {"matchLabels": {"app.kubernetes.io/name": "rlhf-operator"}},
            },
            {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}},
        ],
        "ports": [{"protocol": "TCP", "port": 8080}],
    }
    assert metrics["ports"][0]["port"] == contract.METRICS_PORT
    # Another job's pods match no peer: its job-name label differs, and a bare podSelector is
    # confined to the policy's namespace.
    assert all(
        p.get("podSelector", {}).get("matchLabels", {}).get(contract.JOB_NAME) in (None, "j")
        for rule in pol["spec"]["ingress"]
        for p in rule["from"]
    )
    # Only a rule with a port list names peers from outside the job.
    assert all("ports" in rule for rule in pol["spec"]["ingress"] if rule is not own)
    assert build_network_policy("j", meta, Settings(enabled=False)) is None
    assert ingress_peers("j", Settings()) == [{"podSelector": {"matchLabels": {contract.JOB_NAME: "j"}}}]
