"""Operator at scale on the real control plane: from `kubectl apply` of N jobs x 10 pods to every pod
Running, on 500 fake 8-GPU nodes (kwok), with the operator's peak memory.

    .venv/bin/python benchmarks/operator_scale.py                 # 50 jobs x 10 pods, 500 nodes
    .venv/bin/python benchmarks/operator_scale.py --jobs 10 --nodes 100

Baseline, in the same process and cluster: the same pods created directly by one client (no
operator), so the ratio shows what the operator's reconcile adds to the API server + scheduler +
kwok pipeline. The operator runs as its own process under the chart's RBAC. Timing starts only
once every node is Ready and free of the lifecycle taints a fresh node carries for its first
seconds (the controller-manager removes them), so neither run measures that warm-up.
"""

from __future__ import annotations

import argparse
import copy
import json
import subprocess
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "cluster"))

import yaml  # noqa: E402
from harness import Cluster, NodePool, assets_dir, use_existing_cluster, wait_for  # noqa: E402

from rlhf_operator.testing import OperatorProcess  # noqa: E402

GPU_TAINT = {"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}


def job_manifest(name: str) -> dict[str, Any]:
    """10 pods: controller, 4 actors + 1 reference + 3 rollout engines (8 GPUs each), 1 reward (CPU)."""
    doc = yaml.safe_load((ROOT / "manifests" / "examples" / "grpo-h100.yaml").read_text())
    doc["metadata"] = {"name": name}
    spec = doc["spec"]
    spec["nodePools"] = [
        {"name": "gpu", "nodeSelector": {"rlhf.dev/pool": "bench"}},
        {"name": "cpu", "nodeSelector": {"rlhf.dev/pool": "bench-cpu"}},
    ]
    gpu8 = {"gpus": 8, "cpu": "8", "memory": "64Gi", "shm": "1Gi"}
    spec["roles"] = {
        "placement": "disaggregated",
        "actor": {"replicas": 4, "nodePool": "gpu", "resources": gpu8},
        "reference": {"replicas": 1, "nodePool": "gpu", "resources": gpu8},
        "critic": {"replicas": 0},
        "reward": {"replicas": 1, "nodePool": "cpu", "resources": {"cpu": "1", "memory": "1Gi"}},
        "rollout": {"replicas": 3, "minReplicas": 1, "maxReplicas": 4, "nodePool": "gpu", "resources": gpu8},
    }
    spec["training"]["miniBatchSize"] = 128
    # The example mounts existing claims (models, datasets, checkpoints); none exists here, and a
    # pod naming a missing claim is never scheduled.
    spec.pop("pod", None)
    return doc  # type: ignore[no-any-return]


def running_pods(cluster: Cluster, namespace: str) -> int:
    resp = cluster.admin().call_api(
        *cluster.admin().param_serialize(
            method="GET",
            resource_path=f"/api/v1/namespaces/{namespace}/pods",
            query_params=[("fieldSelector", "status.phase=Running")],
            header_params={"Accept": "application/json"},
            auth_settings=["BearerToken"],
        )
    )
    return len(json.loads(resp.read())["items"])


#: Taints the node lifecycle controller puts on nodes that are not (yet) Ready.
LIFECYCLE_TAINTS = ("node.kubernetes.io/not-ready", "node.kubernetes.io/unreachable")


def unsettled_nodes(nodes: list[dict[str, Any]], expected: int) -> list[str]:
    """Why the nodes are not settled yet: fewer than `expected`, or some not Ready or still carrying
    a lifecycle taint (which the controller-manager removes some seconds after a fresh node turns
    Ready; pods created before that wait for it, and the timing would measure the warm-up)."""
    why = [] if len(nodes) >= expected else [f"{len(nodes)} of {expected} nodes"]
    for node in nodes:
        name = node["metadata"]["name"]
        ready = any(
            c["type"] == "Ready" and c["status"] == "True"
            for c in node.get("status", {}).get("conditions", [])
        )
        taints = [t["key"] for t in node.get("spec", {}).get("taints") or [] if t["key"] in LIFECYCLE_TAINTS]
        if not ready or taints:
            why.append(f"{name}: {'not Ready' if not ready else ', '.join(taints)}")
    return why


def settle(cluster: Cluster, expected: int, timeout: float = 600) -> float:
    """Waits until every node is Ready without a lifecycle taint; returns how long that took."""
    t0 = time.perf_counter()
    last: list[str] = []

    def settled() -> bool:
        nonlocal last
        last = unsettled_nodes(json.loads(cluster.kubectl("get", "nodes", "-o", "json"))["items"], expected)
        return not last

    try:
        wait_for(settled, timeout=timeout, interval=1.0, what="every node Ready without a lifecycle taint")
    except Exception as err:
        raise RuntimeError(f"{err}; still: {last[:5]}") from err
    return time.perf_counter() - t0


def create_namespace(cluster: Cluster, name: str) -> None:
    cluster.kubectl("create", "namespace", name, check=False)
    wait_for(
        lambda: cluster.kubectl("get", "serviceaccount", "default", "-n", name, check=False),
        timeout=60,
        what=f"{name}/default ServiceAccount",
    )


def baseline(cluster: Cluster, jobs: list[dict[str, Any]], workers: int) -> float:
    """The same pods, created directly (what the operator's builders produce), no operator."""
    from rlhf_operator import children
    from rlhf_trainer.spec import parse_job

    ns = "bench-baseline"
    create_namespace(cluster, ns)
    pods = []
    for doc in jobs:
        job = parse_job({**doc, "metadata": {**doc["metadata"], "namespace": ns}})
        for pod in children.build_pods(job).values():
            pod = copy.deepcopy(pod)
            pod["metadata"].pop("ownerReferences")
            pod["spec"]["serviceAccountName"] = "default"
            pod["spec"]["volumes"] = [v for v in pod["spec"]["volumes"] if "configMap" not in v]
            pod["spec"]["containers"][0]["volumeMounts"] = [
                m for m in pod["spec"]["containers"][0]["volumeMounts"] if m["name"] != "spec"
            ]
            pod["spec"]["containers"][0]["env"] = []
            pods.append(pod)
    import kubernetes

    core = kubernetes.client.CoreV1Api(cluster.admin())
    t0 = time.perf_counter()
    with ThreadPoolExecutor(workers) as ex:
        list(ex.map(lambda p: core.create_namespaced_pod(ns, p), pods))
    wait_for(
        lambda: running_pods(cluster, ns) == len(pods),
        timeout=900,
        interval=0.5,
        what="baseline pods Running",
    )
    seconds = time.perf_counter() - t0
    cluster.kubectl("delete", "namespace", ns, "--wait=true", timeout=600)
    return seconds


def operator_run(cluster: Cluster, jobs: list[dict[str, Any]], workers: int, log: Path) -> dict[str, Any]:
    render = subprocess.run(
        [
            str(assets_dir() / "helm"),
            "template",
            "rlhf-operator",
            str(ROOT / "charts" / "rlhf-operator"),
            "--namespace",
            "rlhf-system",
            "-f",
            str(ROOT / "charts" / "rlhf-operator" / "ci" / "test-values.yaml"),
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    cluster.kubectl("create", "namespace", "rlhf-system", check=False)
    cluster.kubectl(
        "apply",
        "--server-side",
        "--force-conflicts",
        "-f",
        str(ROOT / "charts" / "rlhf-operator" / "files" / "crds"),
    )
    jsonpath = '{.status.conditions[?(@.type=="Established")].status}'
    for crd in ("rltrainingjobs.rlhf.dev", "clusterkopfpeerings.kopf.dev"):
        wait_for(
            lambda c=crd: cluster.kubectl("get", "crd", c, "-o", f"jsonpath={jsonpath}") == "True",
            timeout=60,
            what=f"CRD {crd} established",
        )
    cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", "-", input=render)
    sa = cluster.as_service_account("rlhf-system", "rlhf-operator")
    ns = "bench-operator"
    create_namespace(cluster, ns)
    import kubernetes

    custom = kubernetes.client.CustomObjectsApi(cluster.admin())
    expected = 10 * len(jobs)
    with OperatorProcess(sa.kubeconfig, [ns], log_path=log, metrics=True) as op:
        rss_idle = op.peak_rss_bytes()
        t0 = time.perf_counter()
        with ThreadPoolExecutor(workers) as ex:
            list(
                ex.map(
                    lambda d: custom.create_namespaced_custom_object(
                        "rlhf.dev", "v1alpha1", ns, "rltrainingjobs", d
                    ),
                    jobs,
                )
            )
        applied = time.perf_counter() - t0
        wait_for(
            lambda: running_pods(cluster, ns) == expected,
            timeout=1800,
            interval=0.5,
            what=f"{expected} pods Running",
        )
        pods_running = time.perf_counter() - t0

        def all_jobs_running() -> bool:
            listing: Any = custom.list_namespaced_custom_object("rlhf.dev", "v1alpha1", ns, "rltrainingjobs")
            items = listing["items"]
            return all((j.get("status") or {}).get("phase") == "Running" for j in items)

        wait_for(all_jobs_running, timeout=600, interval=0.5, what="every job Running")
        jobs_running = time.perf_counter() - t0
        metrics = (
            urllib.request.urlopen(f"http://127.0.0.1:{op.metrics_port}/metrics", timeout=5).read().decode()
        )
        peak = op.peak_rss_bytes()
    reconciles = sum(
        float(line.split()[-1])
        for line in metrics.splitlines()
        if line.startswith("rlhf_operator_reconciles_total{")
    )
    return {
        "apply_seconds": applied,
        "pods_running_seconds": pods_running,
        "jobs_running_seconds": jobs_running,
        "peak_rss_mib": peak / 2**20,
        "idle_rss_mib": rss_idle / 2**20,
        "reconciles": reconciles,
    }


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--jobs", type=int, default=50)
    parser.add_argument("--nodes", type=int, default=500, help="fake 8-GPU nodes")
    parser.add_argument("--workers", type=int, default=8, help="client threads applying jobs / baseline pods")
    parser.add_argument("--skip-baseline", action="store_true")
    args = parser.parse_args()

    pools = [
        NodePool(name="bench", nodes=args.nodes, gpus=8, cpu="96", memory="1Ti", taints=[GPU_TAINT]),
        NodePool(name="bench-cpu", nodes=max(2, args.jobs // 10), cpu="64", memory="256Gi"),
    ]
    t0 = time.perf_counter()
    cluster = Cluster.existing() if use_existing_cluster() else Cluster.start(pools=None, timeout=300)
    try:
        cluster.create_pools(pools, timeout=600)
        setup = time.perf_counter() - t0
        jobs = [job_manifest(f"job-{i:03d}") for i in range(args.jobs)]
        print(f"cluster + {args.nodes} GPU nodes ready in {setup:.1f} s", flush=True)
        # Time nothing until the nodes have settled: both runs then measure the pipeline, not the
        # controller-manager removing the fresh nodes' not-ready taints.
        waited = settle(cluster, sum(p.nodes for p in pools))
        print(f"nodes settled (Ready, no lifecycle taint) {waited:.1f} s later", flush=True)
        base = None if args.skip_baseline else baseline(cluster, jobs, args.workers)
        if base is not None:
            print(
                f"baseline: {10 * args.jobs} pods created directly -> all Running in {base:.1f} s", flush=True
            )
        with tempfile.TemporaryDirectory() as tmp:
            res = operator_run(cluster, jobs, args.workers, Path(tmp) / "operator.log")
    finally:
        cluster.stop()
    print(
        f"operator: {args.jobs} jobs x 10 pods on {args.nodes} nodes: applied in {res['apply_seconds']:.1f} s, "
        f"all pods Running in {res['pods_running_seconds']:.1f} s, all jobs Running in {res['jobs_running_seconds']:.1f} s"
    )
    print(
        f"operator peak RSS: {res['peak_rss_mib']:.0f} MiB (idle before the jobs: {res['idle_rss_mib']:.0f} MiB)"
    )
    print(f"reconcile passes: {res['reconciles']:.0f} ({res['reconciles'] / args.jobs:.1f} per job)")
    if base:
        print(
            f"ratio operator / direct pod creation (time to all pods Running): {res['pods_running_seconds'] / base:.2f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
