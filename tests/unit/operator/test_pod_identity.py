"""OpenShift-style clusters: the pods' uid is the operator's setting (a number, one per job, or the
platform's: none set), and the chart grants the finalizers update that blockOwnerDeletion needs
there. The chart half is rendered with the real `helm template` (skipped where helm is not built)."""

from __future__ import annotations

from typing import Any

import pytest
from operator_helpers import job
from test_chart_scrape_settings import HELM, one, operator_env, render

from rlhf_api.loader import parse_job
from rlhf_operator import children, pod_identity


def _pod_security(monkeypatch: pytest.MonkeyPatch, setting: str | None, uid: str = "uid-1") -> dict[str, Any]:
    if setting is None:
        monkeypatch.delenv(pod_identity.ENV, raising=False)
    else:
        monkeypatch.setenv(pod_identity.ENV, setting)
    doc = job()
    doc["metadata"]["uid"] = uid
    return children.build_pod(parse_job(doc), "actor")["spec"]["securityContext"]  # type: ignore[no-any-return]


def test_the_default_is_the_images_uid(monkeypatch: pytest.MonkeyPatch) -> None:
    ctx = _pod_security(monkeypatch, None)
    assert (ctx["runAsUser"], ctx["runAsGroup"], ctx["fsGroup"]) == (1000, 1000, 1000)
    assert _pod_security(monkeypatch, "4242")["runAsUser"] == 4242


def test_platform_sets_no_uid_and_keeps_the_restrictions(monkeypatch: pytest.MonkeyPatch) -> None:
    ctx = _pod_security(monkeypatch, "platform")
    assert not {"runAsUser", "runAsGroup", "fsGroup"} & set(ctx)
    assert ctx["runAsNonRoot"] is True and ctx["seccompProfile"] == {"type": "RuntimeDefault"}


def test_per_job_gives_each_job_its_own_stable_uid(monkeypatch: pytest.MonkeyPatch) -> None:
    a = _pod_security(monkeypatch, "per-job", "0b6b7a34-8c1e-4a8f-9d2e-5f4c3b2a1908")
    again = _pod_security(monkeypatch, "per-job", "0b6b7a34-8c1e-4a8f-9d2e-5f4c3b2a1908")
    b = _pod_security(monkeypatch, "per-job", "7d1f0c55-2b3a-4e6d-8f90-a1b2c3d4e5f6")
    assert a == again and a["runAsUser"] != b["runAsUser"]
    for ctx in (a, b):
        assert ctx["runAsUser"] == ctx["runAsGroup"] == ctx["fsGroup"]
        assert pod_identity.PER_JOB_BASE <= ctx["runAsUser"] < 2**31


@pytest.mark.parametrize("bad", ["0", "-5", "root", "per job", "1000.5"])
def test_a_bad_setting_is_refused_naming_it(bad: str) -> None:
    with pytest.raises(ValueError, match=rf"RLHF_OPERATOR_POD_UID='{bad}' is not valid; valid: a uid >= 1"):
        pod_identity.setting({pod_identity.ENV: bad})


def test_the_operator_refuses_a_bad_setting_at_start(monkeypatch: pytest.MonkeyPatch, capsys: Any) -> None:
    from rlhf_trainer.cli import main

    monkeypatch.setenv(pod_identity.ENV, "root")
    assert main(["operator", "--namespace", "ns"]) == 2
    assert "RLHF_OPERATOR_POD_UID='root' is not valid" in capsys.readouterr().err


helm_only = pytest.mark.skipif(HELM is None, reason="helm not built yet (tests/cluster/build caches it)")


@helm_only
def test_the_cluster_role_may_update_the_jobs_finalizers() -> None:
    """blockOwnerDeletion on the children's owner references: OwnerReferencesPermissionEnforcement
    (OpenShift) refuses every create without update on rltrainingjobs/finalizers."""
    role = next(
        d for d in render() if d["kind"] == "ClusterRole" and d["metadata"]["name"] == "r-rlhf-operator"
    )
    rules = [r for r in role["rules"] if "rltrainingjobs/finalizers" in r["resources"]]
    assert rules and "update" in rules[0]["verbs"] and rules[0]["apiGroups"] == ["rlhf.dev"]
    assert children.owner_reference(parse_job(job()))["blockOwnerDeletion"] is True


@helm_only
@pytest.mark.parametrize(("value", "want"), [(None, 1000), ("per-job", "per-job"), ("platform", "platform")])
def test_the_chart_value_reaches_the_operator(value: str | None, want: Any) -> None:
    env = operator_env(render(*([f"tenants.podUser={value}"] if value else [])))
    assert pod_identity.setting(env) == want
    assert one(render(), "Deployment")  # still one operator Deployment
