"""Session fixture for the cluster tests: one control plane with the pools of pools.yaml.

`cluster` is a harness.Cluster (admin); `namespace` is a fresh namespace per test. With
RLHF_USE_EXISTING_CLUSTER=1 the cluster of $KUBECONFIG is used and left running.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from harness import Cluster, ClusterError, bind_example_claims, use_existing_cluster, wait_for


@pytest.fixture(scope="session")
def cluster(request: pytest.FixtureRequest) -> Iterator[Cluster]:
    try:
        started = Cluster.existing() if use_existing_cluster() else Cluster.start()
    except ClusterError as exc:
        pytest.fail(str(exc), pytrace=False)
    if started.start_seconds is not None:
        _say(
            request,
            f"cluster {started.name}: ready with its node pools in {started.start_seconds:.1f} s "
            f"(kubeconfig {started.kubeconfig})",
        )
    try:
        yield started
    finally:
        started.stop()


@pytest.fixture
def namespace(cluster: Cluster) -> Iterator[str]:
    """A fresh namespace, deleted (without waiting) after the test."""
    import kubernetes

    name = f"t-{uuid.uuid4().hex[:8]}"
    core = kubernetes.client.CoreV1Api(cluster.admin())
    core.create_namespace({"metadata": {"name": name}})
    # Pods are admitted only once the controller-manager has made the namespace's default ServiceAccount.
    wait_for(
        lambda: core.read_namespaced_service_account("default", name),
        timeout=30,
        what=f"ServiceAccount {name}/default",
    )
    volumes = bind_example_claims(core, name)
    try:
        yield name
    finally:
        core.delete_namespace(name)
        for pv in volumes:
            core.delete_persistent_volume(pv)


# --------------------------------------------------------------------------------------------------
# A real node (tests marked realnode) and the project's images loaded into it


@pytest.fixture(scope="session")
def real_node(cluster: Cluster, request: pytest.FixtureRequest) -> Iterator[Any]:
    """One real kubelet + containerd node (rlhf.dev/pool=real) joined to the session's cluster."""
    from realnode import RealNode, preflight

    if use_existing_cluster():
        pytest.skip(
            "needs a real node: it joins only a cluster the harness starts (RLHF_USE_EXISTING_CLUSTER=1)"
        )
    missing = preflight()
    if missing:
        pytest.skip("needs a real node: " + "; ".join(missing))
    try:
        node = RealNode.start(cluster)
    except ClusterError as exc:
        pytest.fail(str(exc), pytrace=False)
    _say(request, f"real node {node.name}: Ready in {node.start_seconds:.1f} s (workdir {node.workdir})")
    try:
        yield node
    finally:
        node.stop()


@pytest.fixture(scope="session")
def images(real_node: Any, request: pytest.FixtureRequest) -> dict[str, str]:
    """{"operator": ref, "trainer-cpu": ref}: built from the Dockerfile by scripts/images.sh (once
    per source hash, cached) and loaded into the real node's containerd."""
    import subprocess
    import time

    script = Path(__file__).resolve().parents[2] / "scripts" / "images.sh"
    t0 = time.monotonic()
    res = subprocess.run(
        ["bash", str(script), "operator", "trainer-cpu"], capture_output=True, text=True, timeout=3600
    )
    if res.returncode != 0:
        pytest.fail(f"scripts/images.sh failed ({res.returncode}):\n{res.stderr[-4000:]}", pytrace=False)
    built = time.monotonic() - t0
    refs: dict[str, str] = {}
    loaded = []
    for line in res.stdout.split("\n"):
        if not line.strip():
            continue
        target, ref, archive = line.split()
        seconds = real_node.load_image(archive, ref)
        loaded.append(f"{target} {seconds:.0f} s")
        refs[target] = ref
    _say(request, f"images: built/found in {built:.0f} s; imported: {', '.join(loaded)}")
    return refs


def _say(request: pytest.FixtureRequest, line: str) -> None:
    reporter = request.config.pluginmanager.get_plugin("terminalreporter")
    capture = request.config.pluginmanager.get_plugin("capturemanager")
    if reporter is not None and capture is not None:
        with capture.global_and_fixture_disabled():
            reporter.write_line("\n" + line)
