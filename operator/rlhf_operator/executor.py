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
from dataclasses import dataclass
from typing import Any

from rlhf_operator import children, kube, metrics, reconcile
from rlhf_operator.status import rfc3339

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


class Executor:
    def __init__(self, client: kube.Kube) -> None:
        self.kube = client
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
        pods = self.kube.list_pods(namespace, name)
        plan = reconcile.plan(body, pods, now)
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
