"""One reconcile pass against the API server: read, `reconcile.plan`, write.

Synchronous and free of kopf, so tests drive it with a real API server or a fake `Kube`.
"""

from __future__ import annotations

import collections
import datetime as dt
import hashlib
import json
import logging
import math
import os
import secrets
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from rlhf_api import contract, storage
from rlhf_api.autoscale import MetricError, MetricSource
from rlhf_api.fields import SpecError
from rlhf_api.status import FINISHED, rfc3339
from rlhf_operator import (
    autoscaler,
    cache,
    child_failures,
    children,
    failure_policy,
    kube,
    kueue,
    metrics,
    ownership,
    parse_cache,
    pass_state,
    reconcile,
    stuck_pods,
    tenant_limits,
)
from rlhf_operator.pass_state import Event, Plan

log = logging.getLogger("rlhf_operator")

#: Test hook: after this many pod creations the process hangs, so that a test can SIGKILL it in
#: the middle of creating a job's children. Unset in production.
_PAUSE_AFTER_CREATES = int(os.environ.get("RLHF_OPERATOR_PAUSE_AFTER_CREATES", "0"))


#: Pod creations in flight at once, over all jobs (`rlhf operator` passes it to the Executor).
CREATE_WORKERS = int(os.environ.get("RLHF_OPERATOR_CREATE_WORKERS", "16"))
#: After an autoscaler failure, its next try (the pass itself goes on).
AUTOSCALE_RETRY_SECONDS = 30.0
#: resourceVersions of its own status writes the executor remembers per job (`own_write`).
OWN_WRITES_KEPT = 8


@dataclass
class Creates:
    """What `create_all` did: how many objects it created (False from `create`: already there,
    not counted), and the first refusal in the objects' order, if any."""

    created: int = 0
    rejected: tuple[dict[str, Any], kube.Rejected] | None = None


def create_all(
    create: Callable[[dict[str, Any]], bool],
    objs: list[dict[str, Any]],
    pool: ThreadPoolExecutor | None = None,
    on_created: Callable[[], None] = lambda: None,
) -> Creates:
    """Create `objs`, in their order, up to the pool's size at once (one at a time without a
    pool). After a refusal (`kube.Rejected`) nothing more is started (the rest would most likely
    be refused too; those in flight finish). The first refusal in `objs`' order is reported;
    another error is raised once every started create has finished."""
    stop = threading.Event()
    out = Creates()

    def one(obj: dict[str, Any]) -> bool | None:
        if stop.is_set():
            return None  # not attempted
        try:
            return create(obj)
        except BaseException:  # a refusal, or an error that ends the pass
            stop.set()
            raise

    if pool is None:
        results: list[tuple[dict[str, Any], Any]] = []
        for obj in objs:
            try:
                results.append((obj, one(obj)))
            except kube.Rejected as err:
                results.append((obj, err))
                break
    else:
        futures: list[tuple[dict[str, Any], Future[bool | None]]] = [(o, pool.submit(one, o)) for o in objs]
        results = []
        for obj, fut in futures:
            failure = fut.exception()  # waits: every started create finishes before we go on
            results.append((obj, failure if failure is not None else fut.result()))
    error: BaseException | None = None
    for obj, res in results:
        if isinstance(res, kube.Rejected):
            if out.rejected is None:
                out.rejected = (obj, res)
        elif isinstance(res, BaseException):
            error = error or res
        elif res:
            out.created += 1
            on_created()
    if error is not None and out.rejected is None:
        raise error
    return out


@dataclass
class Outcome:
    """What the caller does next: nothing (`gone`), stop for good (`invalid`), or look again later."""

    requeue_after: float | None = None
    gone: bool = False
    invalid: str | None = None
    phase: str | None = None


#: The largest signal the policy is given: a bigger one (1.5e308 overflows the proportional
#: rule) counts as no data.
MAX_SIGNAL = 1e12


