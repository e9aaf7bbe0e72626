"""The Helm chart: every scenario values file passes `helm lint` and the API server's dry run; the
values schema refuses bad values; the CRD it ships is the generated one, and `helm upgrade` from
the 0.1.0 layout (CRDs in crds/, which Helm never upgrades) brings a new field to the API server."""

from __future__ import annotations

import copy
import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from harness import Cluster, ClusterError, assets_dir
from test_operator_e2e import CHART, CHART_CRDS, installed, render_chart  # noqa: F401  (installed is a fixture)

from rlhf_operator import crd

pytestmark = [pytest.mark.cluster, pytest.mark.usefixtures("installed")]

SCENARIOS = sorted(p.name for p in (CHART / "ci").glob("*.yaml"))
PROMETHEUS_OPERATOR_GROUP = "monitoring.coreos.com/"
ROOT = CHART.parents[1]


@pytest.mark.parametrize("values", SCENARIOS)
def test_helm_template_passes_server_dry_run(cluster: Cluster, values: str) -> None:
    # Objects of the Prometheus Operator's CRDs, absent from the test cluster, are left out of the
    # dry run; test_monitoring_objects checks them.
    docs = [
        d
        for d in yaml.safe_load_all(render_chart(values))
        if d and not d["apiVersion"].startswith(PROMETHEUS_OPERATOR_GROUP)
    ]
    rendered = yaml.safe_dump_all(docs)
    for doc in docs:  # namespaces a scenario binds into must exist for the dry run
        ns = doc.get("metadata", {}).get("namespace")
        if ns:
            cluster.kubectl("create", "namespace", ns, check=False)
    out = cluster.kubectl(
        "apply", "--server-side", "--force-conflicts", "--dry-run=server", "-f", "-", input=rendered
    )
    kinds = {d["kind"] for d in docs}
    assert {"ClusterRole", "ServiceAccount", "Deployment"} <= kinds
    values_doc = yaml.safe_load((CHART / "ci" / values).read_text()) or {}
    assert ("CustomResourceDefinition" in kinds) == values_doc.get("crds", {}).get("install", True)
    assert "serverside-applied (server dry run)" in out


def test_installed_crd_is_the_generated_one(cluster: Cluster) -> None:
    live = json.loads(cluster.kubectl("get", "crd", crd.CRD_NAME, "-o", "json"))
    want = crd.build_crd()
    assert live["spec"]["versions"][0]["schema"] == json.loads(
        json.dumps(want["spec"]["versions"][0]["schema"])
    )
    assert live["spec"]["versions"][0]["subresources"] == want["spec"]["versions"][0]["subresources"]


def test_monitoring_objects() -> None:
    """Dashboards, alerts and the scrape of every job's controller pod ship in the chart, and are
    the same files as manifests/monitoring/."""
    docs = [d for d in yaml.safe_load_all(render_chart("monitoring-values.yaml")) if d]
    by_kind: dict[str, list[dict]] = {}
    for d in docs:
        by_kind.setdefault(d["kind"], []).append(d)

    (rule,) = by_kind["PrometheusRule"]
    shipped = yaml.safe_load((ROOT / "manifests" / "monitoring" / "prometheus-rules.yaml").read_text())
    assert rule["spec"] == shipped["spec"]
    assert rule["metadata"]["labels"]["release"] == "kube-prometheus-stack"

    (pm,) = by_kind["PodMonitor"]
    assert pm["spec"]["selector"]["matchLabels"] == {"rlhf.dev/role": "controller"}
    relabel = pm["spec"]["podMetricsEndpoints"][0]["relabelings"]
    assert {
        "sourceLabels": ["__meta_kubernetes_pod_label_rlhf_dev_job_name"],
        "targetLabel": "rlhf_job",
    } in relabel
    assert pm["spec"]["podMetricsEndpoints"][0]["port"] == "metrics"
    assert len(by_kind["ServiceMonitor"]) == 1

    dashboards = {
        name: json.loads(body)
        for cm in by_kind["ConfigMap"]
        for name, body in cm["data"].items()
        if name.endswith(".json")
    }
    for path in (ROOT / "manifests" / "monitoring" / "dashboards").glob("*.json"):
        assert dashboards.pop(path.name) == json.loads(path.read_text()), path.name
    assert not dashboards, f"dashboards in the chart but not in manifests/monitoring: {sorted(dashboards)}"
    assert all(cm["metadata"]["labels"]["grafana_dashboard"] == "1" for cm in by_kind["ConfigMap"])


