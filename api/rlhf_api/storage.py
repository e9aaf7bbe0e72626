"""Storage on a cluster: is every directory the trainer writes on a volume that all its writers
share, and is every directory it reads mounted where it is read (`rlhf validate --cluster` and the
operator's admission ask this).

Importable without torch, Ray or a Kubernetes client.
"""

from __future__ import annotations

import posixpath
import re
from dataclasses import dataclass

from rlhf_api.contract import (
    CONTROLLER_ROLE,
    POD_HOME_DIR,
    POD_SHM_DIR,
    POD_SPEC_DIR,
    POD_TMP_DIR,
    POD_WORKSPACE_DIR,
)
from rlhf_api.job import JobSpec, _pod_counts

# --------------------------------------------------------------------------------------------
# Storage on a cluster: is every directory the trainer writes on a volume its writers share?
# --------------------------------------------------------------------------------------------

_HUB_ID_RE = r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$"


@dataclass(frozen=True)
class PodMount:
    """A directory of a pod's filesystem that is not its read-only root."""

    path: str
    volume: str
    kind: str
    writable: bool
    #: What pods that mount it share: (kind, source, path inside the volume); None when every pod
    #: gets its own (an emptyDir).
    shared_as: tuple[str, str, str] | None

    def location(self, path: str) -> tuple[str, str, str] | None:
        """Where `path` (at or below this mount) lies in the volume, comparable across pods."""
        if self.shared_as is None:
            return None
        kind, source, base = self.shared_as
        return kind, source, posixpath.normpath(posixpath.join(base, posixpath.relpath(path, self.path)))


def pod_mounts(spec: JobSpec, role: str) -> list[PodMount]:
    """Every writable or mounted directory of `role`'s pods: the operator's own emptyDirs and
    ConfigMap, and the spec's volumes (one at /tmp or /workspace replaces the operator's there)."""
    user = spec.pod_volumes(role)
    taken = {v.mount_path for v in user}
    out = [
        PodMount(POD_SHM_DIR, "dshm", "emptyDir", True, None),
        PodMount(POD_SPEC_DIR, "spec", "configMap", False, ("configMap", "<job>-spec", ".")),
    ]
    for path, name in ((POD_TMP_DIR, "tmp"), (POD_WORKSPACE_DIR, "workspace")):
        if path not in taken:
            out.append(PodMount(path, name, "emptyDir", True, None))
    for v in user:
        source = {
            "persistentVolumeClaim": v.persistent_volume_claim and v.persistent_volume_claim.claim_name,
            "hostPath": v.host_path and v.host_path.path,
            "configMap": v.config_map and v.config_map.name,
            "secret": v.secret and v.secret.secret_name,
        }.get(v.source_kind)
        shared = None if source is None else (v.source_kind, str(source), v.sub_path or ".")
        out.append(PodMount(v.mount_path, v.name, v.source_kind, v.writable, shared))
    return out


def pod_path(path: str) -> str:
    """Where a spec path points inside a pod: `~` is the pod's HOME, a relative path lies below the
    working directory (`rlhf controller` runs there)."""
    if path == "~" or path.startswith("~/"):
        path = POD_HOME_DIR + path[1:]
    return posixpath.normpath(posixpath.join(POD_WORKSPACE_DIR, path))


def _covering(mounts: list[PodMount], path: str) -> PodMount | None:
    """The innermost mount holding `path`; None: the read-only root filesystem."""
    inside = [m for m in mounts if path == m.path or path.startswith(m.path.rstrip("/") + "/")]
    return max(inside, key=lambda m: len(m.path), default=None)


def _pods_phrase(roles: list[str], counts: dict[str, int]) -> str:
    names = [f"{r} pod" + ("s" if counts[r] > 1 else "") for r in roles]
    return "the " + (names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1])


@dataclass
class StorageFindings:
    """`errors`: the job cannot work on a cluster as written; `warnings`: it may not (the checks
    are static: they see the spec, not the cluster's storage classes or nodes)."""

    errors: list[str]
    warnings: list[str]


