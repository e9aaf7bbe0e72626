"""The operator's parse of a job, remembered: `parse(body)` is `rlhf_api.loader.parse_job` of the job without
its status, computed once per distinct job rather than on every pass.

`parse_job` evaluates every rule of the CRD (its OpenAPI schema and CEL rules, interpreted in
Python) before building the typed spec: about a third of a second of CPU for a typical job, where
the rest of a pass is milliseconds. A pass used to parse twice (the autoscaler, then the
reconcile), and a burst of pod events runs many passes of an unchanged job. The result depends
only on the job without its status, so the last parse of each job (namespace, name, UID) is kept
with the digest of what it parsed (the job without `resourceVersion` and `managedFields`, which
every status write moves), and reused while the digest holds: one entry per job (about 20 KiB),
dropped by `forget` when the job goes. An invalid spec is remembered too (its errors). The jobs
returned are shared: callers only read them.

Most of a parse is that rule evaluation, and the API server has already done it on every job the
operator reads, when the installed CRD is the one this operator generates. `InstalledRules` tells
which (the CRD's schema digest against the operator's own, `crd.expected_schema_digest`);
`parse(body, admitted=True)` then runs the typed loader only (`parse_job(..., admitted=True)`),
and the CEL interpreter is never even imported. With another CRD installed (an older or newer
release), or none readable, every rule is evaluated here as before.

What trusting the server gives up: an object stored before the CRD gained a rule is not checked
against that rule again (the API server does not re-validate stored objects either); the typed
loader's own checks (types, enums, the finer cross-field checks) still apply to it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from rlhf_api.fields import SpecError
from rlhf_api.job import RLTrainingJob
from rlhf_api.loader import parse_job
from rlhf_operator import crd

log = logging.getLogger("rlhf_operator")

_lock = threading.Lock()
#: (namespace, name, uid) -> (digest, admitted, the parsed job or the spec's errors).
_parsed: dict[tuple[str, str, str], tuple[str, bool, RLTrainingJob | list[str]]] = {}
#: Seconds between two reads of the installed CRD's schema digest.
DEFAULT_RECHECK_SECONDS = 60.0
#: Seconds before a read that failed is tried again.
RETRY_SECONDS = 5.0


class InstalledRules:
    """Whether the API server enforces the rules this operator would evaluate: the installed CRD's
    `crd.SCHEMA_DIGEST_ANNOTATION` equals `expected` (the digest of the CRD this operator
    generates). `read` returns the installed CRD's annotations (None: no such CRD); it is called
    at most once per `recheck_seconds`, from the pass that asks (the operator asks once at
    startup, so that no job's first pass waits for it). A read that fails counts as "not
    enforced" (every rule evaluated here) until the next read, `RETRY_SECONDS` later. Each change
    of the answer is logged once, with why."""

    def __init__(
        self,
        read: Callable[[], dict[str, str] | None],
        expected: str | None = None,
        recheck_seconds: float = DEFAULT_RECHECK_SECONDS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._read = read
        self.expected = expected if expected is not None else crd.expected_schema_digest()
        self._annotation = crd.SCHEMA_DIGEST_ANNOTATION
        self.recheck_seconds = recheck_seconds
        self._clock = clock
        self._lock = threading.Lock()
        self._checked_at: float | None = None
        self._next_in = recheck_seconds
        self._enforced: bool | None = None

    def enforced(self) -> bool:
        with self._lock:
            now = self._clock()
            if self._checked_at is not None and now - self._checked_at < self._next_in:
                return bool(self._enforced)
            # This caller reads; the others keep the last answer meanwhile (before the first one:
            # "not enforced", every rule evaluated), rather than wait on the lock for the read.
            self._checked_at = now
        enforced, why, read = self._check()
        with self._lock:
            self._next_in = self.recheck_seconds if read else min(RETRY_SECONDS, self.recheck_seconds)
            if enforced != self._enforced:
                if enforced:
                    log.info(
                        "the installed CRD is this operator's (%s): jobs are parsed without re-evaluating its rules",
                        why,
                    )
                else:
                    log.warning("every rule of the CRD is evaluated here for each job: %s", why)
            self._enforced = enforced
        return enforced

    def _check(self) -> tuple[bool, str, bool]:
        """(enforced, why, whether the CRD could be read)."""
        try:
            annotations = self._read()
        except Exception as err:  # noqa: BLE001 - any failure means "evaluate everything"
            return False, f"the installed CRD cannot be read ({err})", False
        if annotations is None:
            return False, "no RLTrainingJob CRD is installed", True
        found = annotations.get(self._annotation)
        if found != self.expected:
            return (
                False,
                (
                    f"the installed CRD's {self._annotation} is {found!r}, this operator generates "
                    f"{self.expected!r} (another release's CRD)"
                ),
                True,
            )
        return True, f"{self._annotation} {found}", True


def digest(body: dict[str, Any]) -> str:
    """What `parse` keys on: the job without its status, `resourceVersion` and `managedFields`."""
    doc = {k: v for k, v in body.items() if k != "status"}
    meta = {
        k: v for k, v in (doc.get("metadata") or {}).items() if k not in ("resourceVersion", "managedFields")
    }
    stable = {**doc, "metadata": meta}
    return hashlib.sha256(json.dumps(stable, sort_keys=True, default=str).encode()).hexdigest()


def parse(body: dict[str, Any], admitted: bool = False) -> RLTrainingJob:
    """`parse_job` of `body` without its status; raises `SpecError` as it does. `admitted`: the
    API server has enforced the CRD's rules on `body` (see `InstalledRules`): they are not
    evaluated again."""
    doc = {k: v for k, v in body.items() if k != "status"}
    meta = doc.get("metadata") or {}
    key = (str(meta.get("namespace") or ""), str(meta.get("name") or ""), str(meta.get("uid") or ""))
    now = digest(doc)
    with _lock:
        held = _parsed.get(key)
    hit = held[2] if held is not None and held[:2] == (now, admitted) else None
    if hit is None:
        try:
            hit = parse_job(doc, admitted=admitted)
        except SpecError as err:
            hit = list(err.errors)
        with _lock:
            _parsed[key] = (now, admitted, hit)
    if isinstance(hit, list):
        raise SpecError(list(hit))
    return hit


def forget(namespace: str, name: str, uid: str | None = None) -> None:
    """Drop what is remembered of the job `namespace/name` with `uid` (None: whichever UID)."""
    with _lock:
        for key in [k for k in _parsed if k[:2] == (namespace, name) and uid in (None, k[2])]:
            del _parsed[key]


def clear() -> None:
    with _lock:
        _parsed.clear()
