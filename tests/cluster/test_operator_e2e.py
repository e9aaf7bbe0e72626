"""The operator on the real control plane, under the chart's RBAC (its ServiceAccount, not admin).

Each test gets a fresh namespace and its own `rlhf operator` process watching only that namespace.
Pods are faked by kwok: the scheduler, garbage collector, pod GC and RBAC are real.
"""

from __future__ import annotations

import copy
import json
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import pytest
import yaml
from harness import Cluster, assets_dir, helm_capabilities, wait_for

from rlhf_operator.testing import OperatorProcess

pytestmark = pytest.mark.cluster

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "rlhf-operator"
OPERATOR_NS = "rlhf-system"
OPERATOR_SA = "rlhf-operator"
GROUP, VERSION, PLURAL = "rlhf.dev", "v1alpha1", "rltrainingjobs"


#: The chart's CRDs (templates of the chart, see templates/crds.yaml).
CHART_CRDS = CHART / "files" / "crds"


def render_chart(*values: str, namespace: str = OPERATOR_NS, include_crds: bool = True) -> str:
    import subprocess

    cmd = [str(assets_dir() / "helm"), "template", "rlhf-operator", str(CHART), "--namespace", namespace]
    # Rendered for the harness's own API server (the status-writers policy needs 1.30 or later).
    cmd += helm_capabilities()
    if not include_crds:
        cmd += ["--set", "crds.install=false"]
    for v in values:
        cmd += ["-f", str(CHART / "ci" / v)]
    return subprocess.run(cmd, capture_output=True, text=True, check=True).stdout


@pytest.fixture(scope="session")
def installed(cluster: Cluster) -> Any:
    """The chart's CRD, ServiceAccount and RBAC (no Deployment: the tests run the operator process)."""
    cluster.kubectl("create", "namespace", OPERATOR_NS, check=False)
    # CRDs first, established before what uses them.
    cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(CHART_CRDS))
    jsonpath = '{.status.conditions[?(@.type=="Established")].status}'
    for name in (f"{PLURAL}.{GROUP}", "clusterkopfpeerings.kopf.dev", "kopfpeerings.kopf.dev"):
        wait_for(
            lambda n=name: cluster.kubectl("get", "crd", n, "-o", f"jsonpath={jsonpath}") == "True",
            timeout=60,
            what=f"CRD {name} established",
        )
    rendered = render_chart("test-values.yaml", include_crds=False)
    cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", "-", input=rendered)
    return cluster.as_service_account(OPERATOR_NS, OPERATOR_SA)


@pytest.fixture
def operator(installed: Any, namespace: str, tmp_path: Path) -> Iterator[OperatorProcess]:
    proc = OperatorProcess(
        installed.kubeconfig, [namespace], log_path=tmp_path / "operator.log", metrics=True
    )
    proc.start()
    try:
        yield proc
    finally:
        proc.stop()
        print(proc.log_tail(3000))


def grpo_job(name: str, **spec_updates: Any) -> dict[str, Any]:
    """A GRPO job across two pools: actors on h100, rollout engines on l4, reward on CPU nodes."""
    doc = yaml.safe_load((ROOT / "manifests" / "examples" / "grpo-h100.yaml").read_text())
    doc["metadata"] = {"name": name}
    doc["spec"].update(copy.deepcopy(spec_updates))
    return doc  # type: ignore[no-any-return]


