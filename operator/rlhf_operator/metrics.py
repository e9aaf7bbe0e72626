"""Operator Prometheus metrics (prefix `rlhf_operator_`), served by `rlhf operator --metrics-port`."""

from __future__ import annotations

from collections import Counter as _Tally

from prometheus_client import Counter, Gauge, Histogram

from rlhf_operator.status import PHASES

RECONCILES = Counter("rlhf_operator_reconciles_total", "Reconcile passes, by result.", ["result"])
ERRORS = Counter(
    "rlhf_operator_reconcile_errors_total", "Reconcile passes that raised, by error kind.", ["kind"]
)
LATENCY = Histogram(
    "rlhf_operator_reconcile_duration_seconds",
    "Wall time of one reconcile pass (API calls included).",
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
)
JOBS = Gauge("rlhf_operator_jobs", "RLTrainingJobs by phase.", ["phase"])
RESTARTS = Counter("rlhf_operator_gang_restarts_total", "Gang restarts the operator started.")
PODS_CREATED = Counter("rlhf_operator_pods_created_total", "Pods created.")
PODS_DELETED = Counter("rlhf_operator_pods_deleted_total", "Pods deleted.")
AUTOSCALE_DECISIONS = Counter(
    "rlhf_operator_autoscale_decisions_total",
    "Evaluations of the rollout autoscaling policy, by direction (up, down, none).",
    ["direction"],
)

_phases: dict[tuple[str, str], str] = {}


def observe_phase(namespace: str, name: str, phase: str | None) -> None:
    """Record a job's phase (None: the job is gone) and refresh the jobs-by-phase gauge."""
    key = (namespace, name)
    if phase is None:
        _phases.pop(key, None)
    else:
        _phases[key] = phase
    tally = _Tally(_phases.values())
    for p in PHASES:
        JOBS.labels(p).set(tally.get(p, 0))