def cluster_storage_findings(spec: JobSpec, job_name: str) -> StorageFindings:
    """Check, from the spec alone, that the directories the trainer writes on a cluster lie on
    volumes that the pods writing them share, and that what they read is where they can see it.

    Writers: the run directory (`output.dir`) is written by the controller pod; the checkpoint
    directory by the controller pod and rank 0 of the actor and critic pods. Readers: the model by
    every training and rollout pod, the prompts by the controller pod, a reward model by the reward pods."""
    counts = _pod_counts(spec)
    out = StorageFindings([], [])
    for field_path, given, where, writers in _written_dirs(spec, job_name, counts):
        _check_written(spec, counts, field_path, given, where, writers, out)
    model_readers = [r for r in (CONTROLLER_ROLE, "actor", "critic", "reference", "rollout") if counts.get(r)]
    read: list[tuple[str, str | None, list[str]]] = [
        ("spec.model.path", spec.model.path, model_readers),
        ("spec.model.tokenizer", spec.model.tokenizer, model_readers),
        ("spec.model.criticPath", spec.model.critic_path, [r for r in ("critic",) if counts.get(r)]),
        ("spec.data.path", spec.data.path, [CONTROLLER_ROLE]),
        ("spec.eval.path", spec.eval.path if spec.eval else None, [CONTROLLER_ROLE]),
        (
            "spec.reward.model.path",
            spec.reward.model.path if spec.reward.model else None,
            [r for r in ("reward",) if counts.get(r)],
        ),
        *(
            (f"spec.reward.models[{i}].path", m.path, [r for r in ("reward",) if counts.get(r)])
            for i, m in enumerate(spec.reward.models)
        ),
    ]
    for field_path, value, readers in read:
        if value is not None and readers:
            _check_read(spec, counts, field_path, value, readers, out)
    return out


def _written_dirs(
    spec: JobSpec, job_name: str, counts: dict[str, int]
) -> list[tuple[str, str, str, list[str]]]:
    """(field path, the spec's value, where it is in the pods, the roles whose pods write there)
    for each directory the trainer writes: the run directory and the checkpoint directory."""
    try:
        run_dir = spec.output.dir.format(name=job_name)
    except (KeyError, IndexError, ValueError):
        run_dir = spec.output.dir
    run_where = pod_path(run_dir)
    writers = [r for r in (CONTROLLER_ROLE, "actor", "critic") if counts.get(r)]
    if spec.checkpoint.dir is None:
        ckpt = ("<output.dir>/checkpoints", posixpath.join(run_where, "checkpoints"))
    else:
        ckpt = (spec.checkpoint.dir, pod_path(spec.checkpoint.dir))
    return [
        ("spec.output.dir", run_dir, run_where, [CONTROLLER_ROLE]),
        ("spec.checkpoint.dir", *ckpt, writers),
    ]


def _shown(given: str, where: str) -> str:
    return repr(given) if given == where else f"{given!r} ({where} in the pods)"


#: The access mode with which pods on different nodes all write one claim.
SHARED_ACCESS_MODE = "ReadWriteMany"


@dataclass(frozen=True)
class SharedClaim:
    """A persistentVolumeClaim on which a directory written by several pods lies: it works only
    when the claim is ReadWriteMany (the static checks cannot see that: `claim_findings` does)."""

    claim: str
    field_path: str
    #: The directory, as the spec gives it and where it is in the pods.
    shown: str
    #: Who writes it ("the controller pod and actor pods").
    writers: str


def shared_claims(spec: JobSpec, job_name: str) -> list[SharedClaim]:
    """The claims that more than one pod writes (the checkpoint directory of a job whose
    controller and trained roles run in several pods), one entry per directory."""
    counts = _pod_counts(spec)
    out = []
    for field_path, given, where, writers in _written_dirs(spec, job_name, counts):
        if sum(counts[r] for r in writers) < 2:
            continue  # one pod: any claim it can mount will do
        at = [_covering(pod_mounts(spec, r), where) for r in writers]
        if all(m is not None and m.kind == "persistentVolumeClaim" and m.shared_as for m in at):
            claims = {m.shared_as[1] for m in at if m is not None and m.shared_as}
            if len(claims) == 1:  # different claims: `cluster_storage_findings` reports it
                out.append(
                    SharedClaim(claims.pop(), field_path, _shown(given, where), _pods_phrase(writers, counts))
                )
    return out


def claim_findings(spec: JobSpec, job_name: str, access_modes: dict[str, list[str] | None]) -> list[str]:
    """What makes the job's shared claims (`shared_claims`) unfit for it, given each claim's
    access modes as the cluster has them (None: the claim does not exist); [] when they fit.
    The operator asks this before it creates the pods of a job."""
    out = []
    for c in shared_claims(spec, job_name):
        modes = access_modes.get(c.claim)
        valid = (
            f"valid: a claim with access mode {SHARED_ACCESS_MODE} (so that pods on different nodes all "
            "mount it), or all trained roles and the controller in one pod"
        )
        if modes is None:
            out.append(
                f"{c.field_path}: {c.shown} is on the persistentVolumeClaim {c.claim!r}, which does not exist; "
                f"create it ({valid})"
            )
        elif SHARED_ACCESS_MODE not in modes:
            out.append(
                f"{c.field_path}: {c.shown} is on the persistentVolumeClaim {c.claim!r} with access mode "
                f"{', '.join(modes) or '(none)'}, which {c.writers} cannot all write: every restart would fail "
                f"at its first checkpoint; {valid}"
            )
    return out


