"""The ChildFailure condition: what the executor writes after a pass's creates.

`reconcile.plan` decides which pods to create; the executor sends them and stops at the first one
the API server refuses (`failure_policy.Rejection`), or at a name a pod the job does not own holds
(`ownership`). `report_children` turns that outcome into the condition, its Event, and when to
try again; pure, like the pass.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass, field
from typing import Any

from rlhf_api.status import CHILD_FAILURE, FAILED, FINISHED, RUNNING, parse_time, rfc3339
from rlhf_operator import failure_policy
from rlhf_operator.pass_state import Event
from rlhf_operator.status import condition_is, get_condition, set_condition


@dataclass
class ChildrenReport:
    """What the executor writes after a pass's creates: the ChildFailure condition (and, for a
    permanent rejection, phase Failed), its Event, and when to try a refused create again."""

    #: Operator keys of the status to merge-patch; None when nothing changes.
    status: dict[str, Any] | None = None
    events: list[Event] = field(default_factory=list)
    requeue_after: float | None = None


def report_children(
    status: dict[str, Any],
    rejection: failure_policy.Rejection | None,
    attempted: bool,
    now: dt.datetime,
) -> ChildrenReport:
    """Report the outcome of the creates of one pass, level-based: `status` is the job's status as
    this pass wrote it, `rejection` the first create the API server refused (the pass stops
    creating there), `attempted` whether any create was sent.

    A permanent rejection (HTTP 400/422) fails the job (`ChildRejected`): the same spec builds the
    same object. A 403 (quota, LimitRange, webhook, RBAC) sets ChildFailure (QuotaExceeded or
    ChildForbidden) and asks for a retry after as long as it has been refused (5 s to 300 s). The
    Event is posted once per occurrence (a new object or reason), not on every retry. Once the
    creates go through, ChildFailure turns False."""
    phase = status.get("phase")
    if phase in FINISHED:
        return ChildrenReport()
    conditions: list[dict[str, Any]] = list(status.get("conditions") or [])
    was = get_condition(status, CHILD_FAILURE)
    if rejection is None:
        if was and was.get("status") == "True" and (attempted or phase in ("Scheduling", "Running")):
            conds = set_condition(
                conditions, CHILD_FAILURE, False, "ChildrenCreated", "every child object was created", now
            )
            return ChildrenReport(status={"conditions": conds})
        return ChildrenReport()
    message = rejection.describe()
    same = bool(
        was
        and was.get("status") == "True"
        and was.get("reason") == rejection.reason
        and str(was.get("message", "")).startswith(rejection.subject + ":")
    )
    conds = set_condition(conditions, CHILD_FAILURE, True, rejection.reason, message, now)
    if rejection.permanent:
        message += "; the job fails: the same spec would build the same object (fix the spec, then re-create the job)"
        conds = set_condition(conds, FAILED, True, rejection.reason, message, now)
        if condition_is(status, RUNNING):
            conds = set_condition(conds, RUNNING, False, "Failed", "", now)
        return ChildrenReport(
            status={"phase": "Failed", "conditions": conds, "completionTime": rfc3339(now)},
            events=[Event("Warning", rejection.reason, message)],
            requeue_after=0.0,  # the next pass frees what was created (phase Failed)
        )
    since = parse_time(was.get("lastTransitionTime")) if same and was else None
    retry = failure_policy.rejection_retry_seconds((now - since).total_seconds() if since else 0.0)
    return ChildrenReport(
        status={"conditions": conds} if conds != conditions else None,
        events=[] if same else [Event("Warning", rejection.reason, f"{message}; retrying in {retry:.0f}s")],
        requeue_after=retry,
    )
