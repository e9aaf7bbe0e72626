"""Operator at scale on the real control plane: from `kubectl apply` of N jobs x 10 pods to every pod
Running, on 500 fake 8-GPU nodes (kwok), with the operator's peak memory.

    .venv/bin/python benchmarks/operator_scale.py                 # 50 jobs x 10 pods, 500 nodes
    .venv/bin/python benchmarks/operator_scale.py --jobs 10 --nodes 100
    # before/after on one cluster: the operator of another checkout, then this one's
    .venv/bin/python benchmarks/operator_scale.py --operator-code /tmp/main-export --operator-code .
    # three rounds (baseline, then the operator, each round): medians and ranges at the end
    .venv/bin/python benchmarks/operator_scale.py --repeat 3

Baseline, in the same process and cluster: the same pods created directly by one client (no
operator), so the ratio shows what the operator's reconcile adds to the API server + scheduler +
kwok pipeline. The operator runs as its own process under the chart's RBAC. Timing starts only
once every node is Ready and free of the lifecycle taints a fresh node carries for its first
seconds (the controller-manager removes them), so neither run measures that warm-up.

Besides the totals it prints where the time went, from the API server's timestamps (whole seconds):
when the pods were created, bound and Ready, and when each job's first and last pod was created;
and the operator's CPU time and the time spent inside its passes. At the end, per operator: the
medians (and ranges, with --repeat) and the verdict against issue 24's targets (all pods Running
within 1.5x the baseline of the same round, peak RSS under 100 MiB), met or missed.
"""

from __future__ import annotations

import argparse
import copy
import datetime as dt
import json
import os
import statistics
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


#: The host directory the jobs' checkpoints name (never written: nothing runs on kwok's nodes).
BENCH_HOST_PATH = "/tmp/rlhf-bench-checkpoints"


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
    # pod naming a missing claim is never scheduled. The checkpoint and run directories must still
    # be on a volume every writer mounts (the operator refuses the job otherwise): a hostPath
    # (kwok mounts nothing), allowed by the operator run below (BENCH_HOST_PATH).
    spec["pod"] = {
        "volumes": [
            {"name": "checkpoints", "mountPath": "/checkpoints", "hostPath": {"path": BENCH_HOST_PATH}}
        ]
    }
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


def _time(stamp: str | None) -> float | None:
    if not stamp:
        return None
    return dt.datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()


def timeline(cluster: Cluster, namespace: str, t0: float) -> dict[str, list[float]]:
    """Where the time went, from the API server's own timestamps (whole seconds), relative to
    `t0` (wall clock when the jobs or pods were first sent): per pod, when it was created, bound
    (PodScheduled) and Ready; per job, when its first and last pod were created."""
    pods = json.loads(cluster.kubectl("get", "pods", "-n", namespace, "-o", "json", timeout=300))["items"]
    out: dict[str, list[float]] = {"created": [], "scheduled": [], "ready": []}
    by_job: dict[str, list[float]] = {}
    for pod in pods:
        created = _time(pod["metadata"].get("creationTimestamp"))
        conds = {
            c["type"]: _time(c.get("lastTransitionTime"))
            for c in pod.get("status", {}).get("conditions") or []
        }
        if created is None or conds.get("PodScheduled") is None or conds.get("Ready") is None:
            continue
        out["created"].append(created - t0)
        out["scheduled"].append(conds["PodScheduled"] - t0)  # type: ignore[operator]
        out["ready"].append(conds["Ready"] - t0)  # type: ignore[operator]
        job = (pod["metadata"].get("labels") or {}).get("rlhf.dev/job-name", "")
        by_job.setdefault(job, []).append(created - t0)
    out["job first pod"] = [min(v) for v in by_job.values()]
    out["job last pod"] = [max(v) for v in by_job.values()]
    return out


def show_timeline(what: str, tl: dict[str, list[float]]) -> None:
    parts = [f"{key} {statistics.median(v):.0f}/{max(v):.0f}" for key, v in tl.items() if v]
    print(
        f"{what} timeline, s after the first request (median/last, whole seconds): {', '.join(parts)}",
        flush=True,
    )


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process (Linux)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


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
    from rlhf_api.loader import parse_job
    from rlhf_operator import children, images
    from rlhf_operator.testing import TEST_TRAINER_IMAGE

    # The jobs set no spec.image: their pods get the operator's default, which `OperatorProcess`
    # passes to the operator run (this environment's, else the test image); the baseline's pods
    # are built here, so they need it here too (else: 422, spec.containers[0].image required).
    os.environ.setdefault(images.ENV_TRAINER_IMAGE, TEST_TRAINER_IMAGE)
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
    t0, wall0 = time.perf_counter(), time.time()
    with ThreadPoolExecutor(workers) as ex:
        list(ex.map(lambda p: core.create_namespaced_pod(ns, p), pods))
    wait_for(
        lambda: running_pods(cluster, ns) == len(pods),
        timeout=900,
        interval=0.5,
        what="baseline pods Running",
    )
    seconds = time.perf_counter() - t0
    show_timeline("baseline", timeline(cluster, ns, wall0))
    cluster.kubectl("delete", "namespace", ns, "--wait=true", timeout=600)
    return seconds


