"""The pods of each job as the operator's pod watch last showed them, so that a reconcile pass
reads them from memory instead of listing them from the API server every time.

The operator already watches every pod carrying `rlhf.dev/job-name` (each event wakes the job's
daemon); `PodCache.observe` keeps the latest body of each such pod, by job. A job's pods are
*seeded* by one real LIST (the executor's first pass of the job, and again every
`relist_seconds`, the drift repair of a watch that missed something: kopf re-lists after a
reconnect but reports no deletion it did not see). Between seeds a pass costs no list call.

Ordering: watch events come in order; a seed's LIST may be older or newer than the events seen
around it. A listed pod replaces the cached one only if its resourceVersion is not older; a pod
whose deletion the watch has shown is not brought back by an older list; a cached pod missing
from the list stays only if it is newer than the list (created after it). resourceVersions are
compared as integers (etcd's revisions, as every Kubernetes API server issues them); one that is
not an integer counts as newest, so the newest report wins as before.

The cached bodies keep only what the operator reads of a pod (`_trim`): its metadata without
`managedFields`, its status, and of its spec the node it is bound to, its scheduling gates and its
containers' names and images. The rest of the spec (env, volumes, resources, affinity: most of a
pod's size) is the operator's own template, which it never reads back; the specs of 500 pods
are about 9 MiB. Thread-safe: the event loop writes, the reconcile threads read.
"""

from __future__ import annotations

import copy
import threading
import time
from collections.abc import Callable
from typing import Any

from rlhf_api import contract

Key = tuple[str, str]  # namespace, job name
#: Seconds between two real LISTs of a job's pods.
DEFAULT_RELIST_SECONDS = 300.0
#: Deletions remembered per job between seeds (against an older list bringing a pod back).
MAX_TOMBSTONES = 1000


def _rv(obj: dict[str, Any]) -> float:
    try:
        return float(int((obj.get("metadata") or {}).get("resourceVersion") or ""))
    except ValueError:
        return float("inf")


#: The fields of a pod's spec the operator reads (`gang`, `kueue`, `pod_health`).
SPEC_FIELDS = ("nodeName", "schedulingGates")
CONTAINER_FIELDS = ("name", "image")


def _trim(pod: dict[str, Any]) -> dict[str, Any]:
    out = dict(pod)
    meta = dict(out.get("metadata") or {})
    meta.pop("managedFields", None)
    out["metadata"] = meta
    spec = out.get("spec") or {}
    kept: dict[str, Any] = {k: spec[k] for k in SPEC_FIELDS if k in spec}
    for kind in ("initContainers", "containers"):
        if spec.get(kind):
            kept[kind] = [{k: c[k] for k in CONTAINER_FIELDS if k in c} for c in spec[kind]]
    out["spec"] = kept
    return out


class PodCache:
    def __init__(
        self, relist_seconds: float = DEFAULT_RELIST_SECONDS, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.relist_seconds = relist_seconds
        self._clock = clock
        self._lock = threading.Lock()
        self._pods: dict[Key, dict[str, dict[str, Any]]] = {}
        #: Per job: uid -> resourceVersion of the deletion the watch showed.
        self._deleted: dict[Key, dict[str, float]] = {}
        #: When each job was last seeded by a LIST.
        self._seeded: dict[Key, float] = {}

    @staticmethod
    def _key(pod: dict[str, Any]) -> Key | None:
        meta = pod.get("metadata") or {}
        job = (meta.get("labels") or {}).get(contract.JOB_NAME)
        return (str(meta.get("namespace") or ""), str(job)) if job else None

    def observe(self, event_type: str | None, pod: dict[str, Any]) -> None:
        """A watch event (type None: kopf's initial listing) of a pod with the job label."""
        key = self._key(pod)
        if key is None:
            return
        meta = pod.get("metadata") or {}
        name, uid = str(meta.get("name") or ""), str(meta.get("uid") or "")
        with self._lock:
            pods = self._pods.setdefault(key, {})
            if event_type == "DELETED":
                held = pods.get(name)
                if held is not None and (held.get("metadata") or {}).get("uid") == uid:
                    del pods[name]
                if not pods and key not in self._seeded:  # a forgotten job's last pod went
                    del self._pods[key]
                tombs = self._deleted.setdefault(key, {})
                tombs[uid] = _rv(pod)
                if len(tombs) > MAX_TOMBSTONES:
                    tombs.pop(next(iter(tombs)))
                return
            if uid in self._deleted.get(key, {}):
                return  # an event older than the deletion already seen
            held = pods.get(name)
            if held is not None and (held.get("metadata") or {}).get("uid") == uid and _rv(held) > _rv(pod):
                return
            pods[name] = _trim(pod)

    def pods(self, namespace: str, job: str) -> list[dict[str, Any]] | None:
        """The job's pods (copies), or None when they must be listed (never seeded, or the last
        seed is older than `relist_seconds`)."""
        key = (namespace, job)
        with self._lock:
            seeded = self._seeded.get(key)
            if seeded is None or self._clock() - seeded >= self.relist_seconds:
                return None
            return [copy.deepcopy(p) for _, p in sorted(self._pods.get(key, {}).items())]

    def seed(
        self, namespace: str, job: str, listed: list[dict[str, Any]], list_version: str | None
    ) -> list[dict[str, Any]]:
        """Merge a LIST of the job's pods taken at `list_version` (see the module's docstring);
        returns the job's pods after the merge (copies), whatever `relist_seconds` is."""
        key = (namespace, job)
        at = _rv({"metadata": {"resourceVersion": list_version}})
        with self._lock:
            held = self._pods.get(key, {})
            tombs = self._deleted.get(key, {})
            out: dict[str, dict[str, Any]] = {}
            for pod in listed:
                meta = pod.get("metadata") or {}
                if str(meta.get("uid") or "") in tombs:
                    continue
                name = str(meta.get("name") or "")
                mine = held.get(name)
                same = mine is not None and (mine.get("metadata") or {}).get("uid") == meta.get("uid")
                out[name] = mine if same and mine is not None and _rv(mine) > _rv(pod) else _trim(pod)
            for name, pod in held.items():
                if name not in out and _rv(pod) > at:  # created after the list was taken
                    out[name] = pod
            self._pods[key] = out
            self._deleted[key] = {}
            self._seeded[key] = self._clock()
            return [copy.deepcopy(p) for _, p in sorted(out.items())]

    def forget(self, namespace: str, job: str) -> None:
        key = (namespace, job)
        with self._lock:
            self._pods.pop(key, None)
            self._deleted.pop(key, None)
            self._seeded.pop(key, None)
