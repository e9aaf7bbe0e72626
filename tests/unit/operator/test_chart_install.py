"""The chart's install-path values, rendered with the real `helm template` (skipped, saying so,
where helm has not been built): the default trainer image reaches the operator (read back through
the operator's own `images`), the status-writers policy exists only for Kubernetes >= 1.30 (and
the operator is told its name only then), the aggregated tenant ClusterRoles, and kopf's peering
CRDs rendered where absent."""

from __future__ import annotations

from typing import Any

import pytest
import yaml
from test_chart_scrape_settings import CHART, HELM, helm, one, operator_env

from rlhf_operator import images, status_policy

pytestmark = pytest.mark.skipif(HELM is None, reason="helm not built yet (tests/cluster/build caches it)")
APP_VERSION = yaml.safe_load((CHART / "Chart.yaml").read_text())["appVersion"]
VAP = "admissionregistration.k8s.io/v1/ValidatingAdmissionPolicy"


def render(*args: str) -> list[dict[str, Any]]:
    out = helm("template", "r", str(CHART), "--namespace", "rlhf-system", *args)
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


@pytest.mark.parametrize(
    ("sets", "want"),
    [
        ([], f"ghcr.io/rlhf-operator/trainer:{APP_VERSION}"),
        (["--set", "trainerImage.variant=cpu"], f"ghcr.io/rlhf-operator/trainer-cpu:{APP_VERSION}"),
        (
            [
                "--set",
                "trainerImage.variant=cpu,trainerImage.cpu.repository=reg.example/t",
                "--set-string",
                "trainerImage.tag=0123",
            ],
            "reg.example/t:0123",
        ),
        (["--set", "trainerImage.variant=none"], ""),
    ],
)
def test_the_default_trainer_image_reaches_the_operator(sets: list[str], want: str) -> None:
    env = operator_env(render(*sets))
    assert images.default_image(env) == want


def test_a_bad_variant_is_refused_by_the_schema() -> None:
    out = helm("template", "r", str(CHART), "--set", "trainerImage.variant=tpu")
    assert out.returncode != 0 and "/trainerImage/variant" in out.stderr


@pytest.mark.parametrize(
    ("kube", "policy"),
    [("1.29.0", False), ("1.30.0", True), ("1.36.3", True)],
)
def test_the_status_policy_is_rendered_only_where_the_api_has_it(kube: str, policy: bool) -> None:
    docs = render("--kube-version", kube, "--api-versions", VAP, "--set", "crds.install=false")
    kinds = [d["kind"] for d in docs]
    assert ("ValidatingAdmissionPolicy" in kinds) is policy
    assert ("ValidatingAdmissionPolicyBinding" in kinds) is policy
    told = status_policy.policy_name(operator_env(docs))
    assert told == ("r-rlhf-operator-job-status-writers" if policy else "")
    discovery = [
        d for d in docs if d["kind"] == "ClusterRole" and d["metadata"]["name"].endswith("-discovery")
    ]
    reads = [r for d in discovery for r in d["rules"] if "validatingadmissionpolicies" in r["resources"]]
    assert (
        (reads and reads[0]["resourceNames"] == [told] and reads[0]["verbs"] == ["get"])
        if policy
        else not reads
    )
    if policy:
        (vap,) = [d for d in docs if d["kind"] == "ValidatingAdmissionPolicy"]
        assert vap["metadata"]["name"] == told


def test_tenant_roles_aggregate_to_edit_and_view() -> None:
    roles = {
        d["metadata"]["name"]: d for d in render("--set", "crds.install=false") if d["kind"] == "ClusterRole"
    }
    edit, view = roles["r-rlhf-operator-edit"], roles["r-rlhf-operator-view"]
    labels = edit["metadata"]["labels"]
    assert labels["rbac.authorization.k8s.io/aggregate-to-edit"] == "true"
    assert labels["rbac.authorization.k8s.io/aggregate-to-admin"] == "true"
    assert view["metadata"]["labels"]["rbac.authorization.k8s.io/aggregate-to-view"] == "true"
    by = {tuple(r["resources"]): set(r["verbs"]) for r in edit["rules"]}
    assert {"create", "update", "patch", "delete"} <= by[("rltrainingjobs",)]
    assert {"update", "patch"} <= by[("rltrainingjobs/scale",)]
    assert by[("rltrainingjobs/status",)] == {"get"}  # tenants never write status
    assert all(set(r["verbs"]) <= {"get", "list", "watch"} for r in view["rules"])
    off = render("--set", "crds.install=false,rbac.aggregateToDefaultRoles=false")
    assert not [
        d for d in off if d["kind"] == "ClusterRole" and d["metadata"]["name"].endswith(("-edit", "-view"))
    ]


@pytest.mark.parametrize(
    ("sets", "kopf"),
    [
        ([], True),  # nothing to look up under `helm template`: rendered
        (["--set", "crds.kopfPeering=false"], False),
        (["--set", "peering.enabled=false,replicaCount=1"], False),
        (["--set", "crds.install=false"], False),
    ],
)
def test_kopf_peering_crds_are_optional_and_kept(sets: list[str], kopf: bool) -> None:
    docs = render(*sets)
    crds = {d["metadata"]["name"]: d for d in docs if d["kind"] == "CustomResourceDefinition"}
    shared = {"clusterkopfpeerings.kopf.dev", "kopfpeerings.kopf.dev"}
    assert (shared & set(crds)) == (shared if kopf else set())
    for name in shared & set(crds):
        assert crds[name]["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    peerings = [d for d in docs if d["kind"] in ("ClusterKopfPeering", "KopfPeering")]
    assert all(p["metadata"]["name"] == "rlhf-operator" for p in peerings)
    assert one(docs, "Deployment")
