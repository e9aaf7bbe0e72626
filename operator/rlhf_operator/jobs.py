"""The operator's parse of a job, remembered: `parse(body)` is `spec.parse_job` of the job without
its status, computed once per distinct job rather than on every pass.

`parse_job` evaluates every rule of the CRD (its OpenAPI schema and CEL rules, interpreted in
Python) before building the typed spec: about a third of a second of CPU for a typical job, where
the rest of a pass is milliseconds. A pass used to parse twice (the autoscaler, then the
reconcile), and a burst of pod events runs many passes of an unchanged job. The result depends
only on the job without its status, so it is kept per digest of that (without `resourceVersion`
and `managedFields`, which every status write moves), in a bounded LRU. An invalid spec is
remembered too (its errors). The jobs returned are shared: callers only read them.
"""

from __future__ import annotations

import collections
import hashlib
import json
import threading
from typing import Any

from rlhf_trainer.spec import RLTrainingJob, SpecError, parse_job

#: Distinct job bodies remembered (a job changes rarely; the oldest are forgotten).
MAX_ENTRIES = 1024

_lock = threading.Lock()
_parsed: collections.OrderedDict[str, RLTrainingJob | list[str]] = collections.OrderedDict()


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
    key = digest(doc)
    with _lock:
        hit = _parsed.get(key)
        if hit is not None:
            _parsed.move_to_end(key)
    if hit is None:
        try:
            hit = parse_job(doc)
        except SpecError as err:
            hit = list(err.errors)
        with _lock:
            _parsed[key] = hit
            while len(_parsed) > MAX_ENTRIES:
                _parsed.popitem(last=False)
    if isinstance(hit, list):
        raise SpecError(list(hit))
    return hit


def clear() -> None:
    with _lock:
        _parsed.clear()