def _helm(*args: str, cluster: Cluster | None = None, check: bool = True) -> subprocess.CompletedProcess[str]:
    cmd = [str(assets_dir() / "helm"), *args]
    if cluster is not None:
        cmd.append(f"--kubeconfig={cluster.kubeconfig}")
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    if check and out.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed ({out.returncode}):\n{out.stdout}\n{out.stderr}")
    return out


@pytest.mark.parametrize("values", SCENARIOS)
def test_helm_lint_strict(values: str) -> None:
    out = _helm("lint", "--strict", str(CHART), "-f", str(CHART / "ci" / values))
    assert "0 chart(s) failed" in out.stdout


@pytest.mark.parametrize(
    ("setting", "named"),
    [
        ("replicaCount=two", "at '/replicaCount': got string, want integer"),
        (
            "image.pullPolicy=Sometimes",
            "at '/image/pullPolicy': value must be one of 'Always', 'IfNotPresent', 'Never'",
        ),
        ("replicaz=2", "additional properties 'replicaz' not allowed"),
        ("operator.metricsPort=70000", "at '/operator/metricsPort'"),
        ("watchNamespaces[0]=Team_A", "at '/watchNamespaces/0'"),
        ("serviceMonitor.interval=thirty", "at '/serviceMonitor/interval'"),
    ],
)
def test_values_schema_refuses_a_bad_value_naming_it(setting: str, named: str) -> None:
    out = _helm("template", "r", str(CHART), "--set", setting, check=False)
    assert out.returncode != 0
    assert named in out.stderr