def install_operator(cluster: Cluster) -> None:
    """The CRD and the chart's RBAC (of this checkout), once per cluster."""
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


def operator_run(
    cluster: Cluster, jobs: list[dict[str, Any]], workers: int, log: Path, code: Path, ns: str
) -> dict[str, Any]:
    """The operator of the checkout `code` (its api/, trainer/ and operator/ on PYTHONPATH) drives `jobs`
    in namespace `ns`, which is deleted afterwards (freeing the nodes for the next run)."""
    sa = cluster.as_service_account("rlhf-system", "rlhf-operator")
    create_namespace(cluster, ns)
    env = {
        "PYTHONPATH": os.pathsep.join(str(code / part) for part in ("api", "trainer", "operator")),
        # Timestamps and one line per pass (duration by stage) in the kept log; older operators
        # ignore both.
        "RLHF_OPERATOR_LOG_FORMAT": "full",
        "RLHF_OPERATOR_DEBUG_PASSES": "1",
        "RLHF_OPERATOR_ALLOWED_HOST_PATHS": BENCH_HOST_PATH,  # the jobs' checkpoint volume
    }
    import kubernetes

    custom = kubernetes.client.CustomObjectsApi(cluster.admin())
    expected = 10 * len(jobs)
    with OperatorProcess(sa.kubeconfig, [ns], log_path=log, metrics=True, env=env) as op:
        rss_idle = op.peak_rss_bytes()
        assert op.proc is not None
        cpu0 = cpu_seconds(op.proc.pid)
        t0, wall0 = time.perf_counter(), time.time()
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
        cpu = cpu_seconds(op.proc.pid) - cpu0
    show_timeline(f"operator ({code})", timeline(cluster, ns, wall0))
    cluster.kubectl("delete", "namespace", ns, "--wait=true", timeout=900)

    def metric(prefix: str) -> float:
        return sum(float(line.split()[-1]) for line in metrics.splitlines() if line.startswith(prefix))

    rules = [
        line for line in log.read_text(errors="replace").splitlines() if "CRD" in line and "rule" in line
    ]
    return {
        "cpu_seconds": cpu,
        "pass_seconds": metric("rlhf_operator_reconcile_duration_seconds_sum"),
        "crd_rules": rules[-1] if rules else "(no line about the CRD's rules in the log)",
        "apply_seconds": applied,
        "pods_running_seconds": pods_running,
        "jobs_running_seconds": jobs_running,
        "peak_rss_mib": peak / 2**20,
        "idle_rss_mib": rss_idle / 2**20,
        "reconciles": metric("rlhf_operator_reconciles_total{"),
    }


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--jobs", type=int, default=50)
    parser.add_argument("--nodes", type=int, default=500, help="fake 8-GPU nodes")
    parser.add_argument("--workers", type=int, default=8, help="client threads applying jobs / baseline pods")
    parser.add_argument("--skip-baseline", action="store_true")
    parser.add_argument(
        "--operator-code",
        action="append",
        type=Path,
        metavar="CHECKOUT",
        help="run the operator of this checkout (its trainer/ and operator/), repeatable: each runs "
        "in turn on the same cluster, e.g. a worktree of main and this one (default: this checkout)",
    )
    parser.add_argument("--operator-log-dir", type=Path, help="keep the operators' logs here")
    parser.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="rounds on the same cluster, each a fresh baseline then each operator in turn; "
        "with more than one, the medians and ranges over the rounds are printed at the end",
    )
    args = parser.parse_args()
    codes = [p.resolve() for p in args.operator_code or [ROOT]]

    pools = [
        NodePool(name="bench", nodes=args.nodes, gpus=8, cpu="96", memory="1Ti", taints=[GPU_TAINT]),
        NodePool(name="bench-cpu", nodes=max(2, args.jobs // 10), cpu="64", memory="256Gi"),
    ]
    print(f"machine: {os.cpu_count()} CPUs; load average at the start: {load()}", flush=True)
    t0 = time.perf_counter()
    cluster = Cluster.existing() if use_existing_cluster() else Cluster.start(pools=None, timeout=300)
    runs: dict[Path, list[dict[str, Any]]] = {code: [] for code in codes}
    try:
        cluster.create_pools(pools, timeout=600)
        setup = time.perf_counter() - t0
        jobs = [job_manifest(f"job-{i:03d}") for i in range(args.jobs)]
        print(f"cluster + {args.nodes} GPU nodes ready in {setup:.1f} s", flush=True)
        # Time nothing until the nodes have settled: both runs then measure the pipeline, not the
        # controller-manager removing the fresh nodes' not-ready taints.
        waited = settle(cluster, sum(p.nodes for p in pools))
        print(f"nodes settled (Ready, no lifecycle taint) {waited:.1f} s later", flush=True)
        install_operator(cluster)
        with tempfile.TemporaryDirectory() as tmp:
            logs = args.operator_log_dir or Path(tmp)
            logs.mkdir(parents=True, exist_ok=True)
            for r in range(args.repeat):
                tag = f"round {r + 1}/{args.repeat}: " if args.repeat > 1 else ""
                base = None
                if not args.skip_baseline:
                    print(f"{tag}load average before the baseline: {load()}", flush=True)
                    base = baseline(cluster, jobs, args.workers)
                    print(
                        f"{tag}baseline: {10 * args.jobs} pods created directly -> all Running in {base:.1f} s",
                        flush=True,
                    )
                for i, code in enumerate(codes):
                    print(f"{tag}load average before the operator run: {load()}", flush=True)
                    log = logs / f"operator-{r}-{i}.log"
                    res = operator_run(cluster, jobs, args.workers, log, code, f"bench-operator-{r}-{i}")
                    res["baseline_seconds"] = base
                    runs[code].append(res)
                    report(res, args.jobs, args.nodes, base, code)
    finally:
        cluster.stop()
    for code, results in runs.items():
        summary(code, results)
    return 0


def load() -> str:
    return " ".join(f"{x:.1f}" for x in os.getloadavg())


#: Issue 24's targets: every pod Running within this many times the direct creation of the same
#: pods (measured in the same run), and the operator's peak RSS under this many MiB.
TARGET_RATIO = 1.5
TARGET_PEAK_RSS_MIB = 100.0


def spread(values: list[float], unit: str = "", digits: int = 1) -> str:
    """Median, and the range where there are several values."""
    med = f"{statistics.median(values):.{digits}f}{unit}"
    if len(values) < 2:
        return med
    return f"{med} (range {min(values):.{digits}f} to {max(values):.{digits}f}{unit}, n={len(values)})"


def summary(code: Path, results: list[dict[str, Any]]) -> None:
    """The medians over the rounds and the verdict against issue 24's targets (met or missed)."""
    if not results:
        return
    ratios = [r["pods_running_seconds"] / r["baseline_seconds"] for r in results if r.get("baseline_seconds")]
    peaks = [r["peak_rss_mib"] for r in results]
    print(f"summary, operator of {code}:")
    bases = [r["baseline_seconds"] for r in results if r.get("baseline_seconds")]
    if bases:
        print(f"  baseline, all pods Running: {spread(bases, ' s')}")
    print(f"  operator, all pods Running: {spread([r['pods_running_seconds'] for r in results], ' s')}")
    print(f"  operator, all jobs Running: {spread([r['jobs_running_seconds'] for r in results], ' s')}")
    print(
        f"  peak RSS: {spread(peaks, ' MiB', 0)}; idle {spread([r['idle_rss_mib'] for r in results], ' MiB', 0)}"
    )
    if ratios:
        verdict = "met" if statistics.median(ratios) <= TARGET_RATIO else "MISSED"
        print(
            f"  ratio to the baseline of its round: {spread(ratios, '', 2)}; target <= {TARGET_RATIO}: {verdict}"
        )
    else:
        print(f"  ratio: no baseline measured (--skip-baseline); target <= {TARGET_RATIO}: not measured")
    verdict = "met" if max(peaks) < TARGET_PEAK_RSS_MIB else "MISSED"
    print(f"  peak RSS target < {TARGET_PEAK_RSS_MIB:.0f} MiB (highest run): {verdict}", flush=True)


def report(res: dict[str, Any], jobs: int, nodes: int, base: float | None, code: Path) -> None:
    print(f"operator of {code}:")
    print(
        f"  {jobs} jobs x 10 pods on {nodes} nodes: applied in {res['apply_seconds']:.1f} s, "
        f"all pods Running in {res['pods_running_seconds']:.1f} s, all jobs Running in {res['jobs_running_seconds']:.1f} s"
    )
    print(f"  peak RSS: {res['peak_rss_mib']:.0f} MiB (idle before the jobs: {res['idle_rss_mib']:.0f} MiB)")
    print(f"  reconcile passes: {res['reconciles']:.0f} ({res['reconciles'] / jobs:.1f} per job)")
    print(
        f"  CPU until every job Running: {res['cpu_seconds']:.1f} s; "
        f"time inside passes (summed over concurrent passes): {res['pass_seconds']:.1f} s"
    )
    print(f"  log: {res['crd_rules']}")
    print(f"  load average at the end: {load()}")
    if base:
        print(
            f"  ratio operator / direct pod creation (time to all pods Running): {res['pods_running_seconds'] / base:.2f}",
            flush=True,
        )


if __name__ == "__main__":
    sys.exit(main())
