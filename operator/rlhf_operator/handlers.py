"""kopf wiring: thin handlers around `executor.Executor` (which runs `reconcile.plan`).

One daemon per RLTrainingJob runs reconcile passes. Watch events on the job or on its pods only
wake that daemon; bursts of events (a gang of pods starting) coalesce into one pass, and a pass
always starts from a fresh read, so nothing depends on seeing every event (level-based). The
event of a pass's own status write wakes nobody (`Executor.own_write`: that pass knew all it
says). The daemon also wakes on its own after the plan's `requeue_after` (backoff, timeouts, TTL) or the
resync period.

No finalizer: the operator has nothing to clean up when a job goes (its children carry owner
references, and the garbage collector removes them), so deleting a job, or its namespace, must
not wait for a running operator. kopf puts a finalizer on every object a daemon serves (to stop
the daemon before the object disappears); this module opts its daemon out (`_without_finalizer`)
and stops the daemon itself instead: a pass that finds the job gone, or a job of the same name
with another UID (deleted and recreated), ends it. kopf removes the finalizer of earlier releases
(`FINALIZER`, still its configured name) from existing jobs, as no handler requires it.

Imported only by `rlhf operator` (it registers handlers with kopf at import time).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import logging
import os
import random
from typing import Any

import kopf

from rlhf_api.contract import FINALIZER, GROUP, JOB_NAME, PLURAL, VERSION
from rlhf_operator import (
    autoscaler,
    cache,
    crd,
    images,
    kube,
    kueue,
    metrics,
    parse_cache,
    safe_json,
    status_policy,
    tenant_limits,
)
from rlhf_operator.executor import CREATE_WORKERS, Executor

#: Upper bound between two passes of a job even when nothing happens (drift repair).
RESYNC_SECONDS = float(os.environ.get("RLHF_OPERATOR_RESYNC_SECONDS", "300"))
#: Collect a burst of watch events for this long before a pass.
DEBOUNCE_SECONDS = float(os.environ.get("RLHF_OPERATOR_DEBOUNCE_SECONDS", "0.2"))
#: Passes running at once, over all jobs, each in a thread of its own pool: not the event loop's
#: default executor (min(32, CPUs + 4) threads, 6 on a 2-core node), which aiohttp's DNS lookups
#: for kopf's own connections share, and which a burst of new jobs' first passes filled.
PASS_WORKERS = int(os.environ.get("RLHF_OPERATOR_PASS_WORKERS", "16"))

#: Template of the controller pod's /metrics URL the autoscaler scrapes when a job names no
#: Prometheus (`{job}`, `{namespace}` substituted); set by `rlhf operator --controller-metrics-url`.
CONTROLLER_METRICS_URL_ENV = "RLHF_OPERATOR_CONTROLLER_METRICS_URL"

#: Wake-up of each job's daemon, by (namespace, name) and then UID: a job deleted and recreated
#: under the same name briefly has two daemons, the old one about to find its job gone.
_wake: dict[tuple[str, str], dict[str, asyncio.Event]] = {}
_executor: Executor | None = None
_passes: concurrent.futures.ThreadPoolExecutor | None = None
#: The pods of every job, fed by the pod watch below: a pass reads them from here (`cache`).
_pods = cache.PodCache(relist_seconds=float(os.environ.get("RLHF_OPERATOR_RELIST_SECONDS", "300")))

log = logging.getLogger(__name__)
# A job nested too deep must not end the watch (and the process) for every tenant.
safe_json.install_into_kopf()


def _get_executor() -> Executor:
    global _executor, _passes
    if _passes is None:
        _passes = concurrent.futures.ThreadPoolExecutor(PASS_WORKERS, thread_name_prefix="rlhf-pass")
    if _executor is None:
        url = os.environ.get(CONTROLLER_METRICS_URL_ENV) or autoscaler.DEFAULT_CONTROLLER_METRICS_URL
        prefixes = autoscaler.prometheus_url_prefixes(os.environ)
        # One pooled connection per thread that calls the API (the client's default is 5 per CPU:
        # the rest opened a fresh TLS connection for each request, and dropped it).
        client = kube.Kube(pool_size=PASS_WORKERS + CREATE_WORKERS)
        _executor = Executor(
            client,
            controller_metrics_url=url,
            prometheus_url_prefixes=prefixes,
            prometheus_custom_queries=autoscaler.custom_queries_allowed(os.environ),
            pod_cache=_pods,
            create_workers=CREATE_WORKERS,
            limits=tenant_limits.Limits.from_env(os.environ),
            installed_rules=parse_cache.InstalledRules(
                lambda: client.crd_annotations(crd.CRD_NAME),
                recheck_seconds=float(os.environ.get("RLHF_OPERATOR_CRD_RECHECK_SECONDS", "60")),
            ),
        )
    return _executor


def _wake_job(namespace: str | None, name: str | None) -> None:
    for ev in list(_wake.get((namespace or "", name or ""), {}).values()):
        ev.set()


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
    settings.persistence.finalizer = FINALIZER
    # Reconnect watches that went quiet (a half-open TCP connection would otherwise hang forever).
    settings.watching.server_timeout = int(os.environ.get("RLHF_OPERATOR_WATCH_SERVER_TIMEOUT", "300"))
    settings.watching.client_timeout = settings.watching.server_timeout + 30
    settings.watching.connect_timeout = 30
    # kopf runs one worker per watched object (each job, each pod) and keeps it `idle_timeout`
    # after the object's last event. Capped at 32 with kopf's 5 s idle time, a burst of new pods
    # (10 jobs: 110 objects) waited for idle workers to expire: the operator saw pod events 3 to 4 s
    # late (operator_scale.py). Our handlers only wake a daemon, so workers are cheap and short-lived.
    limit = int(os.environ.get("RLHF_OPERATOR_WORKER_LIMIT", "0"))
    settings.queueing.worker_limit = limit or None  # 0: no limit
    settings.queueing.idle_timeout = float(os.environ.get("RLHF_OPERATOR_WORKER_IDLE_SECONDS", "1"))
    settings.posting.level = logging.WARNING  # our own Events carry the transitions
    # kopf pauses *every* operator when peers share a priority, so each replica draws its own:
    # the highest is active, the others stand by until its peering record expires.
    settings.peering.priority = int(os.environ.get("RLHF_OPERATOR_PRIORITY") or random.randint(1, 2**30))
    settings.peering.lifetime = int(os.environ.get("RLHF_OPERATOR_PEERING_LIFETIME", "60"))
    settings.peering.stealth = True  # no log line per keep-alive
    from kubernetes import config

    try:
        config.load_incluster_config()
    except config.ConfigException:
        config.load_kube_config()
    # Which rules the API server enforces (`parse_cache.InstalledRules`), read before any job is served:
    # otherwise the first passes of a burst of new jobs all waited for that read.
    rules = _get_executor().installed_rules
    if rules is not None:
        rules.enforced()
    _report_startup(_get_executor().kube)


def _report_startup(client: Any) -> None:
    """Say what the operator works with: its default trainer image, and whether the status-writers
    policy guards the status keys it owns (`status_policy`)."""
    image = images.default_image()
    if image:
        log.info("default trainer image (jobs without spec.image): %s", image)
    else:
        log.warning("no default trainer image (%s unset): jobs must set spec.image", images.ENV_TRAINER_IMAGE)
    try:
        state = status_policy.check(status_policy.policy_name(), client.get_path)
    except kube.Retry as err:
        state = status_policy.PolicyState(False, f"cannot read the status-writers policy ({err})")
    status_policy.report(state, metrics.STATUS_POLICY_INSTALLED)


@kopf.on.probe(id="jobs")
def jobs_probe(**_: Any) -> int:
    """Readiness detail on the liveness endpoint: how many jobs this operator drives."""
    return sum(len(daemons) for daemons in _wake.values())


@kopf.on.event(GROUP, VERSION, PLURAL)
async def job_event(
    name: str | None, namespace: str | None, meta: kopf.Meta, type: str | None, **_: Any
) -> None:
    own = _executor is not None and _executor.own_write(
        namespace or "", name or "", meta.get("resourceVersion")
    )
    if own and type != "DELETED":
        return  # the echo of a pass's own status write: that pass knew all it says
    _wake_job(namespace, name)


@kopf.on.event("v1", "pods", labels={JOB_NAME: kopf.PRESENT})
async def pod_event(
    namespace: str | None, labels: kopf.Labels, event: kopf.RawEvent, type: str | None, **_: Any
) -> None:
    pod: Any = event.get("object")
    if isinstance(pod, dict):
        _pods.observe(type, pod)
    # First: the look-up below is an API call that may fail, and a live job's pass needs no wait.
    _wake_job(namespace, labels.get(JOB_NAME))
    if isinstance(pod, dict) and type != "DELETED" and kueue.maybe_orphaned(pod):
        # Its job may be gone: no pass releases it. On the pass pool, not the loop's default
        # executor (kopf's DNS lookups): a namespace's deletion brings an event for each pod.
        executor = _get_executor()
        try:
            await asyncio.get_running_loop().run_in_executor(_passes, executor.release_orphan, pod)
        except kube.Retry as err:  # the next event of the pod (or kopf's relist) tries again
            log.warning("%s/%s: orphan check failed: %s", namespace, pod["metadata"].get("name"), err)


@kopf.daemon(GROUP, VERSION, PLURAL, cancellation_backoff=1.0, cancellation_timeout=10.0)
async def job_worker(
    name: str, namespace: str | None, uid: str | None, stopped: kopf.DaemonStopped, **_: Any
) -> None:
    """Reconcile one job until it is deleted (or the operator stops, or another one takes over)."""
    namespace = namespace or ""
    key = (namespace, name)
    uid = uid or ""
    wake = _wake.setdefault(key, {}).setdefault(uid, asyncio.Event())
    executor = _get_executor()
    try:
        while not stopped:
            wake.clear()
            try:
                loop = asyncio.get_running_loop()
                outcome = await loop.run_in_executor(_passes, executor.reconcile, namespace, name, None, uid)
            except kube.Retry as err:
                raise kopf.TemporaryError(str(err), delay=err.delay) from err
            if outcome.gone:
                return
            if outcome.invalid:
                # The job's status already names the problem. Not kopf.PermanentError: that would
                # end this daemon for good, and a corrected spec (which wakes us) must be picked up.
                log.warning("job %s/%s has an invalid spec: %s", namespace, name, outcome.invalid)
            timeout = (
                RESYNC_SECONDS
                if outcome.requeue_after is None or outcome.invalid
                else min(outcome.requeue_after, RESYNC_SECONDS)
            )
            if timeout > 0:
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(wake.wait(), timeout=timeout)
                if DEBOUNCE_SECONDS:
                    await asyncio.sleep(DEBOUNCE_SECONDS)  # coalesce the rest of a burst of events
    finally:
        daemons = _wake.get(key, {})
        if daemons.get(uid) is wake:
            del daemons[uid]
        if not daemons:
            _wake.pop(key, None)
        executor.forget(namespace, name, uid)


def _without_finalizer(fn: Any) -> None:
    """Mark the kopf daemon of `fn` as needing no finalizer (see the module's docstring).

    kopf has no public switch for this (nolar/kopf#833, #896); its handlers are frozen
    dataclasses in the default registry, so the handler is replaced by a copy. A unit test checks
    that no registered handler requires a finalizer, so a kopf release that moves this fails it."""
    spawning = kopf.get_default_registry()._spawning
    spawning._handlers = [
        dataclasses.replace(h, requires_finalizer=False) if getattr(h, "fn", None) is fn else h
        for h in spawning._handlers
    ]


_without_finalizer(job_worker)
