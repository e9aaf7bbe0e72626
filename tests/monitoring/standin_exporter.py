"""Staged exporter processes for the live Prometheus test (the healthy job there is a real run).

`stalled`: the REAL trainer exporter (`rlhf_trainer.metrics.StepMetrics` served by
`MetricsServer`, the classes the controller uses) fed step dicts that never advance, so the
series names, types and labels are the controller's own while the job makes no progress. The two
fleet-only series that `dataflow.elastic.RolloutFleet.attach_metrics` adds
(`rlhf_rollout_max_replicas`, `rlhf_autoscale_decisions_total`) are registered under the same names.
`operator`: the real `rlhf_operator.metrics` module, counters bumped by hand.

    python standin_exporter.py PORT stalled|operator
"""

from __future__ import annotations

import random
import sys
import time

from prometheus_client import Counter, Gauge, start_http_server


def trainer(port: int, mode: str) -> None:
    from rlhf_trainer.metrics import MetricsServer, StepMetrics

    m = StepMetrics(job=mode)
    Gauge("rlhf_rollout_max_replicas", "Upper bound of the rollout fleet.", registry=m.registry).set(3)
    decisions = Counter(
        "rlhf_autoscale_decisions",
        "Autoscaling policy evaluations.",
        ["direction", "cause"],
        registry=m.registry,
    )
    MetricsServer(port=port, metrics=m)
    step, consumed = 0, 0  # never advance: the job is stalled
    while True:
        m.record(
            step,
            {
                "reward/mean": random.random(),
                "actor/kl": random.random() / 10,
                "actor/entropy": 1 + random.random(),
                "rollout/wait_fraction": 0.8,
                "rollout/queue_depth": 12.0,
                "rollout/replicas": 3.0,
                "perf/tokens_per_second": 1000 * random.random(),
                "perf/samples_per_second": 10 * random.random(),
                "policy_version": float(step),
                "total_steps": 1000.0,
                "sync/seconds": random.random(),
                "data/prompts_consumed": float(consumed),
                **{
                    f"timing/{p}": random.random()
                    for p in ("rollout", "reward", "update", "weight_sync", "step")
                },
            },
        )
        decisions.labels("none", "tolerance").inc()
        time.sleep(0.2)


def operator(port: int) -> None:
    from rlhf_operator import metrics as m  # the real operator metrics

    start_http_server(port, addr="127.0.0.1")

    while True:
        m.RECONCILES.labels("ok").inc()
        m.ERRORS.labels("ApiException").inc()
        m.LATENCY.observe(random.random() / 10)
        m.observe_phase("ns", "a", "Running")
        m.RESTARTS.inc()
        m.PODS_CREATED.inc()
        m.PODS_DELETED.inc()
        m.AUTOSCALE_DECISIONS.labels(random.choice(["up", "down", "none"])).inc()
        time.sleep(0.2)


if __name__ == "__main__":
    port, mode = int(sys.argv[1]), sys.argv[2]
    operator(port) if mode == "operator" else trainer(port, mode)
