"""Operator Prometheus metrics (prefix `rlhf_operator_`), served by `rlhf operator --metrics-port`."""

from __future__ import annotations

import threading
from collections import Counter as _Tally

from prometheus_client import Counter, Gauge, Histogram

from rlhf_api.status import PHASES

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
STATUS_POLICY_INSTALLED = Gauge(
    "rlhf_operator_status_policy_installed",
    "1 when the chart's status-writers ValidatingAdmissionPolicy and its binding are installed, else 0.",
)

#: The last phase of each job the operator drives: (namespace, name) -> (uid, phase).
_phases: dict[tuple[str, str], tuple[str | None, str]] = {}
#: Passes record phases from many threads (the pass pool) while others tally them.
_phases_lock = threading.Lock()


def observe_phase(namespace: str, name: str, phase: str | None, uid: str | None = None) -> None:
    """Record a job's phase (None: the job is gone) and refresh the jobs-by-phase gauge."""
    key = (namespace, name)
    with _phases_lock:
        if phase is None:
            _phases.pop(key, None)
        else:
            _phases[key] = (uid, phase)
        _refresh()


def forget_job(namespace: str, name: str, uid: str | None = None) -> None:
    """The job is gone (or its daemon stopped): it no longer counts in `rlhf_operator_jobs`, so
    `RLHFJobFailed` clears once a failed job is deleted. With `uid`, only that incarnation (a job
    recreated under the same name keeps its series)."""
    key = (namespace, name)
    with _phases_lock:
        recorded = _phases.get(key)
        if recorded is not None and (uid is None or recorded[0] in (uid, None)):
            del _phases[key]
        _refresh()


def jobs_by_phase() -> dict[str, int]:
    """What `rlhf_operator_jobs` reports, by phase (every phase, zeros included)."""
    tally = _Tally(phase for _, phase in list(_phases.values()))  # a copy: see `_phases_lock`
    return {p: tally.get(p, 0) for p in PHASES}


def _refresh() -> None:
    for p, n in jobs_by_phase().items():
        JOBS.labels(p).set(n)
