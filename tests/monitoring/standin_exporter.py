"""STAND-IN exporter: serves the trainer's metric names with prometheus_client, because the real
controller does not export them yet. The integration lead replaces this with a real `rlhf run`.

    python standin_exporter.py PORT healthy|stalled|operator
"""

from __future__ import annotations

import random
import sys
import time

from prometheus_client import Gauge, start_http_server


def trainer(mode: str) -> None:
    g = {n: Gauge(n, n) for n in (
        "rlhf_rollout_wait_fraction", "rlhf_queue_depth", "rlhf_tokens_per_second", "rlhf_rollout_replicas",
        "rlhf_rollout_max_replicas", "rlhf_weight_sync_seconds", "rlhf_reward_mean", "rlhf_kl", "rlhf_entropy",
        "rlhf_step", "rlhf_total_steps", "rlhf_policy_version", "rlhf_samples_per_second")}  # fmt: skip
    phase = Gauge("rlhf_step_seconds", "Seconds of the last step by phase.", ["phase"])
    g["rlhf_total_steps"].set(1000)
    g["rlhf_rollout_max_replicas"].set(3)
    step = 0
    while True:
        if mode == "healthy":
            step += 1
        g["rlhf_step"].set(step)
        g["rlhf_policy_version"].set(step)
        g["rlhf_rollout_replicas"].set(3 if mode == "stalled" else 2)
        g["rlhf_rollout_wait_fraction"].set(0.8 if mode == "stalled" else 0.1)
        for n in ("rlhf_queue_depth", "rlhf_tokens_per_second", "rlhf_weight_sync_seconds", "rlhf_reward_mean",
                  "rlhf_kl", "rlhf_entropy", "rlhf_samples_per_second"):  # fmt: skip
            g[n].set(random.random())
        for p in ("rollout", "reward", "update", "sync"):
            phase.labels(p).set(random.random())
        time.sleep(0.2)


def operator() -> None:
    from prometheus_client import Counter

    from rlhf_operator import metrics as m  # the real operator metrics

    decisions = Counter("rlhf_operator_autoscale_decisions_total", "Autoscaler decisions.", ["direction"])
    while True:
        m.RECONCILES.labels("ok").inc()
        m.ERRORS.labels("ApiException").inc()
        m.LATENCY.observe(random.random() / 10)
        m.observe_phase("ns", "a", "Running")
        m.RESTARTS.inc()
        m.PODS_CREATED.inc()
        m.PODS_DELETED.inc()
        decisions.labels(random.choice(["up", "down", "none"])).inc()
        time.sleep(0.2)


if __name__ == "__main__":
    start_http_server(int(sys.argv[1]), addr="127.0.0.1")
    operator() if sys.argv[2] == "operator" else trainer(sys.argv[2])
