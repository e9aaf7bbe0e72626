"""Acceptance tests of the control-plane harness: real API server, scheduler, controller-manager and
kwok, with the fake GPU pools of pools.yaml. Times are printed by the fixture and measured by
benchmarks/cluster_nodes.py, never asserted here."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import kubernetes
import pytest
from harness import (
    COMPLETE_ANNOTATION,
    GPU_RESOURCE,
    HERE,
    POOL_LABEL,
    Cluster,
    NodePool,
    load_pools,
    node_manifest,
    pinned_versions,
    start_lock,
    use_existing_cluster,
    wait_for,
)
from kubernetes.client import ApiException

GPU_TOLERATION = {"key": GPU_RESOURCE, "operator": "Exists", "effect": "NoSchedule"}


def gpu_pod(name: str, gpus: int, pool: str = "h100", **meta) -> dict:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, **meta},
        "spec": {
            "nodeSelector": {POOL_LABEL: pool},
            "tolerations": [GPU_TOLERATION],
            "containers": [
                {"name": "main", "image": "trainer:test", "resources": {"limits": {GPU_RESOURCE: str(gpus)}}}
            ],
        },
    }


def cpu_pod(name: str, labels: dict[str, str] | None = None) -> dict:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": labels or {}},
        "spec": {
            "nodeSelector": {POOL_LABEL: "cpu"},
            "containers": [{"name": "main", "image": "server:test", "ports": [{"containerPort": 8000}]}],
        },
    }


def core(cluster: Cluster) -> kubernetes.client.CoreV1Api:
    return kubernetes.client.CoreV1Api(cluster.admin())


# ---- without a cluster -------------------------------------------------------------------------


def test_pools_yaml_describes_the_gpu_pools():
    pools = {p.name: p for p in load_pools()}
    assert set(pools) >= {"h100", "l4", "cpu"}
    h100 = pools["h100"]
    assert (h100.nodes, h100.gpus) == (4, 8)
    assert {"key": GPU_RESOURCE, "value": "present", "effect": "NoSchedule"} in h100.taints
    assert pools["cpu"].gpus == 0


def test_node_manifest_is_a_kwok_node_with_gpu_capacity():
    pool = NodePool(
        name="h100", nodes=1, gpus=8, cpu="8", memory="64Gi", taints=[{"key": "k", "effect": "NoSchedule"}]
    )
    node = node_manifest(pool, "h100-0")
    assert node["metadata"]["annotations"]["kwok.x-k8s.io/node"] == "fake"
    assert node["metadata"]["labels"][POOL_LABEL] == "h100"
    assert node["status"]["capacity"] == {"cpu": "8", "memory": "64Gi", "pods": "110", GPU_RESOURCE: "8"}
    assert node["status"]["allocatable"] == node["status"]["capacity"]
    assert node["spec"]["taints"] == [{"key": "k", "effect": "NoSchedule"}]
    assert GPU_RESOURCE not in node_manifest(NodePool(name="cpu", nodes=1), "cpu-0")["status"]["capacity"]


def test_pool_validation_names_the_offending_value(tmp_path: Path):
    with pytest.raises(ValueError, match="H100"):
        NodePool(name="H100", nodes=1)
    bad = tmp_path / "pools.yaml"
    bad.write_text("pools:\n  a:\n    nodes: 1\n    gpu: 8\n")
    with pytest.raises(ValueError, match=r"unknown keys \['gpu'\]"):
        load_pools(bad)


def test_versions_are_pinned_in_the_build_script():
    versions = pinned_versions()
    assert set(versions) == {"kubernetes", "etcd", "kwok", "helm"}
    assert all(v.startswith("v") for v in versions.values())


# ---- on the cluster ----------------------------------------------------------------------------


@pytest.mark.cluster
def test_gpu_pools_are_ready_with_capacity(cluster: Cluster):
    expected = {p.name: p for p in load_pools()}
    nodes = cluster.nodes(f"{POOL_LABEL} in ({','.join(expected)})")
    by_pool: dict[str, list[dict]] = {}
    for node in nodes:
        by_pool.setdefault(node["metadata"]["labels"][POOL_LABEL], []).append(node)
    for name, pool in expected.items():
        assert len(by_pool.get(name, [])) == pool.nodes, name
        for node in by_pool[name]:
            ready = {c["type"]: c["status"] for c in node["status"]["conditions"]}["Ready"]
            assert ready == "True", node["metadata"]["name"]
            assert node["status"]["allocatable"].get(GPU_RESOURCE, "0") == str(pool.gpus)
            taints = [
                {k: t[k] for k in ("key", "value", "effect") if k in t}
                for t in node["spec"].get("taints", [])
            ]
            for taint in pool.taints:
                assert taint in taints
    version = cluster.request("GET", "/version")
    if not use_existing_cluster():
        assert version["gitVersion"] == pinned_versions()["kubernetes"]


@pytest.mark.cluster
def test_scheduler_binds_an_8_gpu_pod_to_the_pool_and_kwok_runs_it(cluster: Cluster, namespace: str):
    core(cluster).create_namespaced_pod(namespace, gpu_pod("trainer", gpus=8))
    pod = cluster.wait_pod_phase("trainer", namespace, "Running")
    node = core(cluster).read_node(pod.spec.node_name)
    assert node.metadata.labels[POOL_LABEL] == "h100"
    assert {c.type: c.status for c in pod.status.conditions}["PodScheduled"] == "True"
    assert pod.status.container_statuses[0].state.running is not None
    assert pod.status.pod_ip


@pytest.mark.cluster
def test_a_9_gpu_pod_stays_pending_with_failed_scheduling(cluster: Cluster, namespace: str):
    core(cluster).create_namespaced_pod(namespace, gpu_pod("too-big", gpus=9))

    def failed_scheduling():
        events = core(cluster).list_namespaced_event(
            namespace, field_selector="involvedObject.name=too-big,reason=FailedScheduling"
        )
        return events.items

    events = wait_for(failed_scheduling, timeout=60, what="a FailedScheduling event")
    assert "nvidia.com/gpu" in events[0].message
    pod = core(cluster).read_namespaced_pod("too-big", namespace)
    assert pod.status.phase == "Pending"
    assert pod.spec.node_name is None


@pytest.mark.cluster
def test_garbage_collector_deletes_dependents(cluster: Cluster, namespace: str):
    owner = core(cluster).create_namespaced_config_map(namespace, {"metadata": {"name": "owner"}})
    ref = {"apiVersion": "v1", "kind": "ConfigMap", "name": "owner", "uid": owner.metadata.uid}
    core(cluster).create_namespaced_config_map(
        namespace, {"metadata": {"name": "dependent", "ownerReferences": [ref]}}
    )
    pod = cpu_pod("dependent-pod")
    pod["metadata"]["ownerReferences"] = [ref]
    core(cluster).create_namespaced_pod(namespace, pod)
    cluster.wait_pod_phase("dependent-pod", namespace, "Running")

    core(cluster).delete_namespaced_config_map("owner", namespace, propagation_policy="Background")

    def gone() -> bool:
        names = {c.metadata.name for c in core(cluster).list_namespaced_config_map(namespace).items}
        pods = core(cluster).list_namespaced_pod(namespace).items
        return "dependent" not in names and not pods

    wait_for(gone, timeout=60, what="the garbage collector to delete the dependents")


@pytest.mark.cluster
def test_a_service_gets_endpoint_slices(cluster: Cluster, namespace: str):
    for i in range(2):
        core(cluster).create_namespaced_pod(namespace, cpu_pod(f"server-{i}", labels={"app": "server"}))
    core(cluster).create_namespaced_service(
        namespace,
        {
            "metadata": {"name": "server"},
            "spec": {"selector": {"app": "server"}, "ports": [{"port": 80, "targetPort": 8000}]},
        },
    )
    ips = {cluster.wait_pod_phase(f"server-{i}", namespace, "Running").status.pod_ip for i in range(2)}
    discovery = kubernetes.client.DiscoveryV1Api(cluster.admin())

    def slice_addresses():
        slices = discovery.list_namespaced_endpoint_slice(
            namespace, label_selector="kubernetes.io/service-name=server"
        ).items
        ready = {
            address
            for s in slices
            for e in s.endpoints or []
            if e.conditions and e.conditions.ready
            for address in e.addresses
        }
        return ready if ready == ips else None

    wait_for(slice_addresses, timeout=60, what=f"EndpointSlices of service server with {sorted(ips)}")


@pytest.mark.cluster
def test_annotation_finishes_pods_succeeded_or_failed(cluster: Cluster, namespace: str):
    for name in ("ok", "boom"):
        core(cluster).create_namespaced_pod(namespace, gpu_pod(name, gpus=1, pool="l4"))
    for name in ("ok", "boom"):
        cluster.wait_pod_phase(name, namespace, "Running")

    cluster.complete_pod("ok", namespace)
    cluster.complete_pod("boom", namespace, outcome="failed", exit_code=137)

    ok = cluster.wait_pod_phase("ok", namespace, "Succeeded")
    boom = cluster.wait_pod_phase("boom", namespace, "Failed")
    assert ok.metadata.annotations[COMPLETE_ANNOTATION] == "succeeded"
    assert ok.status.container_statuses[0].state.terminated.exit_code == 0
    assert boom.status.container_statuses[0].state.terminated.exit_code == 137


@pytest.mark.cluster
def test_a_service_account_gets_only_what_rbac_grants(cluster: Cluster, namespace: str):
    sa = cluster.as_service_account(namespace, "operator", create=True)
    as_sa = kubernetes.client.CoreV1Api(sa.api_client())
    with pytest.raises(ApiException) as denied:
        as_sa.list_namespaced_pod(namespace)
    assert denied.value.status == 403
    assert "system:serviceaccount:" + namespace + ":operator" in denied.value.body

    rbac = kubernetes.client.RbacAuthorizationV1Api(cluster.admin())
    rbac.create_namespaced_role(
        namespace,
        {
            "metadata": {"name": "pod-reader"},
            "rules": [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list"]}],
        },
    )
    rbac.create_namespaced_role_binding(
        namespace,
        {
            "metadata": {"name": "operator-reads-pods"},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "pod-reader"},
            "subjects": [{"kind": "ServiceAccount", "name": "operator", "namespace": namespace}],
        },
    )
    wait_for(lambda: as_sa.list_namespaced_pod(namespace) is not None, timeout=30, what="the Role to apply")
    with pytest.raises(ApiException) as still_denied:
        as_sa.delete_collection_namespaced_pod(namespace)
    assert still_denied.value.status == 403
    assert sa.kubectl("auth", "can-i", "list", "secrets", "-n", namespace, check=False).strip() == "no"
    assert sa.kubectl("auth", "can-i", "list", "pods", "-n", namespace).strip() == "yes"


@pytest.mark.cluster
def test_node_not_ready_is_tainted_and_node_loss_deletes_the_node(cluster: Cluster):
    names = cluster.create_pool(
        "flaky", nodes=2, gpus=8, taints=[{"key": GPU_RESOURCE, "value": "present", "effect": "NoSchedule"}]
    )
    try:
        cluster.set_node_not_ready(names[0])

        def tainted() -> bool:
            taints = core(cluster).read_node(names[0]).spec.taints or []
            return any(t.key == "node.kubernetes.io/not-ready" and t.effect == "NoExecute" for t in taints)

        wait_for(tainted, timeout=60, what="the node lifecycle controller to taint the NotReady node")
        cluster.set_node_ready(names[0])
        cluster.delete_node(names[1])
        wait_for(
            lambda: names[1] not in {n["metadata"]["name"] for n in cluster.nodes(f"{POOL_LABEL}=flaky")},
            timeout=30,
            what=f"node {names[1]} to be gone",
        )
    finally:
        for name in names:
            try:
                cluster.delete_node(name)
            except ApiException as exc:
                if exc.status != 404:
                    raise


# ---- teardown ----------------------------------------------------------------------------------


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][0] != "Z"
    except OSError:
        return False


@pytest.mark.cluster
@pytest.mark.skipif(use_existing_cluster(), reason="starts clusters of its own")
def test_stop_leaves_no_process_port_or_directory():
    started = Cluster.start(pools=None)
    pids, ports, workdir = started.pids(), started.ports(), started.workdir
    assert len(pids) >= 5 and all(_alive(p) for p in pids)
    assert ports and not any(_port_free(p) for p in ports.values())
    # Holding the start lock keeps other test runs on this machine from starting a cluster on the
    # ports just freed before they are checked.
    with start_lock():
        started.stop()
        assert not [p for p in pids if _alive(p)]
        assert workdir is not None and not workdir.exists()
        assert all(_port_free(p) for p in ports.values())


@pytest.mark.cluster
@pytest.mark.skipif(use_existing_cluster(), reason="starts clusters of its own")
def test_a_killed_test_run_leaves_nothing_behind():
    script = textwrap.dedent(
        f"""
        import json, sys, time
        sys.path.insert(0, {str(HERE)!r})
        from harness import Cluster
        c = Cluster.start(pools=None)
        print(json.dumps({{"pids": c.pids(), "ports": c.ports(), "workdir": str(c.workdir),
                           "watchdog": c._watchdog.pid}}), flush=True)
        time.sleep(600)
        """
    )
    child = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None
        state = json.loads(child.stdout.readline())
    finally:
        os.kill(child.pid, signal.SIGKILL)  # no atexit, no signal handler: only the watchdog is left
        child.wait()
    with start_lock():
        wait_for(
            lambda: not _alive(state["watchdog"]) and not Path(state["workdir"]).exists(),
            timeout=90,
            what="the watchdog to tear the cluster down",
        )
        assert not [p for p in state["pids"] if _alive(p)]
        assert all(_port_free(p) for p in state["ports"].values())


@pytest.mark.cluster
@pytest.mark.skipif(use_existing_cluster(), reason="starts a cluster of its own")
def test_a_starved_control_plane_keeps_its_scheduler_and_controller_manager():
    """etcd stopped for longer than a leader lease's 10 s renew deadline (a loaded machine): with
    leader election on, kube-scheduler and kube-controller-manager exit ("leaderelection lost")
    and no new pod is scheduled again; the harness runs them without it, so a pod created after
    the stall is still bound and run."""
    started = Cluster.start()
    try:
        pids = {p.stem: int(p.read_text()) for p in (started.cluster_dir() / "pids").glob("*.pid")}
        os.kill(pids["etcd"], signal.SIGSTOP)
        try:
            time.sleep(20)
        finally:
            os.kill(pids["etcd"], signal.SIGCONT)
        api = core(started)
        wait_for(
            lambda: api.list_namespaced_service_account("default").items, timeout=60, what="the API back"
        )
        time.sleep(5)  # a lost lease ends the process a few seconds after the renewal failed
        # Not wait_ready: it would start an exited component again.
        assert _alive(pids["kube-scheduler"]) and _alive(pids["kube-controller-manager"])
        api.create_namespaced_pod("default", gpu_pod("after-the-stall", gpus=1))
        started.wait_pod_phase("after-the-stall", "default", "Running", timeout=60)
    finally:
        started.stop()