class Api:
    def __init__(self, cluster: Cluster, namespace: str) -> None:
        import kubernetes

        self.ns = namespace
        self.cluster = cluster
        self.core = kubernetes.client.CoreV1Api(cluster.admin())
        self.custom = kubernetes.client.CustomObjectsApi(cluster.admin())

    def apply(self, doc: dict[str, Any]) -> dict[str, Any]:
        return cast(
            dict[str, Any], self.custom.create_namespaced_custom_object(GROUP, VERSION, self.ns, PLURAL, doc)
        )

    def job(self, name: str) -> dict[str, Any]:
        return cast(
            dict[str, Any], self.custom.get_namespaced_custom_object(GROUP, VERSION, self.ns, PLURAL, name)
        )

    def status(self, name: str) -> dict[str, Any]:
        return self.job(name).get("status") or {}

    def pods(self, name: str) -> list[Any]:
        return list(self.core.list_namespaced_pod(self.ns, label_selector=f"rlhf.dev/job-name={name}").items)

    def wait_phase(self, name: str, phase: str, timeout: float = 90) -> dict[str, Any]:
        from harness import ClusterError

        try:
            return wait_for(  # type: ignore[no-any-return]
                lambda: (s := self.status(name)).get("phase") == phase and s,
                timeout=timeout,
                what=f"job {self.ns}/{name} to be {phase}",
            )
        except ClusterError as err:
            raise ClusterError(f"{err}; status now: {self._safe_status(name)}") from err

    def _safe_status(self, name: str) -> str:
        try:
            return json.dumps(self.status(name))[:600]
        except Exception as err:  # only for the message
            return repr(err)


def metric(op: OperatorProcess, name: str) -> float:
    """The value of one sample of the operator's /metrics, e.g. `rlhf_operator_jobs{phase="Running"}`;
    NaN when the series is absent, so no comparison passes on a renamed metric."""
    import urllib.request

    text = urllib.request.urlopen(f"http://127.0.0.1:{op.metrics_port}/metrics", timeout=5).read().decode()
    return next(
        (float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + " ")),
        float("nan"),
    )


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:5]}"


# ---------------------------------------------------------------------------------------------


