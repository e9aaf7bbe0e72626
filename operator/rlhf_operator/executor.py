"""One reconcile pass against the API server: read, `reconcile.plan`, write.

Synchronous and free of kopf, so tests drive it with a real API server or a fake `Kube`.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import logging
import os
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rlhf_operator import autoscaler, children, kube, metrics, reconcile
from rlhf_operator.status import rfc3339
from rlhf_trainer.autoscale import MetricError, MetricSource
from rlhf_trainer.spec import SpecError, parse_job

log = logging.getLogger("rlhf_operator")

#: Test hook: after this many pod creations the process hangs, so that a test can SIGKILL it in
#: the middle of creating a job's children. Unset in production.
_PAUSE_AFTER_CREATES = int(os.environ.get("RLHF_OPERATOR_PAUSE_AFTER_CREATES", "0"))
_creates = 0


@dataclass
class Outcome:
    """What the caller does next: nothing (`gone`), stop for good (`invalid`), or look again later."""

    requeue_after: float | None = None
    gone: bool = False
    invalid: str | None = None
    phase: str | None = None


def read_signal(source: MetricSource) -> tuple[float | None, str | None]:
    """The signal's value, or (None, why) when the endpoint cannot be read (the policy then holds)."""
    try:
        return source.read(), None
    except MetricError as err:
        return None, str(err)


