"""The chart's ValidatingAdmissionPolicy guards exactly the status keys the operator owns (the
cluster test tests/cluster/test_operator_status_policy.py proves the API server enforces it)."""

from __future__ import annotations

import re
from pathlib import Path

from rlhf_operator import pass_state

POLICY = (
    Path(__file__).resolve().parents[3] / "charts/rlhf-operator/templates/rbac/status-writers-policy.yaml"
)


def test_policy_guards_every_operator_key_and_nothing_of_the_controller_pods() -> None:
    text = POLICY.read_text()
    guarded = set(re.findall(r'message: "status\.([\w.]+) belongs to the rlhf operator', text))
    owned = {k for k in pass_state.OPERATOR_KEYS if k != "rollout"} | {"autoscaling"}
    owned |= {f"rollout.{k}" for k in pass_state.ROLLOUT_KEYS}
    assert guarded == owned
    assert not {"progress", "rollout.syncedGeneration", "rollout"} & guarded
    for key in guarded:  # each key's rule compares the new value with the old one
        assert f"object.status.{key} == oldObject.status.{key}" in text, key