def test_grpo_job_over_two_pools_end_to_end(
    cluster: Cluster, namespace: str, operator: OperatorProcess
) -> None:
    api = Api(cluster, namespace)
    name = "grpo"
    api.apply(grpo_job(name, ttlSecondsAfterFinished=3))
    api.wait_phase(name, "Running")
    job = api.job(name)
    uid = job["metadata"]["uid"]

    # Every child exists once, owned by the job.
    pods = {p.metadata.name: p for p in api.pods(name)}
    assert sorted(pods) == [
        "grpo-actor-0",
        "grpo-actor-1",
        "grpo-controller",
        "grpo-reference-0",
        "grpo-reward-0",
        "grpo-rollout-0",
        "grpo-rollout-1",
    ]
    for kind, obj_name in [
        ("serviceaccount", f"{name}-{uid[:12]}"),
        ("role", f"{name}-{uid[:12]}"),
        ("rolebinding", f"{name}-{uid[:12]}"),
        ("secret", f"{name}-ray-token-{uid}"),
        ("configmap", f"{name}-spec"),
        ("service", name),
    ]:
        obj = json.loads(cluster.kubectl("get", kind, obj_name, "-n", namespace, "-o", "json"))
        assert obj["metadata"]["ownerReferences"][0]["uid"] == uid, kind
    for p in pods.values():
        assert p.metadata.owner_references[0].uid == uid

    # The real scheduler placed each role on its pool.
    nodes = {p.metadata.name: p.spec.node_name for p in pods.values()}
    assert all(nodes[f"grpo-actor-{i}"].startswith("h100-") for i in range(2)), nodes
    assert all(nodes[f"grpo-rollout-{i}"].startswith("l4-") for i in range(2)), nodes
    assert nodes["grpo-reward-0"].startswith("cpu-") and nodes["grpo-controller"].startswith("cpu-"), nodes
    actor = pods["grpo-actor-0"]
    assert actor.spec.containers[0].resources.limits["nvidia.com/gpu"] == "8"
    assert {v.name: v.empty_dir.medium for v in actor.spec.volumes if v.empty_dir}["dshm"] == "Memory"

    wait_for(
        lambda: metric(operator, 'rlhf_operator_jobs{phase="Running"}') == 1.0, timeout=30, what="jobs metric"
    )
    assert metric(operator, "rlhf_operator_pods_created_total") == 7
    assert metric(operator, 'rlhf_operator_reconciles_total{result="ok"}') >= 2
    status = api.status(name)
    assert (
        status["rollout"]["ready"] == 2
        and status["rollout"]["selector"] == "rlhf.dev/job-name=grpo,rlhf.dev/role=rollout"
    )
    assert status["startTime"]

    # The controller pod writes progress with the job's own ServiceAccount: allowed for this job's
    # status, nothing else.
    controller = cluster.as_service_account(namespace, f"{name}-{uid[:12]}")
    # The exact patch the trainer's status reporter sends (progress.metrics.reward_mean, a string).
    from rlhf_trainer.run_cli import StatusReporter

    progress = StatusReporter(None, name, namespace).progress(3, 20, {"reward/mean": 0.75})
    controller.kubectl(
        "patch",
        "rltj",
        name,
        "-n",
        namespace,
        "--subresource=status",
        "--type=merge",
        "-p",
        json.dumps(progress),
    )

    def can(*args: str) -> str:
        return controller.kubectl("auth", "can-i", *args, "-n", namespace, check=False).strip()

    assert can("patch", f"rltrainingjobs/{name}", "--subresource=status") == "yes"
    assert can("patch", f"rltrainingjobs/{name}") == "no"  # not its spec
    assert can("patch", "rltrainingjobs/other", "--subresource=status") == "no"  # not another job
    assert can("list", "pods") == "no"
    wait_for(
        lambda: api.status(name).get("summary", {}).get("step") == "3/20",
        timeout=30,
        what="summary step 3/20",
    )
    table = cluster.kubectl("get", "rltj", name, "-n", namespace)
    header, row = table.strip().splitlines()
    assert header.split() == ["NAME", "PHASE", "STEP", "REWARD", "ROLLOUT", "RESTARTS", "AGE"]
    assert row.split()[:6] == ["grpo", "Running", "3/20", "0.75", "2/2", "0"]

    # kubectl scale works through the /scale subresource.
    cluster.kubectl("scale", "rltj", name, "-n", namespace, "--replicas=3")
    wait_for(
        lambda: len([p for p in api.pods(name) if "rollout" in p.metadata.name]) == 3,
        timeout=30,
        what="3 rollout pods",
    )
    wait_for(lambda: api.status(name)["rollout"]["generation"] == 2, timeout=30, what="rollout generation 2")

    # Scale down: leaving replicas are kept until the controller pod reports that it drained them
    # and rebuilt its weight-sync group (status.rollout.syncedGeneration), then deleted.
    cluster.kubectl("scale", "rltj", name, "-n", namespace, "--replicas=1")
    wait_for(lambda: api.status(name)["rollout"]["generation"] == 3, timeout=30, what="rollout generation 3")
    rollout_pods = sorted(p.metadata.name for p in api.pods(name) if "rollout" in p.metadata.name)
    assert rollout_pods == ["grpo-rollout-0", "grpo-rollout-1", "grpo-rollout-2"]  # draining, not deleted
    synced = {"status": {"rollout": {"syncedGeneration": 3}}}
    controller.kubectl(
        "patch",
        "rltj",
        name,
        "-n",
        namespace,
        "--subresource=status",
        "--type=merge",
        "-p",
        json.dumps(synced),
    )
    wait_for(
        lambda: (
            sorted(p.metadata.name for p in api.pods(name) if "rollout" in p.metadata.name)
            == ["grpo-rollout-0"]
        ),
        timeout=30,
        what="leaving rollout pods deleted after the sync",
    )
    assert api.status(name)["rollout"]["generation"] == 3

    # The controller pod finishing makes the job Succeeded; the TTL then deletes it and the
    # garbage collector its children.
    cluster.complete_pod("grpo-controller", namespace, outcome="succeeded")
    status = api.wait_phase(name, "Succeeded")
    assert status["completionTime"]

    def reasons() -> set[str]:
        events = cluster.kubectl(
            "get", "events", "-n", namespace, f"--field-selector=involvedObject.name={name}", "-o", "json"
        )
        return {e["reason"] for e in json.loads(events)["items"]}

    # Events are posted right after the status write they describe.
    wait_for(lambda: {"PodsCreated", "Running", "Succeeded"} <= reasons(), timeout=30, what="Events")

    import kubernetes

    def job_gone() -> bool:
        try:
            api.job(name)
        except kubernetes.client.ApiException as err:
            return err.status == 404
        return False

    wait_for(job_gone, timeout=60, what="TTL deletion of the job")
    wait_for(lambda: api.pods(name) == [], timeout=60, what="garbage collection of the pods")


