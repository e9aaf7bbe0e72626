"""The few API calls the operator makes, on plain dicts, over the official client's ApiClient.

Every error that means "try again later" becomes `kopf.TemporaryError`-compatible `Retry`; a
conflict on the status write (another writer got there first) is `Conflict`. A request the API
server refuses (HTTP 400, 403, 422: an invalid object, a quota, an admission webhook, RBAC) is
`Rejected`, a `Retry` that carries the status code and the server's message, so that the caller
can report it (the executor does, for creates) and decide whether retrying can help. Kept generic
(any kind, by apiVersion and kind) so that PodGroups of scheduler-plugins or Volcano need no
extra client.
"""

from __future__ import annotations

import contextlib
import json
from typing import Any

from rlhf_api import contract
from rlhf_operator import safe_json

#: Resource (plural) of each kind the operator writes.
PLURALS = {
    "Pod": "pods",
    "ServiceAccount": "serviceaccounts",
    "Secret": "secrets",
    "ConfigMap": "configmaps",
    "Service": "services",
    "Event": "events",
    "Role": "roles",
    "RoleBinding": "rolebindings",
    "PodGroup": "podgroups",
    "NetworkPolicy": "networkpolicies",
    "PersistentVolumeClaim": "persistentvolumeclaims",
    contract.KIND: contract.PLURAL,
}


class Retry(Exception):
    """A transient API failure; try again after `delay` seconds."""

    def __init__(self, message: str, delay: float = 5.0):
        super().__init__(message)
        self.delay = delay


class Rejected(Retry):
    """The API server refused the request: `code` 400/422 (invalid; the same request fails again)
    or 403 (forbidden: quota, LimitRange, admission webhook, RBAC; may clear later)."""

    def __init__(self, message: str, code: int, server_message: str, delay: float = 5.0):
        super().__init__(message, delay)
        self.code = code
        self.server_message = server_message


#: HTTP statuses that mean "refused" rather than "failed" (see Rejected).
REJECTED_STATUSES = (400, 403, 422)
#: Seconds a call may take, connecting and reading (urllib3's (connect, read) timeouts). Without
#: one a call to an API server that stops answering would hold its thread, and with it a pass (or
#: the CRD check every pass consults), for good; past it the call is retried like a reset.
REQUEST_TIMEOUT = (10.0, 60.0)


class Conflict(Exception):
    """The object changed since it was read (optimistic concurrency)."""


def path(api_version: str, kind: str, namespace: str, name: str | None = None, sub: str | None = None) -> str:
    prefix = "/api/v1" if api_version == "v1" else f"/apis/{api_version}"
    out = f"{prefix}/namespaces/{namespace}/{PLURALS[kind]}"
    if name:
        out += f"/{name}"
    if sub:
        out += f"/{sub}"
    return out


