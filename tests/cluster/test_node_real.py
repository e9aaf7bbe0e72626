"""The real node: pods really run beside kwok's fake GPU nodes, talk to each other by headless-Service
DNS names, reach the API server through the `kubernetes` Service with their ServiceAccount token,
have no default route, and a killed test run leaves nothing behind.

The kill test runs first (pytest keeps file order): it starts and kills its own node before the
session's node exists, as there is one real node per machine at a time."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
from harness import Cluster, wait_for
from realnode import NODE_NAME, POOL, POOL_LABEL, TOLERATION, leftovers, preflight

pytestmark = [pytest.mark.cluster, pytest.mark.realnode]

HERE = Path(__file__).resolve().parent


def _ip_forward() -> str:
    return Path("/proc/sys/net/ipv4/ip_forward").read_text().strip()


def test_killed_run_leaves_nothing_behind(cluster: Cluster, tmp_path: Path) -> None:
    """A process that started a real node and is SIGKILLed: its watchdog removes every process,
    mount, cgroup, network namespace and the bridge; the node's Node object stays as a NotReady
    record only until the next start replaces it."""
    missing = preflight()
    if missing:
        pytest.skip("needs a real node: " + "; ".join(missing))
    assert not leftovers(), f"a real node is already running: {leftovers()}"
    forward_before = _ip_forward()
    netns_before = set(os.listdir("/run/netns")) if os.path.isdir("/run/netns") else set()
    script = textwrap.dedent(
        f"""
        import sys, time
        sys.path.insert(0, {str(HERE)!r})
        from harness import Cluster
        from realnode import RealNode
        cluster = Cluster({str(cluster.kubeconfig)!r}, name={cluster.name!r}, workdir=Path({str(cluster.workdir)!r}))
        node = RealNode.start(cluster)
        print("READY", node.start_seconds, flush=True)
        time.sleep(3600)
        """
    ).replace("import sys, time", "import sys, time\nfrom pathlib import Path")
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.startswith("READY"), f"the node did not start: {line!r}"
        print(f"real node warm start: {float(line.split()[1]):.1f} s")
        assert leftovers(), "a running node should be visible to leftovers()"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    wait_for(
        lambda: not leftovers(), timeout=120, interval=1, what="the watchdog's teardown of the killed node"
    )
    netns_after = set(os.listdir("/run/netns")) if os.path.isdir("/run/netns") else set()
    assert netns_after <= netns_before, f"network namespaces left: {netns_after - netns_before}"
    assert _ip_forward() == forward_before
    cluster.request("DELETE", f"/api/v1/nodes/{NODE_NAME}")


def _pod(name: str, image: str, command: list[str], **spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": {"app": "echo"}},
        "spec": {
            "restartPolicy": "Never",
            "nodeSelector": {POOL_LABEL: POOL},
            "tolerations": [TOLERATION],
            "enableServiceLinks": False,
            "securityContext": {
                "runAsNonRoot": True,
                "runAsUser": 1000,
                "seccompProfile": {"type": "RuntimeDefault"},
            },
            "containers": [
                {
                    "name": "main",
                    "image": image,
                    "command": command,
                    "resources": {"requests": {"cpu": "10m", "memory": "32Mi"}},
                    "securityContext": {
                        "allowPrivilegeEscalation": False,
                        "readOnlyRootFilesystem": True,
                        "capabilities": {"drop": ["ALL"]},
                    },
                }
            ],
            **spec,
        },
    }


CLIENT = """
import json, socket, ssl, urllib.request
out = {}
name = "a.echo.%s.svc.cluster.local" % NS
out["resolved"] = socket.gethostbyname(name)
out["echo"] = urllib.request.urlopen("http://%s:8000/" % name, timeout=10).status
routes = open("/proc/net/route").read().split("\\n")[1:]
out["default_route"] = any(r.split()[1:2] == ["00000000"] for r in routes if r.strip())
from kubernetes import client, config
config.load_incluster_config()
review = client.AuthenticationV1Api().create_self_subject_review({"apiVersion": "authentication.k8s.io/v1", "kind": "SelfSubjectReview"})
out["user"] = review.status.user_info.username
print(json.dumps(out))
"""


def test_pods_resolve_each_other_and_reach_the_api_server(
    cluster: Cluster, real_node: Any, images: dict[str, str], namespace: str
) -> None:
    image = images["operator"]  # python3 and the Kubernetes client, small
    server = _pod("a", image, ["python3", "-m", "http.server", "8000"], hostname="a", subdomain="echo")
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": "echo"},
        "spec": {"clusterIP": "None", "selector": {"app": "echo"}, "ports": [{"port": 8000}]},
    }
    client_pod = _pod("client", image, ["python3", "-c", f"NS = {namespace!r}\n" + CLIENT])
    client_pod["metadata"]["labels"] = {"app": "client"}
    t0 = time.monotonic()
    for obj in (service, server):
        cluster.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(obj))
    running = cluster.wait_pod_phase("a", namespace, "Running", timeout=120)
    print(f"pod Pending -> Running on the real node: {time.monotonic() - t0:.1f} s")
    assert running.spec.node_name == NODE_NAME
    assert running.status.pod_ip.startswith("10.244.0.")
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(client_pod))
    wait_for(
        lambda: (
            cluster.request("GET", f"/api/v1/namespaces/{namespace}/pods/client")["status"].get("phase")
            in ("Succeeded", "Failed")
        ),
        timeout=120,
        what="the client pod to finish",
    )
    logs = cluster.kubectl("logs", "-n", namespace, "client")  # through the kubelet's API
    phase = cluster.request("GET", f"/api/v1/namespaces/{namespace}/pods/client")["status"]["phase"]
    assert phase == "Succeeded", logs
    result = json.loads(logs.strip().splitlines()[-1])
    assert result["resolved"] == running.status.pod_ip
    assert result["echo"] == 200
    assert result["default_route"] is False
    assert result["user"] == f"system:serviceaccount:{namespace}:default"
