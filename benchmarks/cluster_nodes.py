"""How fast the test harness brings up a cluster with many fake GPU nodes (target: 1,000 nodes in < 2 min).

    python benchmarks/cluster_nodes.py                    # 1,000 nodes x 8 nvidia.com/gpu
    python benchmarks/cluster_nodes.py --nodes 200 --pods 200

Reports, as one JSON line on stdout: the warm start of the control plane (no nodes), the time to
create the nodes and have kwok make them all Ready, and optionally the time for the real scheduler
to bind `--pods` 8-GPU pods (one per node) that kwok then marks Running. Needs the binaries of
`bash tests/cluster/build`.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "cluster"))

from harness import GPU_RESOURCE, POOL_LABEL, Cluster, NodePool, wait_for  # noqa: E402


def running_pods(cluster: Cluster, namespace: str) -> int:
    pods = cluster.request(
        "GET", f"/api/v1/namespaces/{namespace}/pods", query={"fieldSelector": "status.phase=Running"}
    )
    return len(pods["items"])


def create_pods(cluster: Cluster, namespace: str, count: int, gpus: int) -> None:
    from concurrent.futures import ThreadPoolExecutor

    def create(i: int) -> None:
        body = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": f"worker-{i}"},
            "spec": {
                "nodeSelector": {POOL_LABEL: "bench"},
                "tolerations": [{"key": GPU_RESOURCE, "operator": "Exists", "effect": "NoSchedule"}],
                "containers": [
                    {
                        "name": "main",
                        "image": "trainer:bench",
                        "resources": {"limits": {GPU_RESOURCE: str(gpus)}},
                    }
                ],
            },
        }
        cluster.request("POST", f"/api/v1/namespaces/{namespace}/pods", body)

    with ThreadPoolExecutor(max_workers=16) as ex:
        list(ex.map(create, range(count)))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--nodes", type=int, default=1000, help="fake GPU nodes to bring up (default 1000)")
    parser.add_argument("--gpus", type=int, default=8, help="nvidia.com/gpu per node (default 8)")
    parser.add_argument(
        "--pods", type=int, default=0, help="also schedule this many full-node GPU pods (default 0)"
    )
    parser.add_argument(
        "--timeout", type=float, default=600, help="give up after this many seconds per phase"
    )
    args = parser.parse_args()

    t0 = time.monotonic()
    with Cluster.start(pools=None) as cluster:
        start_s = time.monotonic() - t0
        print(f"control plane ready in {start_s:.1f} s", file=sys.stderr)

        pool = NodePool(
            name="bench",
            nodes=args.nodes,
            gpus=args.gpus,
            cpu="192",
            memory="2Ti",
            taints=[{"key": GPU_RESOURCE, "value": "present", "effect": "NoSchedule"}],
        )
        t1 = time.monotonic()
        cluster.create_pool(pool, wait=False)
        created_s = time.monotonic() - t1
        print(f"{args.nodes} Node objects created in {created_s:.1f} s; waiting for Ready", file=sys.stderr)
        cluster.wait_nodes_ready(pool.node_names(), timeout=args.timeout)
        nodes_s = time.monotonic() - t1
        print(f"{args.nodes} nodes Ready in {nodes_s:.1f} s", file=sys.stderr)

        result = {
            "benchmark": "cluster_nodes",
            "nodes": args.nodes,
            "gpus_per_node": args.gpus,
            "control_plane_start_s": round(start_s, 1),
            "nodes_created_s": round(created_s, 1),
            "nodes_ready_s": round(nodes_s, 1),
        }
        if args.pods:
            import kubernetes

            kubernetes.client.CoreV1Api(cluster.admin()).create_namespace({"metadata": {"name": "bench"}})
            wait_for(
                lambda: kubernetes.client.CoreV1Api(cluster.admin()).read_namespaced_service_account(
                    "default", "bench"
                ),
                timeout=30,
                what="ServiceAccount bench/default",
            )
            t2 = time.monotonic()
            create_pods(cluster, "bench", args.pods, args.gpus)
            wait_for(
                lambda: running_pods(cluster, "bench") >= args.pods,
                timeout=args.timeout,
                interval=1,
                what=f"{args.pods} pods Running",
            )
            result["pods"] = args.pods
            result["pods_running_s"] = round(time.monotonic() - t2, 1)
            print(f"{args.pods} pods scheduled and Running in {result['pods_running_s']} s", file=sys.stderr)
    result["total_s"] = round(time.monotonic() - t0, 1)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