class Kube:
    """Synchronous calls; the operator runs them in worker threads, tests call them directly."""

    def __init__(
        self,
        api_client: Any = None,
        pool_size: int | None = None,
        request_timeout: tuple[float, float] = REQUEST_TIMEOUT,
    ) -> None:
        """`api_client`: the official client's ApiClient; by default one on the loaded kubeconfig
        (or in-cluster) configuration, with `pool_size` pooled connections (None: the client's
        default, 5 per CPU). `request_timeout`: (connect, read) seconds of each call."""
        self.request_timeout = request_timeout
        if api_client is None:
            from kubernetes import client

            config = client.Configuration.get_default_copy()
            if pool_size:
                config.connection_pool_maxsize = pool_size
            api_client = client.ApiClient(config)
        self.api = api_client

    def _call(
        self,
        method: str,
        url: str,
        body: Any = None,
        query: list[tuple[str, Any]] | None = None,
        content_type: str = "application/json",
        accept: str = "application/json",
    ) -> Any:
        from kubernetes.client.exceptions import ApiException
        from urllib3.exceptions import HTTPError as TransportError

        try:
            params = self.api.param_serialize(
                method=method,
                resource_path=url,
                query_params=query or [],
                header_params={"Accept": accept, "Content-Type": content_type},
                body=body,
                auth_settings=["BearerToken"],
            )
            resp = self.api.call_api(*params, _request_timeout=self.request_timeout)
            data = resp.read()
            status = resp.status
        except ApiException as err:
            status, data = err.status, (err.body or b"")
        except (OSError, TransportError) as err:  # refused, reset, timed out: restarting or stuck
            raise Retry(f"{method} {url}: {err}") from err
        if 200 <= status < 300:
            return safe_json.loads(data) if data else None  # a tenant's object: bounded depth
        message = _message(data)
        if status == 409:
            raise Conflict(f"{method} {url}: {message}")
        if status == 404:
            raise LookupError(f"{method} {url}: not found")
        if status in REJECTED_STATUSES:
            raise Rejected(f"{method} {url}: HTTP {status}: {message}", status, message)
        raise Retry(f"{method} {url}: HTTP {status}: {message}", 1.0 if status == 429 else 5.0)

    # -- reads ------------------------------------------------------------------------------------

    def get_job(self, namespace: str, name: str) -> dict[str, Any] | None:
        try:
            return self._call("GET", path(contract.API_VERSION, contract.KIND, namespace, name))  # type: ignore[no-any-return]
        except LookupError:
            return None

    def list_pods(self, namespace: str, job: str) -> list[dict[str, Any]]:
        return self.list_pods_versioned(namespace, job)[0]

    def list_pods_versioned(self, namespace: str, job: str) -> tuple[list[dict[str, Any]], str | None]:
        """The job's labelled pods and the list's resourceVersion (for `cache.PodCache.seed`)."""
        data = self._call(
            "GET", path("v1", "Pod", namespace), query=[("labelSelector", f"{contract.JOB_NAME}={job}")]
        )
        return list(data.get("items") or []), (data.get("metadata") or {}).get("resourceVersion")

    def crd_annotations(self, name: str) -> dict[str, str] | None:
        """The annotations of the CustomResourceDefinition `name`, or None when there is none.

        A LIST narrowed to that name, of metadata only: the chart grants kopf's discovery `list`
        on CRDs (not `get`), and the RLTrainingJob CRD itself is half a megabyte."""
        data = self._call(
            "GET",
            "/apis/apiextensions.k8s.io/v1/customresourcedefinitions",
            query=[("fieldSelector", f"metadata.name={name}")],
            accept="application/json;as=PartialObjectMetadataList;g=meta.k8s.io;v=v1",
        )
        items = (data or {}).get("items") or []
        if not items:
            return None
        return dict((items[0].get("metadata") or {}).get("annotations") or {})

    def get_path(self, api_path: str) -> dict[str, Any] | None:
        """GET an API path; None when the object, or its API, is not there (404)."""
        try:
            return self._call("GET", api_path)  # type: ignore[no-any-return]
        except LookupError:
            return None

    def get(self, obj: dict[str, Any]) -> dict[str, Any] | None:
        """The stored object of `obj`'s kind, namespace and name, or None when there is none."""
        meta = obj["metadata"]
        try:
            return self._call(  # type: ignore[no-any-return]
                "GET", path(obj["apiVersion"], obj["kind"], meta["namespace"], meta["name"])
            )
        except LookupError:
            return None

    # -- writes -----------------------------------------------------------------------------------

    def create(self, obj: dict[str, Any]) -> bool:
        """Create `obj`; False when it already exists (create-if-absent)."""
        meta = obj["metadata"]
        try:
            self._call(
                "POST",
                path(obj["apiVersion"], obj["kind"], meta["namespace"]),
                body=obj,
                query=[("fieldManager", contract.FIELD_MANAGER)],
            )
        except Conflict:
            return False
        return True

    def merge_patch(self, obj: dict[str, Any], patch: dict[str, Any]) -> None:
        meta = obj["metadata"]
        self._call(
            "PATCH",
            path(obj["apiVersion"], obj["kind"], meta["namespace"], meta["name"]),
            body=patch,
            query=[("fieldManager", contract.FIELD_MANAGER)],
            content_type="application/merge-patch+json",
        )

    def patch_metadata(self, obj: dict[str, Any], metadata: dict[str, Any]) -> None:
        """Merge-patch `obj`'s labels or annotations, if it is still the same object (its UID in
        the patch: a replaced object refuses it, 409 or 422); gone or replaced already is fine
        (used on pods the job is done with). Other refusals (403: RBAC) raise `Rejected`."""
        meta = obj["metadata"]
        patch = {"metadata": {**metadata, **({"uid": meta["uid"]} if meta.get("uid") else {})}}
        target = {"apiVersion": obj.get("apiVersion", "v1"), "kind": obj.get("kind", "Pod"), "metadata": meta}
        try:
            self.merge_patch(target, patch)
        except (LookupError, Conflict):
            return
        except Rejected as err:
            if err.code != 422:
                raise

    def delete(self, obj: dict[str, Any], grace_period_seconds: int | None = None) -> None:
        """Delete `obj` if it is still the same object (uid precondition); gone already is fine.
        `grace_period_seconds=0` force-deletes (no kubelet confirmation: `stuck_pods`)."""
        meta = obj["metadata"]
        body: dict[str, Any] = {
            "kind": "DeleteOptions",
            "apiVersion": "v1",
            "propagationPolicy": "Background",
        }
        if grace_period_seconds is not None:
            body["gracePeriodSeconds"] = grace_period_seconds
        if meta.get("uid"):
            body["preconditions"] = {"uid": meta["uid"]}
        with contextlib.suppress(LookupError, Conflict):
            self._call(
                "DELETE",
                path(obj.get("apiVersion", "v1"), obj.get("kind", "Pod"), meta["namespace"], meta["name"]),
                body=body,
            )

    def patch_status(self, job: dict[str, Any], status: dict[str, Any]) -> dict[str, Any]:
        """Merge-patch the operator's keys of the job's status, only if the job is unchanged since read."""
        meta = job["metadata"]
        patch = {"metadata": {"resourceVersion": meta["resourceVersion"]}, "status": status}
        return self._call(  # type: ignore[no-any-return]
            "PATCH",
            path(contract.API_VERSION, contract.KIND, meta["namespace"], meta["name"], "status"),
            body=patch,
            query=[("fieldManager", contract.FIELD_MANAGER)],
            content_type="application/merge-patch+json",
        )

    def patch_job_annotations(self, job: dict[str, Any], annotations: dict[str, str]) -> dict[str, Any]:
        """Merge `annotations` into the job's metadata, only if the job is unchanged since read
        (its resourceVersion and UID in the patch); returns the job as stored."""
        meta = job["metadata"]
        patch = {
            "metadata": {
                "resourceVersion": meta["resourceVersion"],
                "uid": meta["uid"],
                "annotations": annotations,
            }
        }
        return self._call(  # type: ignore[no-any-return]
            "PATCH",
            path(contract.API_VERSION, contract.KIND, meta["namespace"], meta["name"]),
            body=patch,
            query=[("fieldManager", contract.FIELD_MANAGER)],
            content_type="application/merge-patch+json",
        )

    def scale(self, job: dict[str, Any], replicas: int) -> dict[str, Any]:
        """Write the job's `/scale` subresource (spec.roles.rollout.replicas), as an HPA does, only
        if the job is unchanged since read (a concurrent `kubectl scale` wins; the caller re-reads)."""
        meta = job["metadata"]
        patch = {"metadata": {"resourceVersion": meta["resourceVersion"]}, "spec": {"replicas": replicas}}
        return self._call(  # type: ignore[no-any-return]
            "PATCH",
            path(contract.API_VERSION, contract.KIND, meta["namespace"], meta["name"], "scale"),
            body=patch,
            query=[("fieldManager", contract.FIELD_MANAGER)],
            content_type="application/merge-patch+json",
        )

    def event(self, job: dict[str, Any], type_: str, reason: str, message: str, now: str) -> None:
        meta = job["metadata"]
        body = {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {"generateName": f"{meta['name']}.", "namespace": meta["namespace"]},
            "involvedObject": {
                "apiVersion": contract.API_VERSION,
                "kind": contract.KIND,
                "name": meta["name"],
                "namespace": meta["namespace"],
                "uid": meta.get("uid"),
                "resourceVersion": meta.get("resourceVersion"),
            },
            "type": type_,
            "reason": reason,
            "message": message[:1024],
            "source": {"component": contract.FIELD_MANAGER},
            "firstTimestamp": now,
            "lastTimestamp": now,
            "count": 1,
            "reportingComponent": contract.FIELD_MANAGER,
        }
        self._call("POST", path("v1", "Event", meta["namespace"]), body=body)


def _message(data: Any) -> str:
    try:
        return str(json.loads(data).get("message"))
    except (TypeError, ValueError, AttributeError):
        return str(data)[:500]