def test_defaults_two_replicas_one_active_a_pdb_and_kept_crds() -> None:
    docs = [d for d in yaml.safe_load_all(render_chart("default-values.yaml")) if d]
    by_kind: dict[str, list[dict]] = {}
    for d in docs:
        by_kind.setdefault(d["kind"], []).append(d)
    (deploy,) = by_kind["Deployment"]
    assert deploy["spec"]["replicas"] == 2
    args = deploy["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--peering=rlhf-operator" in args
    assert [p["metadata"]["name"] for p in by_kind["ClusterKopfPeering"]] == ["rlhf-operator"]
    (pdb,) = by_kind["PodDisruptionBudget"]
    assert pdb["spec"]["maxUnavailable"] == 1
    assert pdb["spec"]["selector"]["matchLabels"] == deploy["spec"]["selector"]["matchLabels"]
    crds = {d["metadata"]["name"]: d for d in by_kind["CustomResourceDefinition"]}
    assert set(crds) == {crd.CRD_NAME, "clusterkopfpeerings.kopf.dev", "kopfpeerings.kopf.dev"}
    assert all(d["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep" for d in crds.values())
    # One replica needs no PDB; CRDs managed apart are left out.
    single = [
        d
        for d in yaml.safe_load_all(
            _helm("template", "r", str(CHART), "--set", "replicaCount=1,crds.install=false").stdout
        )
        if d
    ]
    assert not [d for d in single if d["kind"] in ("PodDisruptionBudget", "CustomResourceDefinition")]


def _old_layout_chart(tmp: Path) -> Path:
    """The chart as 0.1.0 shipped it: CRDs in crds/ (installed once, never upgraded), no CRD
    templates, and an RLTrainingJob CRD without a field that came later (`spec.pod`)."""
    old = tmp / "rlhf-operator"
    shutil.copytree(CHART, old)
    (old / "templates" / "crds.yaml").unlink()
    (old / "files" / "crds").rename(old / "crds")
    path = old / "crds" / CRD_FILE
    doc = yaml.safe_load(path.read_text())
    spec = doc["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    del spec["properties"]["pod"]
    # The rules that came with the field go with it (the API server refuses a rule naming a field
    # its schema lacks).
    spec["x-kubernetes-validations"] = [
        r
        for r in spec.get("x-kubernetes-validations", [])
        if not re.search(r"(?<![\w.])(self|oldSelf)\.pod\b", r["rule"]) and r.get("fieldPath") != ".pod"
    ]
    del doc["metadata"]["annotations"]
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    chart = yaml.safe_load((old / "Chart.yaml").read_text())
    (old / "Chart.yaml").write_text(yaml.safe_dump({**chart, "version": "0.1.0"}, sort_keys=False))
    return old


CRD_FILE = crd.CRD_FILES[1].name


def _stored_pod_env(cluster: Cluster, namespace: str, validate: str = "strict") -> object:
    """`spec.pod.env` of a job as the API server would store it (server dry run: pruned by the
    live CRD's schema, or refused with `validate=strict`)."""
    job = copy.deepcopy(yaml.safe_load((ROOT / "manifests" / "examples" / "grpo-h100.yaml").read_text()))
    job["metadata"] = {"name": "upgrade-probe", "namespace": namespace}
    job["spec"]["pod"] = {**job["spec"].get("pod", {}), "env": [{"name": "HF_HOME", "value": "/cache/hf"}]}
    out = cluster.kubectl(
        "apply", "--dry-run=server", f"--validate={validate}", "-o", "json", "-f", "-", input=json.dumps(job)
    )
    return json.loads(out)["spec"].get("pod", {}).get("env")


def test_upgrade_from_the_0_1_0_layout_serves_the_new_field(cluster: Cluster, tmp_path: Path) -> None:
    release, namespace = "upgrade-probe", "rlhf-upgrade-probe"
    cluster.kubectl("create", "namespace", namespace, check=False)
    common = ["-n", namespace, "--set", f"replicaCount=0,peering.name={release}"]
    old = _old_layout_chart(tmp_path)
    try:
        # 0.1.0's CRD on the server (as its install left it), then its release.
        cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(old / "crds"))
        _helm("install", release, str(old), *common, "--wait", "--timeout=120s", cluster=cluster)
        # The old schema: strict validation refuses spec.pod, and without it the field is pruned.
        with pytest.raises(ClusterError, match='unknown field "spec.pod"'):
            _stored_pod_env(cluster, namespace)
        assert _stored_pod_env(cluster, namespace, validate="ignore") is None

        # The documented upgrade: the CRDs are now templates of the release.
        up = _helm("upgrade", release, str(CHART), *common, "--take-ownership", cluster=cluster)
        assert "The CRDs are part of this release" in up.stdout  # NOTES.txt
        live = json.loads(cluster.kubectl("get", "crd", crd.CRD_NAME, "-o", "json"))
        assert live["metadata"]["annotations"]["meta.helm.sh/release-name"] == release
        assert (
            "pod"
            in live["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]
        )
        assert _stored_pod_env(cluster, namespace) == [{"name": "HF_HOME", "value": "/cache/hf"}]

        # Uninstalling keeps the CRDs (and so every job).
        _helm("uninstall", release, "-n", namespace, "--wait", cluster=cluster)
        cluster.kubectl("get", "crd", crd.CRD_NAME, "clusterkopfpeerings.kopf.dev")
    finally:
        _helm("uninstall", release, "-n", namespace, cluster=cluster, check=False)
        # The session's other tests need the current CRD, whatever happened above.
        cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(CHART_CRDS))
        cluster.kubectl("delete", "namespace", namespace, "--wait=false", check=False)


def test_the_operator_reads_the_network_policy_settings_the_chart_gives_it() -> None:
    """The chart's env for the operator container and `network_policy.Settings.from_env` agree: the
    peer that admits the operator selects the Deployment's own pods, in its namespace."""
    from rlhf_operator.network_policy import Settings

    docs = [d for d in yaml.safe_load_all(render_chart("default-values.yaml")) if d]
    (deploy,) = [d for d in docs if d["kind"] == "Deployment"]
    env = {}
    for e in deploy["spec"]["template"]["spec"]["containers"][0]["env"]:
        if "value" in e:
            env[e["name"]] = e["value"]
        elif e.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") == "metadata.namespace":
            env[e["name"]] = deploy["metadata"]["namespace"]  # what the downward API gives
    settings = Settings.from_env(env)
    assert settings.enabled
    assert settings.operator_namespace == deploy["metadata"]["namespace"]
    pod_labels = deploy["spec"]["template"]["metadata"]["labels"]
    assert settings.operator_pod_labels and settings.operator_pod_labels.items() <= pod_labels.items()
    assert settings.monitoring_namespaces == ("monitoring",)
    # The operator may create (and, to check ownership, get) the policies it makes.
    (role,) = [d for d in docs if d["kind"] == "ClusterRole" and d["metadata"]["name"] == "rlhf-operator"]
    assert {
        "apiGroups": ["networking.k8s.io"],
        "resources": ["networkpolicies"],
        "verbs": ["get", "create"],
    } in role["rules"]