def read_signal(source: MetricSource) -> tuple[float | None, str | None]:
    """The signal's value, or (None, why) when the endpoint cannot be read (the policy then holds).
    Whatever the read raises or returns (the job's author controls the endpoint), the answer is a
    bounded finite number or a reason, never an exception that stops the job's pass."""
    try:
        value = source.read()
    except MetricError as err:
        return None, str(err)
    except Exception as err:  # a bug or an answer the parser did not expect: no data, not a wedge
        return None, f"the metric read failed ({type(err).__name__})"
    if value is None:
        return None, None
    if not isinstance(value, (int, float)) or not math.isfinite(value) or abs(value) > MAX_SIGNAL:
        return None, f"the signal is not a finite number of at most {MAX_SIGNAL:g}"
    return float(value), None


class Executor:
    def __init__(
        self,
        client: kube.Kube,
        controller_metrics_url: str = autoscaler.DEFAULT_CONTROLLER_METRICS_URL,
        read: Callable[[MetricSource], tuple[float | None, str | None]] = read_signal,
        prometheus_url_prefixes: Sequence[str] = (),
        prometheus_custom_queries: bool = False,
        pod_cache: cache.PodCache | None = None,
        create_workers: int = 1,
        installed_rules: parse_cache.InstalledRules | None = None,
        limits: tenant_limits.Limits | None = None,
    ) -> None:
        self.kube = client
        #: The operator's bounds on one job (`tenant_limits`).
        self.limits = limits or tenant_limits.Limits()
        #: Template of the controller's /metrics URL for the autoscaler's direct scrape.
        self.controller_metrics_url = controller_metrics_url
        #: URL prefixes a job's own Prometheus URL must lie under (see `autoscaler.refusal`).
        self.prometheus_url_prefixes = tuple(prometheus_url_prefixes)
        #: Whether a job's own PromQL is sent (`autoscaler.custom_queries_allowed`); else the templates.
        self.prometheus_custom_queries = prometheus_custom_queries
        self._read = read
        # Static children already ensured, per job: (uid, digest of what was sent). A restarted
        # operator starts empty and ensures everything again (create-if-absent), so this is only a cache.
        self._ensured: dict[tuple[str, str], tuple[str, str, str]] = {}
        #: The watch-fed pods of each job (None: list them on every pass).
        self.pod_cache = pod_cache
        #: Whether the API server enforces the CRD's rules (None: evaluate them on every parse).
        self.installed_rules = installed_rules
        #: Stages of the pass running in this thread, with debug logging (`_mark`).
        self._trace = threading.local()
        self._trace.marks = None
        #: Per job, the resourceVersions its passes' status writes produced (`own_write`).
        self._own_writes: dict[tuple[str, str], collections.deque[str]] = {}
        self._own_lock = threading.Lock()
        #: Pods of a pass are created this many at once (shared by every job's passes).
        self._create_pool = (
            ThreadPoolExecutor(create_workers, thread_name_prefix="rlhf-create")
            if create_workers > 1
            else None
        )

    def forget(self, namespace: str, name: str, uid: str | None = None) -> None:
        """Drop what is remembered of a job (None: whichever UID): its children cache and its
        series of the operator's metrics, so that the jobs-by-phase gauge (and the alerts on it)
        no longer count a deleted job."""
        key = (namespace, name)
        parse_cache.forget(namespace, name, uid)
        with self._own_lock:
            self._own_writes.pop(key, None)
        if uid is None or self._ensured.get(key, ("",))[0] == uid:
            self._ensured.pop(key, None)
            if self.pod_cache is not None:
                self.pod_cache.forget(namespace, name)
        metrics.forget_job(namespace, name, uid)

    def release_orphan(self, pod: dict[str, Any]) -> None:
        """Release the Kueue pod group of `pod` when its job is gone (`kueue.orphaned`): deleting a
        job (or its namespace) deletes its pods through the garbage collector, with no reconcile
        to release them first, and Kueue would hold their quota and their finalizers for good.
        Called for each pod watch event; reads the job only for a pod `kueue.maybe_orphaned`."""
        if not kueue.maybe_orphaned(pod):
            return
        meta = pod["metadata"]
        job = self.kube.get_job(
            meta.get("namespace", ""), (meta.get("labels") or {}).get(contract.JOB_NAME, "")
        )
        if kueue.orphaned(pod, job):
            try:
                self.kube.patch_metadata(pod, kueue.RELEASE_PATCH["metadata"])
            except kube.Rejected as err:  # e.g. RBAC without pods/patch
                log.warning(
                    "%s/%s: Kueue group of a deleted job not released: %s",
                    meta.get("namespace"),
                    meta["name"],
                    err,
                )

    def own_write(self, namespace: str, name: str, resource_version: str | None) -> bool:
        """Whether the job at `resource_version` is what one of this executor's status writes made
        of it. Its watch event then tells a pass nothing it did not know: the write is conditional
        on the resourceVersion the pass read (so nobody else's change is folded in), and what it
        wrote is what the pass computed. The operator does not wake the job's daemon for it."""
        if not resource_version:
            return False
        with self._own_lock:
            return resource_version in self._own_writes.get((namespace, name), ())

    def _patch_status(self, body: dict[str, Any], status: dict[str, Any]) -> dict[str, Any]:
        """`kube.patch_status`, remembering the resourceVersion it produced (`own_write`)."""
        return self._remember(self.kube.patch_status(body, status))

    def _remember(self, out: dict[str, Any]) -> dict[str, Any]:
        """The job as one of this executor's writes left it, its resourceVersion remembered."""
        meta = (out or {}).get("metadata") or {}
        version = meta.get("resourceVersion")
        if version:
            key = (str(meta.get("namespace") or ""), str(meta.get("name") or ""))
            with self._own_lock:
                self._own_writes.setdefault(key, collections.deque(maxlen=OWN_WRITES_KEPT)).append(
                    str(version)
                )
        return out

    def reconcile(
        self, namespace: str, name: str, now: dt.datetime | None = None, uid: str | None = None
    ) -> Outcome:
        """One pass over the job `namespace/name`; with `uid`, only that incarnation of it (a job
        of the same name with another UID is someone else's: the caller's job is gone)."""
        started = time.perf_counter()
        self._trace.marks = [] if log.isEnabledFor(logging.DEBUG) else None
        try:
            outcome = self._reconcile(namespace, name, now or dt.datetime.now(dt.timezone.utc), uid)
        except kube.Conflict:
            metrics.RECONCILES.labels("conflict").inc()
            return Outcome(requeue_after=0.0)
        except Exception as err:
            metrics.ERRORS.labels(type(err).__name__).inc()
            raise
        finally:
            metrics.LATENCY.observe(time.perf_counter() - started)
            self._log_trace(namespace, name, started)
        metrics.RECONCILES.labels("invalid" if outcome.invalid else "ok").inc()
        if not outcome.gone:
            metrics.observe_phase(namespace, name, outcome.phase, uid)
        return outcome

    def _mark(self, what: str) -> None:
        """With debug logging: the end of a stage of the pass (`_log_trace` reports them)."""
        marks = getattr(self._trace, "marks", None)
        if marks is not None:
            marks.append((what, time.perf_counter()))

    def _log_trace(self, namespace: str, name: str, started: float) -> None:
        marks, self._trace.marks = self._trace.marks, None
        if marks is None:
            return
        parts, last = [], started
        for what, at in marks:
            parts.append(f"{what} {1000 * (at - last):.0f}")
            last = at
        total = 1000 * (time.perf_counter() - started)
        log.debug("%s/%s: pass %.0f ms (%s)", namespace, name, total, ", ".join(parts) or "-")

    def _claims(
        self, body: dict[str, Any], admitted: bool
    ) -> dict[str, list[str] | None] | pass_state.ClaimsForbidden | None:
        """The access modes of the claims several of the job's pods write (`storage.shared_claims`),
        read only while its gang is to be created (Pending, Restarting: `reconcile.shared_storage`);
        a bound claim's are its volume's (status), an unbound one's what it asks for (spec).
        `ClaimsForbidden` where the API server refuses the read (HTTP 403: the operator's RBAC
        lacks `get` on persistentvolumeclaims), which the pass reports as the job's condition
        (a Retry would fail the whole pass every few seconds, with nothing on the job)."""
        if (body.get("status") or {}).get("phase", "Pending") not in ("Pending", "Restarting"):
            return None
        try:
            job = parse_cache.parse(body, admitted=admitted)
        except SpecError:
            return None  # the pass reports it
        ns = str(body["metadata"].get("namespace") or "")
        out: dict[str, list[str] | None] = {}
        for shared in storage.shared_claims(job.spec, job.metadata_name):
            try:
                pvc = self.kube.get(
                    {
                        "apiVersion": "v1",
                        "kind": "PersistentVolumeClaim",
                        "metadata": {"namespace": ns, "name": shared.claim},
                    }
                )
            except kube.Rejected as err:
                if err.code != 403:
                    raise
                return pass_state.ClaimsForbidden(ns, shared.claim, err.server_message)
            if pvc is None:
                out[shared.claim] = None
                continue
            modes = (
                (pvc.get("status") or {}).get("accessModes")
                or (pvc.get("spec") or {}).get("accessModes")
                or []
            )
            out[shared.claim] = [str(m) for m in modes]
        return out

    def _reconcile(self, namespace: str, name: str, now: dt.datetime, uid: str | None = None) -> Outcome:
        body = self.kube.get_job(namespace, name)
        self._mark("get")
        if (
            body is None
            or body["metadata"].get("deletionTimestamp")
            or (uid is not None and body["metadata"].get("uid") != uid)
        ):
            self.forget(namespace, name, uid)
            return Outcome(gone=True)
        admitted = self.installed_rules is not None and self.installed_rules.enforced()
        body, autoscale_after, scaled, autoscaled = self._autoscale_guarded(body, now, admitted)
        if scaled:  # spec changed: the next pass (at once) reconciles the new count from a fresh read
            return Outcome(requeue_after=0.0, phase=(body.get("status") or {}).get("phase"))
        self._mark("parse/autoscale")
        pods = self._pods(namespace, name)
        self._mark("pods")
        claims = self._claims(body, admitted)
        plan = reconcile.plan(body, pods, now, admitted, self.limits, claims)
        self._mark(f"plan[{plan.status.get('phase')}]")
        if autoscale_after is not None:
            plan.requeue(autoscale_after)
        rejection: failure_policy.Rejection | None = None
        if plan.job is not None and not plan.invalid and plan.status.get("phase") not in FINISHED:
            rejection = self._ensure_static(plan.job, parse_cache.digest(body))
            self._mark("static")
        old = pass_state.operator_status(body.get("status") or {})
        if old != pass_state.operator_status(plan.status) or autoscaled:
            # One write for the pass and the autoscaler. Conflict: computed from a stale view; retry.
            body = self._patch_status(body, {**plan.status, **(autoscaled or {})})
            self._mark("status")
        if plan.record is not None:  # the restart record, before any pod of the attempt exists
            body = self._remember(self.kube.patch_job_annotations(body, plan.record))
        for pod in plan.release:  # before the deletions: Kueue finishes the group once they stop
            try:
                self.kube.patch_metadata(pod, kueue.RELEASE_PATCH["metadata"])
            except kube.Rejected as err:  # e.g. RBAC without pods/patch: quota held until deletion
                log.warning(
                    "%s/%s: Kueue group of pod %s not released: %s",
                    namespace,
                    name,
                    pod["metadata"]["name"],
                    err,
                )
        for pod in plan.delete:
            self.kube.delete(pod)
            metrics.PODS_DELETED.inc()
        self._force_delete_stuck(body, pods, now, plan)
        attempted = bool(plan.create) and rejection is None
        if attempted:
            done = create_all(_test_pause_gate(self.kube.create), plan.create, self._create_pool, _created)
            self._mark(f"create[{done.created}]")
            if done.rejected is not None:  # reported below; the other pods would most likely fail too
                rejection = _rejection(*done.rejected)
        if rejection is None and plan.blocked:
            rejection = plan.blocked[0]
        report = child_failures.report_children(plan.status, rejection, attempted, now)
        if report.status is not None:
            body = self._patch_status(body, report.status)
            plan.status.update(report.status)
        plan.events.extend(report.events)
        if report.requeue_after is not None:
            plan.requeue(report.requeue_after)
        stamp = rfc3339(now)
        for ev in plan.events:
            if ev.reason == "GangRestart":
                metrics.RESTARTS.inc()
            try:
                self.kube.event(body, ev.type, ev.reason, ev.message, stamp)
            except (kube.Retry, LookupError) as err:  # an Event is best effort
                log.warning("event %s for %s/%s not posted: %s", ev.reason, namespace, name, err)
            log.info("%s/%s: %s: %s", namespace, name, ev.reason, ev.message)
        if plan.events:
            self._mark(f"events[{len(plan.events)}]")
        if plan.delete_job:
            self.kube.delete(body)
            return Outcome(gone=True)
        return Outcome(requeue_after=plan.requeue_after, invalid=plan.invalid, phase=plan.status.get("phase"))

    def _force_delete_stuck(
        self, body: dict[str, Any], pods: list[dict[str, Any]], now: dt.datetime, plan: Plan
    ) -> None:
        """The job's pods stuck Terminating on a node that is not Ready (`stuck_pods`): deleted
        with no grace, so the names the next attempt needs are free again."""
        owned = ownership.split(pods, body["metadata"].get("uid", ""))[0]
        stuck, wake = stuck_pods.find(owned, now, lambda node: self.kube.get_path(f"/api/v1/nodes/{node}"))
        for s in stuck:
            self.kube.delete(s.pod, grace_period_seconds=0)
            metrics.PODS_DELETED.inc()
            plan.events.append(Event("Warning", "PodForceDeleted", s.message))
        if stuck:
            plan.requeue(1.0)  # the names are free: create the next attempt's pods soon
        if wake is not None:
            plan.requeue(wake)

    def _pods(self, namespace: str, name: str) -> list[dict[str, Any]]:
        """The job's pods: from the watch-fed cache, or a LIST that seeds it (first pass of the
        job, then every `relist_seconds`)."""
        if self.pod_cache is None:
            return self.kube.list_pods(namespace, name)
        cached = self.pod_cache.pods(namespace, name)
        if cached is not None:
            return cached
        listed, version = self.kube.list_pods_versioned(namespace, name)
        # The merge itself, not a second read: with `relist_seconds` 0 (or a seed older than it by
        # the time of that read) the read says "list again" (None), and `or []` made the pass see
        # a job without pods (in Running: every gang pod "missing", a gang restart).
        return self.pod_cache.seed(namespace, name, listed, version)

    def _autoscale_guarded(
        self, body: dict[str, Any], now: dt.datetime, admitted: bool = False
    ) -> tuple[dict[str, Any], float | None, bool, dict[str, Any] | None]:
        """`_autoscale`, whose failure (other than the API's own retry signals) skips the
        autoscaler for this pass instead of ending it: the job's suspend, TTL and restarts do not
        wait on its metrics."""
        try:
            return self._autoscale(body, now, admitted)
        except (kube.Conflict, kube.Retry):
            raise
        except Exception as err:
            meta = body.get("metadata") or {}
            log.warning(
                "%s/%s: autoscaler skipped this pass: %r", meta.get("namespace"), meta.get("name"), err
            )
            return body, AUTOSCALE_RETRY_SECONDS, False, None

    def _autoscale(
        self, body: dict[str, Any], now: dt.datetime, admitted: bool = False
    ) -> tuple[dict[str, Any], float | None, bool, dict[str, Any] | None]:
        """The autoscaler's I/O around `autoscaler` (pure): returns the job as last written, when
        to look again (None: autoscaling is off), whether `/scale` was written, and the status
        patch it leaves to the pass's own status write (`status.autoscaling` alone: one write
        instead of two; a condition it sets, or a `/scale`, is written at once)."""
        status = body.get("status") or {}
        try:
            job = parse_cache.parse(body, admitted)
        except SpecError:
            return body, None, False, None  # reconcile.plan reports it
        if not autoscaler.enabled(job, status.get("phase")):
            return body, None, False, None
        auto = dict(status.get("autoscaling") or {})
        rollout = status.get(contract.STATUS_ROLLOUT) or {}
        resharded = autoscaler.observe_reshard(auto, rollout, now)
        period = float(job.spec.autoscaling.period_seconds)
        wait = autoscaler.due_in(auto, period, now)
        if wait > 0:
            return body, wait, False, None if resharded is None else {"autoscaling": resharded}
        prefixes = self.prometheus_url_prefixes
        custom = self.prometheus_custom_queries
        source = autoscaler.metric_source(job, self.controller_metrics_url, prefixes, custom)
        signal, error = self._read(source)
        ev = autoscaler.evaluate(job, resharded or auto, rollout, signal, now, error)
        refused = autoscaler.refusal(job, prefixes, custom)
        conditions = autoscaler.refusal_conditions(list(status.get("conditions") or []), refused, now)
        patch: dict[str, Any] = {"autoscaling": ev.status}
        if conditions is None and ev.replicas is None:
            metrics.AUTOSCALE_DECISIONS.labels(ev.decision.direction).inc()
            log.info("%s/%s: autoscaler: %s", job.namespace, job.metadata_name, ev.message)
            return body, period, False, patch
        if conditions is not None:
            patch["conditions"] = conditions
        body = self._patch_status(body, patch)
        metrics.AUTOSCALE_DECISIONS.labels(ev.decision.direction).inc()
        ns, name = job.namespace, job.metadata_name
        if refused is not None and conditions is not None:
            log.warning("%s/%s: %s", ns, name, refused)
            self._event(body, "Warning", "PrometheusRefused", refused, now)
        log.info("%s/%s: autoscaler: %s", ns, name, ev.message)
        if ev.replicas is None:
            return body, period, False, None
        self.kube.scale(body, ev.replicas)
        if ev.event_reason:
            self._event(body, "Normal", ev.event_reason, ev.message, now)
        return body, period, True, None

    def _event(self, body: dict[str, Any], type_: str, reason: str, message: str, now: dt.datetime) -> None:
        try:
            self.kube.event(body, type_, reason, message, rfc3339(now))
        except (kube.Retry, LookupError) as err:  # an Event is best effort
            meta = body.get("metadata") or {}
            log.warning(
                "event %s for %s/%s not posted: %s", reason, meta.get("namespace"), meta.get("name"), err
            )

    def _ensure_static(self, job: Any, source: str) -> failure_policy.Rejection | None:
        """Create-if-absent the job's static children; the first one the API server refuses, or
        whose name is held by an object this job does not own (then the pods, which need them,
        are not created this pass: a foreign ServiceAccount's token or Secret is never used).

        `source` is the digest of the job the children are built from (`parse_cache.digest`): while it
        is the one last ensured, nothing is built (building the ConfigMap's YAML costs more than
        the rest of a pass); when it moved, the children are built and compared with those last
        ensured."""
        key = (job.namespace, job.metadata_name)
        uid = job.raw["metadata"].get("uid", "")
        last = self._ensured.get(key)
        if last is not None and last[:2] == (uid, source):
            return None
        wanted = children.build_static_children(job, token="")
        digest = hashlib.sha256(json.dumps(wanted, sort_keys=True).encode()).hexdigest()
        if last is not None and last[0] == uid and last[2] == digest:
            self._ensured[key] = (uid, source, digest)
            return None
        token = secrets.token_urlsafe(32)
        wanted = children.build_static_children(job, token=token)
        # Ensured at once on the create pool (a first pass used to wait for seven round trips in a
        # row), in waves: the API server refuses a RoleBinding whose Role does not exist yet (its
        # escalation check resolves the roleRef: 404), so kinds in `_CREATED_AFTER` wait for the
        # first wave. The first problem in the objects' order is the one reported; one at a time
        # without a pool, stopping at the first problem.
        found: list[failure_policy.Rejection | None] = []
        if self._create_pool is None:
            for obj in wanted:
                found.append(self._ensure_one(obj, job.namespace, uid))
                if found[-1] is not None:
                    break
        else:
            first = [o for o in wanted if o["kind"] not in _CREATED_AFTER]
            results: dict[int, failure_policy.Rejection | None] = {}
            for wave in (first, [o for o in wanted if o["kind"] in _CREATED_AFTER]):
                futures = [
                    self._create_pool.submit(self._ensure_one, obj, job.namespace, uid) for obj in wave
                ]
                error = next((e for e in [f.exception() for f in futures] if e is not None), None)  # waits
                if error is not None:
                    raise error
                results.update((id(obj), f.result()) for obj, f in zip(wave, futures))
                found = [results[id(o)] for o in wanted if id(o) in results]  # in the objects' order
                if any(p is not None for p in found):
                    break
        problem = next((p for p in found if p is not None), None)
        if problem is not None:
            return problem
        self._ensured[key] = (uid, source, digest)
        return None

    def _ensure_one(self, obj: dict[str, Any], namespace: str, uid: str) -> failure_policy.Rejection | None:
        """Create-if-absent one static child (see `_ensure_static`)."""
        try:
            created = self.kube.create(obj)
        except LookupError as err:  # e.g. the PodGroup CRD of the chosen gang scheduler is absent
            raise kube.Retry(f"cannot create {obj['kind']} {obj['metadata']['name']}: {err}", 30) from err
        except kube.Rejected as err:
            return _rejection(obj, err)
        if created or obj["kind"] == "Secret":
            # The operator may not read Secrets; the Secret's name carries the job's UID, so no
            # Secret can have held it before the job existed (see contract.ray_token_secret_name).
            return None
        existing = self.kube.get(obj)
        if existing is None:  # deleted since: the next pass creates it
            raise kube.Retry(f"{obj['kind']} {obj['metadata']['name']} vanished while being ensured", 1)
        if not ownership.owned_by(existing, uid):
            log.warning(
                "%s %s/%s is not owned by job uid %s", obj["kind"], namespace, obj["metadata"]["name"], uid
            )
            return ownership.not_owned(existing, uid)
        if obj["kind"] == "ConfigMap":
            self.kube.merge_patch(obj, {"data": obj["data"]})
        return None


