"""The operator's status helpers: conditions and the printer-column summary.

The status's schema (the dataclasses the CRD renders, the phases and condition types, the format
of its times) is the API's (`rlhf_api.status`); this module computes what the operator writes
into it.
"""

from __future__ import annotations

import datetime as dt
import math
from typing import Any

from rlhf_api import contract
from rlhf_api.status import CONDITION_TYPES, rfc3339
from rlhf_operator.tenant_limits import clamp_int, clip

#: Longest condition reason kept; the longest number shown in a summary.
MAX_REASON = 128
MAX_COUNT = 10**12


# --------------------------------------------------------------------------------------------
# Pure helpers
# --------------------------------------------------------------------------------------------


def get_condition(status: dict[str, Any], type_: str) -> dict[str, Any] | None:
    for cond in status.get("conditions") or []:
        if cond.get("type") == type_:
            return dict(cond)
    return None


def condition_is(status: dict[str, Any], type_: str) -> bool:
    cond = get_condition(status, type_)
    return bool(cond and cond.get("status") == "True")


def set_condition(
    conditions: list[dict[str, Any]],
    type_: str,
    true: bool,
    reason: str,
    message: str,
    now: dt.datetime,
) -> list[dict[str, Any]]:
    """A new conditions list with `type_` set; lastTransitionTime moves only when the status flips."""
    status = "True" if true else "False"
    out = [dict(c) for c in conditions if c.get("type") != type_]
    old = next((c for c in conditions if c.get("type") == type_), None)
    since = old.get("lastTransitionTime") if old and old.get("status") == status else rfc3339(now)
    # Clipped to the schema's maxLength: a longer message (a pod's termination message quoted, a
    # long list of pods) would make every status patch of the job fail with 422.
    out.append(
        {
            "type": type_,
            "status": status,
            "reason": reason[:MAX_REASON],
            "message": clip(message),
            "lastTransitionTime": since,
        }
    )
    order = {t: i for i, t in enumerate(CONDITION_TYPES)}
    return sorted(out, key=lambda c: order.get(c["type"], len(order)))


def _mapping(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def summary(status: dict[str, Any], total_steps: int) -> dict[str, Any]:
    """Printer-column values from a status: `12/20` steps, `2/3` ready/desired rollout replicas and
    the last mean reward (a number, whichever way the controller pod reported it)."""
    c = contract
    progress = _mapping(status.get(c.STATUS_PROGRESS))
    rollout = _mapping(status.get(c.STATUS_ROLLOUT))
    # The controller pod writes progress: each number clamped, whatever its type.
    total = clamp_int(progress.get(c.PROGRESS_TOTAL_STEPS), 0, MAX_COUNT) or total_steps
    step = clamp_int(progress.get(c.PROGRESS_STEP), 0, MAX_COUNT)
    ready = clamp_int(rollout.get(c.ROLLOUT_READY), 0, MAX_COUNT)
    desired = clamp_int(rollout.get(c.ROLLOUT_DESIRED), 0, MAX_COUNT)
    # (the keys of `SummaryStatus`, the operator's own)
    out: dict[str, Any] = {"step": f"{step}/{total}", "rollout": f"{ready}/{desired}"}
    reward = progress.get(c.PROGRESS_REWARD)
    if reward is None:  # the controller may report it among its metrics, as a string
        reward = _mapping(progress.get(c.PROGRESS_METRICS)).get(c.PROGRESS_METRIC_REWARD_MEAN)
    try:
        value = None if reward is None or isinstance(reward, bool) else float(reward)
    except (TypeError, ValueError, OverflowError):
        value = None
    # None (a merge patch removes it) also for NaN/inf, which JSON cannot carry: a step whose
    # every sample failed its reward must not make every later status patch invalid.
    out["reward"] = value if value is not None and math.isfinite(value) else None
    return out
