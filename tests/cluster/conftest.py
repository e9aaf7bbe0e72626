"""Session fixture for the cluster tests: one control plane with the pools of pools.yaml.

`cluster` is a harness.Cluster (admin); `namespace` is a fresh namespace per test. With
RLHF_USE_EXISTING_CLUSTER=1 the cluster of $KUBECONFIG is used and left running.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest
from harness import Cluster, ClusterError, use_existing_cluster, wait_for


@pytest.fixture(scope="session")
def cluster(request: pytest.FixtureRequest) -> Iterator[Cluster]:
    reporter = request.config.pluginmanager.get_plugin("terminalreporter")
    try:
        started = Cluster.existing() if use_existing_cluster() else Cluster.start()
    except ClusterError as exc:
        pytest.fail(str(exc), pytrace=False)
    capture = request.config.pluginmanager.get_plugin("capturemanager")
    if reporter is not None and capture is not None and started.start_seconds is not None:
        with capture.global_and_fixture_disabled():
            reporter.write_line(
                f"\ncluster {started.name}: ready with its node pools in {started.start_seconds:.1f} s "
                f"(kubeconfig {started.kubeconfig})"
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
    try:
        yield name
    finally:
        core.delete_namespace(name)