#: Static children created only once the first wave exists: a RoleBinding names its Role.
_CREATED_AFTER = frozenset({"RoleBinding"})


def _rejection(obj: dict[str, Any], err: kube.Rejected) -> failure_policy.Rejection:
    log.warning("create of %s %s refused: %s", obj["kind"], obj["metadata"]["name"], err)
    return failure_policy.Rejection(obj["kind"], obj["metadata"]["name"], err.code, err.server_message)


def _created() -> None:
    metrics.PODS_CREATED.inc()


_gate_lock = threading.Lock()
_started_creates = 0


def _test_pause_gate(create: Callable[[dict[str, Any]], bool]) -> Callable[[dict[str, Any]], bool]:
    """`RLHF_OPERATOR_PAUSE_AFTER_CREATES=N` (tests of a killed operator): exactly N pods are
    created, then every further create hangs until the process is killed. A gate before each
    create, so that the creates running in parallel stop at the same count."""
    if not _PAUSE_AFTER_CREATES:
        return create

    def gated(obj: dict[str, Any]) -> bool:
        global _started_creates
        with _gate_lock:
            _started_creates += 1
            over = _started_creates > _PAUSE_AFTER_CREATES
        if over:
            log.warning(
                "RLHF_OPERATOR_PAUSE_AFTER_CREATES=%d reached: hanging until killed", _PAUSE_AFTER_CREATES
            )
            while True:
                time.sleep(3600)
        return create(obj)

    return gated
