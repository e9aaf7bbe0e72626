"""Whose checkpoints a checkpoint directory holds: a job recreated under the same name starts
fresh, it never resumes its predecessor's checkpoints by accident.

On a cluster a job's checkpoint directory is a path on a shared volume, typically derived from the
job's name; a job deleted and created again under that name (a new UID) would find the old
job's checkpoints there and, with `checkpoint.resume` (the default), resume them. The controller
pod knows its job's UID (`RLHF_JOB_UID`, set by the operator) and keeps it in the directory's
`JOB` file (written when the run starts, fresh or resumed). A run whose directory holds complete
checkpoints and a `JOB` file naming another UID refuses to start, saying how to go on:

* start fresh: another `spec.checkpoint.dir`, or `spec.checkpoint.resume: false` (the new job's
  checkpoints then replace the old ones, as `checkpoint.keep` allows);
* resume the old checkpoints on purpose: delete the `JOB` file.

The job's own restarts keep its UID and resume as before. A directory without a `JOB` file (an
earlier release wrote it, or `rlhf run` outside a cluster) is resumed and then claimed; outside a
pod (no `RLHF_JOB_UID`) nothing is checked or written.
"""

from __future__ import annotations

import json
from pathlib import Path

from rlhf_api import contract
from rlhf_trainer import checkpoint

OWNER_FILE = "JOB"


def owner(root: str | Path) -> str | None:
    """The UID the directory's `JOB` file names, or None (no file, or one that does not parse)."""
    try:
        data = json.loads((Path(root) / OWNER_FILE).read_text())
    except (OSError, ValueError):
        return None
    uid = data.get("uid") if isinstance(data, dict) else None
    return uid if isinstance(uid, str) and uid else None


def refusal(root: str | Path, uid: str, name: str, resume: bool) -> str | None:
    """Why this job (`uid`) may not resume from `root`, or None."""
    if not uid or not resume or checkpoint.latest(root) is None:
        return None
    previous = owner(root)
    if previous is None or previous == uid:
        return None
    return (
        f"spec.checkpoint.dir {root} holds the checkpoints of an earlier job (uid {previous}), not of "
        f"job {name} (uid {uid}): a job recreated under the same name starts fresh, it does not resume "
        "its predecessor. To start fresh, give this job another spec.checkpoint.dir, or set "
        "spec.checkpoint.resume: false (its checkpoints then replace the old ones); to resume the old "
        f"checkpoints on purpose, delete {Path(root) / OWNER_FILE}"
    )


def claim(root: str | Path, uid: str, name: str) -> None:
    """Record that job `uid` runs from `root` (nothing without a UID)."""
    if not uid:
        return
    path = Path(root)
    path.mkdir(parents=True, exist_ok=True)
    tmp = path / f".{OWNER_FILE}.tmp"
    tmp.write_text(json.dumps({"uid": uid, "name": name}) + "\n")
    tmp.replace(path / OWNER_FILE)


def job_uid() -> str:
    """This pod's job UID (the operator sets it on the controller pod); empty elsewhere."""
    return contract.ENV_JOB_UID.get() or ""