def test_node_loss_under_an_actor_restarts_the_gang_once(
    cluster: Cluster, namespace: str, operator: OperatorProcess
) -> None:
    api = Api(cluster, namespace)
    name = "lose"
    api.apply(grpo_job(name, failurePolicy={"maxRestarts": 3, "backoffSeconds": 1}))
    api.wait_phase(name, "Running")
    before = {p.metadata.name: p.metadata.uid for p in api.pods(name)}
    node = next(p.spec.node_name for p in api.pods(name) if p.metadata.name == f"{name}-actor-0")
    cluster.delete_node(node)
    try:
        wait_for(lambda: api.status(name).get("restarts") == 1, timeout=150, what="restarts == 1")
        status = api.wait_phase(name, "Running", timeout=120)
        assert status["restarts"] == 1
        pods = api.pods(name)
        assert sorted(p.metadata.name for p in pods) == sorted(before)  # same stable names
        assert all(p.metadata.labels["rlhf.dev/restart-attempt"] == "1" for p in pods)
        assert all(before[p.metadata.name] != p.metadata.uid for p in pods)  # every pod recreated
        assert all(p.spec.node_name != node for p in pods)
        assert metric(operator, "rlhf_operator_gang_restarts_total") == 1
    finally:
        cluster.create_pools([p for p in _pools() if p.name == "h100"])  # recreate the lost node (idempotent)


def _pools() -> list[Any]:
    from harness import load_pools

    return load_pools()


def test_max_restarts_exhausted_fails_the_job(
    cluster: Cluster, namespace: str, operator: OperatorProcess
) -> None:
    api = Api(cluster, namespace)
    name = "crash"
    api.apply(grpo_job(name, failurePolicy={"maxRestarts": 1, "backoffSeconds": 0}))
    api.wait_phase(name, "Running")
    cluster.complete_pod(f"{name}-actor-1", namespace, outcome="failed", exit_code=3)
    wait_for(lambda: api.status(name).get("restarts") == 1, timeout=60, what="first restart")
    api.wait_phase(name, "Running")
    cluster.complete_pod(f"{name}-actor-1", namespace, outcome="failed", exit_code=3)
    status = api.wait_phase(name, "Failed")
    failed = next(c for c in status["conditions"] if c["type"] == "Failed")
    assert failed["reason"] == "MaxRestartsExceeded"
    assert f"{name}-actor-1 failed" in failed["message"] and "maxRestarts (1) exhausted" in failed["message"]
    assert status["restarts"] == 1
    # The operator's own record of it (restart_record), written on the job beside the status.
    notes = api.job(name)["metadata"]["annotations"]
    assert notes["rlhf.dev/restarts"] == "1" and notes["rlhf.dev/counted-restarts"] == "1"
    # Running pods are removed; the failed one is kept for its logs.
    wait_for(
        lambda: sorted(p.metadata.name for p in api.pods(name)) == [f"{name}-actor-1"],
        timeout=60,
        what="only the failed pod left",
    )


def test_killed_rollout_pod_is_replaced_alone(
    cluster: Cluster, namespace: str, operator: OperatorProcess
) -> None:
    api = Api(cluster, namespace)
    name = "roll"
    api.apply(grpo_job(name))
    api.wait_phase(name, "Running")
    before = {p.metadata.name: p.metadata.uid for p in api.pods(name)}
    generation = api.status(name)["rollout"]["generation"]
    cluster.kubectl("delete", "pod", f"{name}-rollout-1", "-n", namespace, "--wait=false")

    def replaced() -> bool:
        now = {p.metadata.name: p.metadata.uid for p in api.pods(name) if p.status.phase == "Running"}
        return set(now) == set(before) and now[f"{name}-rollout-1"] != before[f"{name}-rollout-1"]

    wait_for(replaced, timeout=60, what="rollout-1 replaced")
    after = {p.metadata.name: p.metadata.uid for p in api.pods(name)}
    assert {n for n in before if before[n] != after[n]} == {f"{name}-rollout-1"}
    status = api.status(name)
    assert status["restarts"] == 0 and status["phase"] == "Running"
    assert status["rollout"]["generation"] == generation + 1


