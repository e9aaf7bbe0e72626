"""`ttlSecondsAfterFinished`: delete a Succeeded or Failed job (and so its children) after a delay."""

from __future__ import annotations

import datetime as dt


def expires_at(completion_time: dt.datetime | None, ttl_seconds: int | None) -> dt.datetime | None:
    """When the finished job is to be deleted; None when it never is (no TTL, or not finished)."""
    if completion_time is None or ttl_seconds is None:
        return None
    return completion_time + dt.timedelta(seconds=ttl_seconds)


def seconds_left(
    completion_time: dt.datetime | None, ttl_seconds: int | None, now: dt.datetime
) -> float | None:
    """Seconds until deletion (<= 0: delete now); None when the job is never deleted."""
    expiry = expires_at(completion_time, ttl_seconds)
    return None if expiry is None else (expiry - now).total_seconds()
