"""The operator's parse of a job, remembered: `parse(body)` is `spec.parse_job` of the job without
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
"""

from __future__ import annotations

import hashlib
import json
import threading
from typing import Any

from rlhf_trainer.spec import RLTrainingJob, SpecError, parse_job

_lock = threading.Lock()
#: (namespace, name, uid) -> (digest, the parsed job or the spec's errors).
_parsed: dict[tuple[str, str, str], tuple[str, RLTrainingJob | list[str]]] = {}


def digest(body: dict[str, Any]) -> str:
    """What `parse` keys on: the job without its status, `resourceVersion` and `managedFields`."""
    doc = {k: v for k, v in body.items() if k != "status"}
    meta = {
        k: v for k, v in (doc.get("metadata") or {}).items() if k not in ("resourceVersion", "managedFields")
    }
    stable = {**doc, "metadata": meta}
    return hashlib.sha256(json.dumps(stable, sort_keys=True, default=str).encode()).hexdigest()


def parse(body: dict[str, Any]) -> RLTrainingJob:
    """`parse_job` of `body` without its status; raises `SpecError` as it does."""
    doc = {k: v for k, v in body.items() if k != "status"}
    meta = doc.get("metadata") or {}
    key = (str(meta.get("namespace") or ""), str(meta.get("name") or ""), str(meta.get("uid") or ""))
    now = digest(doc)
    with _lock:
        held = _parsed.get(key)
    hit = held[1] if held is not None and held[0] == now else None
    if hit is None:
        try:
            hit = parse_job(doc)
        except SpecError as err:
            hit = list(err.errors)
        with _lock:
            _parsed[key] = (now, hit)
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