def test_sigkilled_operator_converges_without_duplicates_or_orphans(
    cluster: Cluster, installed: Any, namespace: str, tmp_path: Path
) -> None:
    api = Api(cluster, namespace)
    name = "kill"
    log = tmp_path / "operator.log"
    first = OperatorProcess(
        installed.kubeconfig, [namespace], log_path=log, env={"RLHF_OPERATOR_PAUSE_AFTER_CREATES": "3"}
    )
    first.start()
    try:
        api.apply(grpo_job(name))
        wait_for(lambda: len(api.pods(name)) == 3, timeout=60, what="3 of 7 pods created before the kill")
        first.kill()
    finally:
        first.stop()
    assert len(api.pods(name)) == 3
    with OperatorProcess(installed.kubeconfig, [namespace], log_path=log):
        api.wait_phase(name, "Running")
        uid = api.job(name)["metadata"]["uid"]
        pods = api.pods(name)
        assert sorted(p.metadata.name for p in pods) == sorted(
            [
                f"{name}-{r}"
                for r in (
                    "actor-0",
                    "actor-1",
                    "controller",
                    "reference-0",
                    "reward-0",
                    "rollout-0",
                    "rollout-1",
                )
            ]
        )
        assert all(p.metadata.owner_references[0].uid == uid for p in pods)
        assert {p.metadata.labels["rlhf.dev/restart-attempt"] for p in pods} == {"0"}
        assert api.status(name)["restarts"] == 0
        for kind in ("serviceaccounts", "roles", "rolebindings", "secrets", "configmaps", "services"):
            items = json.loads(
                cluster.kubectl("get", kind, "-n", namespace, "-l", f"rlhf.dev/job-name={name}", "-o", "json")
            )["items"]
            assert len(items) == 1, (kind, [i["metadata"]["name"] for i in items])
            assert items[0]["metadata"]["ownerReferences"][0]["uid"] == uid


def test_suspend_removes_pods_and_resume_recreates_them(
    cluster: Cluster, namespace: str, operator: OperatorProcess
) -> None:
    api = Api(cluster, namespace)
    name = "pause"
    api.apply(grpo_job(name))
    api.wait_phase(name, "Running")
    cluster.kubectl("patch", "rltj", name, "-n", namespace, "--type=merge", "-p", '{"spec":{"suspend":true}}')
    api.wait_phase(name, "Suspended")
    wait_for(lambda: api.pods(name) == [], timeout=60, what="pods removed")
    cluster.kubectl(
        "patch", "rltj", name, "-n", namespace, "--type=merge", "-p", '{"spec":{"suspend":false}}'
    )
    status = api.wait_phase(name, "Running")
    assert status["restarts"] == 0 and len(api.pods(name)) == 7


@pytest.mark.parametrize("on_timeout,phase", [("wait", "Scheduling"), ("fail", "Failed")])
def test_unschedulable_gang_reports_the_scheduler_reason(
    cluster: Cluster, namespace: str, operator: OperatorProcess, on_timeout: str, phase: str
) -> None:
    api = Api(cluster, namespace)
    name = "huge"
    roles = grpo_job(name)["spec"]["roles"]
    roles["actor"]["replicas"] = 9  # 9 x 8 GPUs > 4 h100 nodes
    api.apply(grpo_job(name, roles=roles, scheduling={"timeoutSeconds": 2, "onTimeout": on_timeout}))

    def reported() -> dict[str, Any] | None:
        st = api.status(name)
        return next(
            (c for c in st.get("conditions", []) if c["type"] == "Unschedulable" and c["status"] == "True"),
            None,
        )

    cond = wait_for(reported, timeout=60, what="Unschedulable condition")
    assert "Insufficient nvidia.com/gpu" in cond["message"], cond
    status = api.wait_phase(name, phase)
    if on_timeout == "fail":
        failed = next(c for c in status["conditions"] if c["type"] == "Failed")
        assert failed["reason"] == "Unschedulable"
        wait_for(lambda: api.pods(name) == [], timeout=60, what="pods of the failed gang removed")