class Executor:
    def __init__(
        self,
        client: kube.Kube,
        controller_metrics_url: str = autoscaler.DEFAULT_CONTROLLER_METRICS_URL,
        read: Callable[[MetricSource], tuple[float | None, str | None]] = read_signal,
    ) -> None:
        self.kube = client
        #: Template of the controller's /metrics URL for the autoscaler's direct scrape.
        self.controller_metrics_url = controller_metrics_url
        self._read = read
        # Static children already ensured, per job: (uid, digest of what was sent). A restarted
        # operator starts empty and ensures everything again (create-if-absent), so this is only a cache.
        self._ensured: dict[tuple[str, str], tuple[str, str]] = {}

    def forget(self, namespace: str, name: str) -> None:
        self._ensured.pop((namespace, name), None)

    def reconcile(self, namespace: str, name: str, now: dt.datetime | None = None) -> Outcome:
        started = time.perf_counter()
        try:
            outcome = self._reconcile(namespace, name, now or dt.datetime.now(dt.timezone.utc))
        except kube.Conflict:
            metrics.RECONCILES.labels("conflict").inc()
            return Outcome(requeue_after=0.0)
        except Exception as err:
            metrics.ERRORS.labels(type(err).__name__).inc()
            raise
        finally:
            metrics.LATENCY.observe(time.perf_counter() - started)
        metrics.RECONCILES.labels("invalid" if outcome.invalid else "ok").inc()
        metrics.observe_phase(namespace, name, None if outcome.gone else outcome.phase)
        return outcome

    def _reconcile(self, namespace: str, name: str, now: dt.datetime) -> Outcome:
        body = self.kube.get_job(namespace, name)
        if body is None or body["metadata"].get("deletionTimestamp"):
            self.forget(namespace, name)
            return Outcome(gone=True)
        body, autoscale_after, scaled = self._autoscale(body, now)
        if scaled:  # spec changed: the next pass (at once) reconciles the new count from a fresh read
            return Outcome(requeue_after=0.0, phase=(body.get("status") or {}).get("phase"))
        pods = self.kube.list_pods(namespace, name)
        plan = reconcile.plan(body, pods, now)
        if autoscale_after is not None:
            plan.requeue(autoscale_after)
        if plan.job is not None and not plan.invalid:
            self._ensure_static(plan.job)
        old = reconcile.operator_status(body.get("status") or {})
        if old != reconcile.operator_status(plan.status):
            self.kube.patch_status(body, plan.status)  # Conflict: computed from a stale view; retry
        for pod in plan.delete:
            self.kube.delete(pod)
            metrics.PODS_DELETED.inc()
        for pod in plan.create:
            if self.kube.create(pod):
                metrics.PODS_CREATED.inc()
                _test_pause_hook()
        stamp = rfc3339(now)
        for ev in plan.events:
            if ev.reason == "GangRestart":
                metrics.RESTARTS.inc()
            try:
                self.kube.event(body, ev.type, ev.reason, ev.message, stamp)
            except (kube.Retry, LookupError) as err:  # an Event is best effort
                log.warning("event %s for %s/%s not posted: %s", ev.reason, namespace, name, err)
            log.info("%s/%s: %s: %s", namespace, name, ev.reason, ev.message)
        if plan.delete_job:
            self.kube.delete(body)
            return Outcome(gone=True)
        return Outcome(requeue_after=plan.requeue_after, invalid=plan.invalid, phase=plan.status.get("phase"))

    def _autoscale(self, body: dict[str, Any], now: dt.datetime) -> tuple[dict[str, Any], float | None, bool]:
        """The autoscaler's I/O around `autoscaler` (pure): returns the job as last written, when
        to look again (None: autoscaling is off) and whether `/scale` was written."""
        status = body.get("status") or {}
        try:
            job = parse_job({k: v for k, v in body.items() if k != "status"})
        except SpecError:
            return body, None, False  # reconcile.plan reports it
        if not autoscaler.enabled(job, status.get("phase")):
            return body, None, False
        auto = dict(status.get("autoscaling") or {})
        rollout = status.get("rollout") or {}
        resharded = autoscaler.observe_reshard(auto, rollout, now)
        period = float(job.spec.autoscaling.period_seconds)
        wait = autoscaler.due_in(auto, period, now)
        if wait > 0:
            if resharded is not None:
                body = self.kube.patch_status(body, {"autoscaling": resharded})
            return body, wait, False
        signal, error = self._read(autoscaler.metric_source(job, self.controller_metrics_url))
        ev = autoscaler.evaluate(job, resharded or auto, rollout, signal, now, error)
        body = self.kube.patch_status(body, {"autoscaling": ev.status})
        metrics.AUTOSCALE_DECISIONS.labels(ev.decision.direction).inc()
        ns, name = job.namespace, job.metadata_name
        log.info("%s/%s: autoscaler: %s", ns, name, ev.message)
        if ev.replicas is None:
            return body, period, False
        self.kube.scale(body, ev.replicas)
        if ev.event_reason:
            try:
                self.kube.event(body, "Normal", ev.event_reason, ev.message, rfc3339(now))
            except (kube.Retry, LookupError) as err:  # an Event is best effort
                log.warning("event %s for %s/%s not posted: %s", ev.event_reason, ns, name, err)
        return body, period, True

    def _ensure_static(self, job: Any) -> None:
        key = (job.namespace, job.metadata_name)
        uid = job.raw["metadata"].get("uid", "")
        wanted = children.build_static_children(job, token="")
        digest = hashlib.sha256(json.dumps(wanted, sort_keys=True).encode()).hexdigest()
        if self._ensured.get(key) == (uid, digest):
            return
        token = secrets.token_urlsafe(32)
        for obj in children.build_static_children(job, token=token):
            try:
                created = self.kube.create(obj)
            except LookupError as err:  # e.g. the PodGroup CRD of the chosen gang scheduler is absent
                raise kube.Retry(f"cannot create {obj['kind']} {obj['metadata']['name']}: {err}", 30) from err
            if not created and obj["kind"] == "ConfigMap":
                self.kube.merge_patch(obj, {"data": obj["data"]})
        self._ensured[key] = (uid, digest)


def _test_pause_hook() -> None:
    global _creates
    _creates += 1
    if _PAUSE_AFTER_CREATES and _creates >= _PAUSE_AFTER_CREATES:
        log.warning(
            "RLHF_OPERATOR_PAUSE_AFTER_CREATES=%d reached: hanging until killed", _PAUSE_AFTER_CREATES
        )
        while True:
            time.sleep(3600)
