"""The operator's autoscaler on the real control plane, under the chart's RBAC.

A real `StepMetrics` + `MetricsServer` on 127.0.0.1 stands in for the job's controller pod (the
operator scrapes it through `--controller-metrics-url`); the test also plays the controller's part
of the resharding protocol by writing `status.rollout.syncedGeneration`.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from harness import Cluster, wait_for
from test_operator_e2e import Api, grpo_job, installed, metric  # noqa: F401  (installed: a fixture)

from rlhf_operator.testing import OperatorProcess
from rlhf_trainer.metrics import MetricsServer, StepMetrics

pytestmark = pytest.mark.cluster

PERIOD, WINDOW, COOLDOWN = 2, 4, 2
#: Slack for a loaded machine (2 shared cores) on top of the policy's own bound.
SLACK = 20


@pytest.fixture
def exporter() -> Iterator[tuple[StepMetrics, MetricsServer]]:
    step_metrics = StepMetrics(job="scaled")
    server = MetricsServer(port=0, host="127.0.0.1", metrics=step_metrics)
    try:
        yield step_metrics, server
    finally:
        server.stop()


@pytest.fixture
def operator(
    installed: Any,  # noqa: F811
    namespace: str,
    tmp_path: Path,
    exporter: tuple[StepMetrics, MetricsServer],
) -> Iterator[OperatorProcess]:
    _, server = exporter
    proc = OperatorProcess(
        installed.kubeconfig,
        [namespace],
        log_path=tmp_path / "operator.log",
        metrics=True,
        env={"RLHF_OPERATOR_CONTROLLER_METRICS_URL": f"{server.url}/metrics"},
    )
    proc.start()
    try:
        yield proc
    finally:
        proc.stop()
        print(proc.log_tail(4000))


def rollout_pods(api: Api, name: str) -> list[str]:
    return sorted(
        p.metadata.name
        for p in api.pods(name)
        if "-rollout-" in p.metadata.name and not p.metadata.deletion_timestamp
    )


def play_controller_sync(cluster: Cluster, namespace: str, name: str, generation: int) -> None:
    patch = {"status": {"rollout": {"syncedGeneration": generation}}}
    cluster.kubectl(
        "patch",
        "rltj",
        name,
        "-n",
        namespace,
        "--subresource=status",
        "--type=merge",
        "-p",
        json.dumps(patch),
    )


def event_reasons(cluster: Cluster, namespace: str, name: str) -> set[str]:
    out = cluster.kubectl(
        "get", "events", "-n", namespace, f"--field-selector=involvedObject.name={name}", "-o", "json"
    )
    return {e["reason"] for e in json.loads(out)["items"]}


def test_autoscaler_scales_rollout_up_and_down_following_the_protocol(
    cluster: Cluster,
    namespace: str,
    exporter: tuple[StepMetrics, MetricsServer],
    operator: OperatorProcess,
) -> None:
    step_metrics, _ = exporter
    api = Api(cluster, namespace)
    name = "scaled"
    doc = grpo_job(name)
    doc["spec"]["roles"]["rollout"].update(replicas=1, minReplicas=1, maxReplicas=2)
    doc["spec"]["autoscaling"] = {
        "enabled": True,
        "metric": "rollout_wait_fraction",
        "target": 0.2,
        "tolerance": 0.1,
        "periodSeconds": PERIOD,
        "stabilizationWindowSeconds": WINDOW,
        "cooldownSeconds": COOLDOWN,
    }
    step_metrics.set("rollout_wait_fraction", 0.2)  # on target: hold
    api.apply(doc)
    api.wait_phase(name, "Running")
    assert rollout_pods(api, name) == [f"{name}-rollout-0"]
    play_controller_sync(cluster, namespace, name, 1)  # the controller's first weight sync

    # Steady state first: an evaluation past the cooldown that holds within tolerance.
    wait_for(
        lambda: "tolerance" in (api.status(name).get("autoscaling") or {}).get("reason", ""),
        timeout=PERIOD + COOLDOWN + SLACK,
        what="an on-target evaluation",
    )
    assert api.job(name)["spec"]["roles"]["rollout"]["replicas"] == 1

    # The trainer now waits for rollouts 60% of each step: scale up.
    t0 = time.monotonic()
    step_metrics.set("rollout_wait_fraction", 0.6)
    wait_for(
        lambda: rollout_pods(api, name) == [f"{name}-rollout-0", f"{name}-rollout-1"],
        timeout=PERIOD + WINDOW + SLACK,
        what="a second rollout pod",
    )
    latency = time.monotonic() - t0
    print(f"scale-up latency {latency:.1f} s (bound: period {PERIOD} + window {WINDOW} + slack {SLACK})")
    assert latency <= PERIOD + WINDOW + SLACK
    wait_for(lambda: api.status(name)["rollout"]["generation"] == 2, timeout=30, what="rollout generation 2")
    assert api.job(name)["spec"]["roles"]["rollout"]["replicas"] == 2  # written through /scale
    wait_for(lambda: "AutoscaledUp" in event_reasons(cluster, namespace, name), timeout=30, what="Event")
    assert metric(operator, 'rlhf_operator_autoscale_decisions_total{direction="up"}') >= 1

    # The controller drains nothing, rebuilds its group, syncs generation 2; load falls.
    play_controller_sync(cluster, namespace, name, 2)
    step_metrics.set("rollout_wait_fraction", 0.02)
    wait_for(
        lambda: api.status(name)["rollout"]["generation"] == 3,
        timeout=PERIOD + WINDOW + COOLDOWN + SLACK,
        what="scale-down (rollout generation 3)",
    )
    assert api.job(name)["spec"]["roles"]["rollout"]["replicas"] == 1
    assert "AutoscaledDown" in event_reasons(cluster, namespace, name) or wait_for(
        lambda: "AutoscaledDown" in event_reasons(cluster, namespace, name), timeout=30, what="Event"
    )
    # The leaving pod stays while the controller drains it...
    time.sleep(PERIOD + 1)
    assert rollout_pods(api, name) == [f"{name}-rollout-0", f"{name}-rollout-1"]
    assert api.status(name)["rollout"].get("syncedGeneration") == 2
    # ...and goes once the controller reports generation 3 synced.
    play_controller_sync(cluster, namespace, name, 3)
    wait_for(
        lambda: rollout_pods(api, name) == [f"{name}-rollout-0"],
        timeout=30,
        what="the drained rollout pod deleted",
    )
    assert api.status(name)["rollout"]["generation"] == 3
    assert metric(operator, 'rlhf_operator_autoscale_decisions_total{direction="down"}') >= 1