def test_two_replicas_with_peering_one_active_then_failover(
    cluster: Cluster, installed: Any, namespace: str, tmp_path: Path
) -> None:
    api = Api(cluster, namespace)
    peering = {"apiVersion": "kopf.dev/v1", "kind": "KopfPeering", "metadata": {"name": "rlhf-operator"}}
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=yaml.safe_dump(peering))
    env = {"RLHF_OPERATOR_PEERING_LIFETIME": "20"}  # generous: keep-alives lag on a loaded machine

    def replica(priority: int) -> OperatorProcess:
        return OperatorProcess(
            installed.kubeconfig,
            [namespace],
            log_path=tmp_path / f"operator-{priority}.log",
            env={**env, "RLHF_OPERATOR_PRIORITY": str(priority)},
            peering="rlhf-operator",
        )

    high, low = replica(20), replica(10)
    high.start()
    try:
        wait_for(
            lambda: "Resuming operations" in high.log_tail(10**6), timeout=60, what="first replica active"
        )
        low.start()  # starts paused (peering is mandatory) and stays so while `high` is alive
        api.apply(grpo_job("peer"))
        api.wait_phase("peer", "Running")
        assert f"{namespace}/peer: PodsCreated" in high.log_tail(10**6)
        assert f"{namespace}/peer:" not in low.log_tail(10**6)  # the standby did nothing
        high.kill()  # its peering record expires after its lifetime; the standby resumes
        cluster.kubectl("scale", "rltj", "peer", "-n", namespace, "--replicas=3")
        wait_for(
            lambda: len([p for p in api.pods("peer") if "rollout" in p.metadata.name]) == 3,
            timeout=120,
            what="3 rollout pods created by the new active operator",
        )
        # The pods are visible before the pass that created them logs its Event line: wait for it.
        wait_for(
            lambda: f"{namespace}/peer: RolloutMembershipChanged" in low.log_tail(10**6),
            timeout=30,
            what="the standby's RolloutMembershipChanged, logged by the pass that created the pods",
        )
    finally:
        high.stop()
        low.stop()


def test_ppo_example_across_two_pools(cluster: Cluster, namespace: str, operator: OperatorProcess) -> None:
    api = Api(cluster, namespace)
    doc = yaml.safe_load((ROOT / "manifests" / "examples" / "ppo-two-pools.yaml").read_text())
    api.apply(doc)
    name = doc["metadata"]["name"]
    api.wait_phase(name, "Running")
    nodes = {p.metadata.labels["rlhf.dev/role"]: p.spec.node_name for p in api.pods(name)}
    assert nodes["actor"].startswith("h100-") and nodes["critic"].startswith("h100-"), nodes
    assert all(nodes[r].startswith("l4-") for r in ("reference", "reward", "rollout")), nodes


def test_under_the_charts_rbac_the_operator_finds_its_own_crd_installed(installed: Any) -> None:
    """What `parse_cache.InstalledRules` reads: the installed CRD's schema digest, with the chart's RBAC
    (a metadata-only LIST narrowed to the CRD's name), equal to the digest the operator expects,
    so the operator leaves the CRD's rules to the API server."""
    from rlhf_operator import crd, kube, parse_cache

    client = kube.Kube(installed.api_client())
    annotations = client.crd_annotations(crd.CRD_NAME)
    assert annotations is not None
    assert annotations[crd.SCHEMA_DIGEST_ANNOTATION] == crd.expected_schema_digest()
    assert parse_cache.InstalledRules(lambda: client.crd_annotations(crd.CRD_NAME)).enforced()
    assert client.crd_annotations("nosuch.rlhf.dev") is None
