"""Ownership: a job acts only on the objects whose controller owner reference carries its UID.

Labels and names say which objects a job *would* own; only the owner reference's UID says which
it *does*. Two cases make the difference matter (JobSet and KubeRay select the same way):

* a job deleted and recreated under the same name: its predecessor's pods, Secret, ConfigMap and
  Service carry the same labels and names until the garbage collector removes them, and must
  neither count as the new job's pods nor be reused (a Succeeded controller pod of the old job
  would make the new one Succeeded at once);
* an object a user created under a name the job wants (a ServiceAccount, a Secret): adopting it
  would run the job's controller pod with that account's token, or share that Secret's token.

An object the job does not own is never adopted, overwritten or deleted: the job reports it
(condition ChildFailure, reason `NotOwned`, and a Warning Event naming the object and its owner)
and waits, retrying with a growing delay, until the object is gone.
"""

from __future__ import annotations

from typing import Any

from rlhf_api import contract
from rlhf_operator import failure_policy

#: Condition and Event reason for a child name held by an object the job does not own.
NOT_OWNED = "NotOwned"
#: The HTTP status of a create whose name is taken (the same as the API server's AlreadyExists).
ALREADY_EXISTS = 409


def controller_ref(obj: dict[str, Any]) -> dict[str, Any] | None:
    """The owner reference marked `controller: true`, if any."""
    for ref in (obj.get("metadata") or {}).get("ownerReferences") or []:
        if ref.get("controller"):
            return dict(ref)
    return None


def owned_by(obj: dict[str, Any], job_uid: str) -> bool:
    """True when `obj`'s controller is the RLTrainingJob with UID `job_uid` (never for an empty UID)."""
    ref = controller_ref(obj)
    return bool(
        job_uid
        and ref is not None
        and ref.get("kind") == contract.KIND
        and str(ref.get("apiVersion", "")).split("/")[0] == contract.GROUP
        and ref.get("uid") == job_uid
    )


def describe_owner(obj: dict[str, Any]) -> str:
    ref = controller_ref(obj)
    if ref is None:
        return "it has no controller owner"
    return f"its controller is {ref.get('kind')} {ref.get('name')} (uid {ref.get('uid')})"


def not_owned(obj: dict[str, Any], job_uid: str) -> failure_policy.Rejection:
    """The report of a child name held by `obj`, which the job with `job_uid` does not own."""
    meta = obj.get("metadata") or {}
    kind = obj.get("kind", "Pod")
    name = meta.get("name", "")
    message = (
        f"already exists in namespace {meta.get('namespace', '')} and is not owned by this job "
        f"(uid {job_uid}): {describe_owner(obj)}; it is not adopted, and the job waits until it is "
        "deleted (a recreated job waits for its predecessor's objects to be garbage-collected)"
    )
    return failure_policy.Rejection(kind, name, ALREADY_EXISTS, message, reason_override=NOT_OWNED)


def split(objs: list[dict[str, Any]], job_uid: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(owned, foreign) of objects selected by the job's label."""
    owned = [o for o in objs if owned_by(o, job_uid)]
    foreign = [o for o in objs if not owned_by(o, job_uid)]
    return owned, foreign