def _check_written(
    spec: JobSpec,
    counts: dict[str, int],
    field_path: str,
    given: str,
    where: str,
    writers: list[str],
    out: StorageFindings,
) -> None:
    shown = _shown(given, where)
    at = {role: _covering(pod_mounts(spec, role), where) for role in writers}
    pods = sum(counts[r] for r in writers)
    fix = f"mount a volume at or above {where} in spec.pod.volumes" + (
        " (a persistentVolumeClaim with access mode ReadWriteMany, so that they all see it)"
        if pods > 1
        else ""
    )
    on_root = [r for r, m in at.items() if m is None]
    if on_root:
        out.errors.append(
            f"{field_path}: {shown} is on the read-only root filesystem of {_pods_phrase(on_root, counts)}; {fix}"
        )
        return
    mounts = {r: m for r, m in at.items() if m is not None}
    read_only = [r for r, m in mounts.items() if not m.writable]
    if read_only:
        m = mounts[read_only[0]]
        out.errors.append(
            f"{field_path}: {shown} is on the read-only volume {m.volume!r} ({m.kind}) of "
            f"{_pods_phrase(read_only, counts)}; {fix}"
        )
        return
    private = [r for r, m in mounts.items() if m.shared_as is None]
    if pods > 1 and private:
        m = mounts[private[0]]
        out.errors.append(
            f"{field_path}: {shown} is on the emptyDir {m.volume!r} of {_pods_phrase(private, counts)}: every pod "
            f"has its own, so the files one of them writes there are invisible to the others; {fix}"
        )
        return
    places = {r: m.location(where) for r, m in mounts.items()}
    if len(set(places.values())) > 1:
        detail = "; ".join(f"{r}: volume {mounts[r].volume!r} ({mounts[r].kind})" for r in places)
        out.errors.append(
            f"{field_path}: {shown} is on different volumes in {_pods_phrase(writers, counts)} ({detail}); "
            "mount the same volume there in all of them (spec.pod.volumes)"
        )
        return
    m = next(iter(mounts.values()))
    if m.shared_as is None:
        out.warnings.append(
            f"{field_path}: {shown} is on the emptyDir {m.volume!r} of {_pods_phrase(writers, counts)}: it is lost "
            f"when the pod is replaced (a gang restart); mount a volume at or above {where} in spec.pod.volumes to keep it"
        )
    elif m.kind == "hostPath":
        who = (
            f"{_pods_phrase(writers, counts)} see the same files only while they run on the same node"
            if pods > 1
            else f"{_pods_phrase(writers, counts)} finds them again after a restart only on the same node"
        )
        out.warnings.append(
            f"{field_path}: {shown} is on the hostPath volume {m.volume!r}: {who}; a persistentVolumeClaim "
            "(ReadWriteMany) does not depend on that"
        )


def _check_read(
    spec: JobSpec,
    counts: dict[str, int],
    field_path: str,
    value: str,
    readers: list[str],
    out: StorageFindings,
) -> None:
    if (
        field_path not in ("spec.data.path", "spec.eval.path")
        and not value.startswith(("/", "~", "."))
        and re.match(_HUB_ID_RE, value)
    ):
        return  # a model `org/name` is a hub id unless the working directory holds it (a volume, then)
    where = pod_path(value)
    at = {role: _covering(pod_mounts(spec, role), where) for role in readers}
    empty = [r for r, m in at.items() if m is not None and m.shared_as is None]
    shown = repr(value) if value == where else f"{value!r} ({where} in the pods)"
    if empty:
        m = at[empty[0]]
        assert m is not None
        made = (
            "; spec.model.bootstrap would create it in the controller pod only"
            if field_path == "spec.model.path" and spec.model.bootstrap
            else ""
        )
        out.warnings.append(
            f"{field_path}: {shown} is on the emptyDir {m.volume!r} of {_pods_phrase(empty, counts)}, which starts "
            f"empty{made}; put it on a volume (spec.pod.volumes) or in the image"
        )
        return
    places = {r: (m.location(where) if m else None) for r, m in at.items()}
    if len(set(places.values())) > 1:
        missing = [r for r, p in places.items() if p is None]
        if missing:
            out.warnings.append(
                f"{field_path}: {shown} is on a volume in some pods but on the image's filesystem in "
                f"{_pods_phrase(missing, counts)}, which read it too; mount the volume there as well (spec.pod.volumes)"
            )
        else:
            out.warnings.append(
                f"{field_path}: {shown} is on different volumes in {_pods_phrase(readers, counts)}; "
                "they may not read the same files"
            )
