"""What a job's spec adds to each of its pods: volumes, working directory, environment, labels and
annotations, image pull settings, ephemeral storage and device resources.

`children.build_pod` builds the operator's own pod (contract env, command, security context, the
`/dev/shm`, `/tmp` and spec volumes) and hands it to `customize`, which applies these pure steps
in order. Each step reads the job spec and the role (`controller` for the controller pod) and
nothing else:

* `storage`: the spec's volumes (`spec.pod.volumes`, then the role's) and a per-pod emptyDir at
  the working directory `/workspace` unless a volume is mounted exactly there; a volume mounted
  exactly at `/tmp` replaces the operator's emptyDir there;
* `environment`: after the contract's variables, the variables that keep every write off the
  read-only root filesystem (`contract.POD_FILESYSTEM_ENV`: HOME and the caches below it on
  `/tmp`), then the spec's env (`spec.pod.env`, then the role's), a later entry replacing an
  earlier one of the same name; the contract's own variables are never replaced;
* `metadata`: the spec's labels and annotations under the operator's (which win: the spec
  validation refuses keys the operator sets);
* `image`: `imagePullPolicy` and `imagePullSecrets`;
* `resources`: `ephemeral-storage` requests and extended device resources (requests = limits).
"""

from __future__ import annotations

from typing import Any

from rlhf_api import contract
from rlhf_api.job import JobSpec, RLTrainingJob
from rlhf_api.pods import ConfigMapSourceSpec, EnvVarSpec, KeyToPathSpec, SecretSourceSpec, VolumeSpec

#: The per-pod emptyDir at the working directory when the spec mounts no volume there.
WORKSPACE_VOLUME = contract.VOLUME_WORKSPACE
#: The operator's emptyDir at /tmp (built by `children.build_pod`).
TMP_VOLUME = contract.VOLUME_TMP
EPHEMERAL_STORAGE = "ephemeral-storage"


def customize(job: RLTrainingJob, role: str, pod: dict[str, Any]) -> dict[str, Any]:
    """Apply the job's pod settings to `pod` (just built by `children.build_pod` for `role`); returns it."""
    spec = job.spec
    pod_spec = pod["spec"]
    container = pod_spec["containers"][0]
    pod_spec["volumes"], container["volumeMounts"] = storage(
        spec, role, pod_spec["volumes"], container["volumeMounts"]
    )
    container["workingDir"] = contract.POD_WORKSPACE_DIR
    container["env"] = environment(spec, role, container["env"])
    pod["metadata"] = metadata(spec, role, pod["metadata"])
    image(spec, container, pod_spec)
    container["resources"] = resources(spec, role, container["resources"])
    return pod


# --------------------------------------------------------------------------------------------
# Storage
# --------------------------------------------------------------------------------------------


def storage(
    spec: JobSpec, role: str, volumes: list[dict[str, Any]], mounts: list[dict[str, Any]]
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The pod's volumes and the container's mounts: the operator's (minus one the spec replaces),
    the default workspace, then the spec's."""
    own = spec.pod_volumes(role)
    taken = {v.mount_path for v in own}
    replaced = {m["name"] for m in mounts if m["mountPath"] in taken}
    out_volumes = [v for v in volumes if v["name"] not in replaced]
    out_mounts = [m for m in mounts if m["name"] not in replaced]
    if contract.POD_WORKSPACE_DIR not in taken:
        out_volumes.append({"name": WORKSPACE_VOLUME, "emptyDir": {}})
        out_mounts.append({"name": WORKSPACE_VOLUME, "mountPath": contract.POD_WORKSPACE_DIR})
    for v in own:
        out_volumes.append({"name": v.name, **volume_source(v)})
        out_mounts.append(volume_mount(v))
    return out_volumes, out_mounts


def volume_source(v: VolumeSpec) -> dict[str, Any]:
    """The core/v1 Volume source of a spec volume (`{"persistentVolumeClaim": {...}}`, ...)."""
    if v.persistent_volume_claim is not None:
        pvc: dict[str, Any] = {"claimName": v.persistent_volume_claim.claim_name}
        if v.persistent_volume_claim.read_only:
            pvc["readOnly"] = True
        return {"persistentVolumeClaim": pvc}
    if v.host_path is not None:
        host: dict[str, Any] = {"path": v.host_path.path}
        if v.host_path.type:
            host["type"] = v.host_path.type
        return {"hostPath": host}
    if v.empty_dir is not None:
        empty: dict[str, Any] = {}
        if v.empty_dir.medium:
            empty["medium"] = v.empty_dir.medium
        if v.empty_dir.size_limit:
            empty["sizeLimit"] = v.empty_dir.size_limit
        return {"emptyDir": empty}
    if v.config_map is not None:
        return {"configMap": _projection(v.config_map, {"name": v.config_map.name})}
    assert v.secret is not None  # the spec requires exactly one source
    return {"secret": _projection(v.secret, {"secretName": v.secret.secret_name})}


def _projection(src: ConfigMapSourceSpec | SecretSourceSpec, out: dict[str, Any]) -> dict[str, Any]:
    if src.items:
        out["items"] = [_key_to_path(i) for i in src.items]
    if src.default_mode is not None:
        out["defaultMode"] = src.default_mode
    if src.optional:
        out["optional"] = True
    return out


def _key_to_path(item: KeyToPathSpec) -> dict[str, Any]:
    out: dict[str, Any] = {"key": item.key, "path": item.path}
    if item.mode is not None:
        out["mode"] = item.mode
    return out


def volume_mount(v: VolumeSpec) -> dict[str, Any]:
    out: dict[str, Any] = {"name": v.name, "mountPath": v.mount_path}
    if v.sub_path:
        out["subPath"] = v.sub_path
    if v.read_only:
        out["readOnly"] = True
    return out


# --------------------------------------------------------------------------------------------
# Environment
# --------------------------------------------------------------------------------------------


def filesystem_env() -> list[dict[str, Any]]:
    """HOME, the caches and bytecode on the /tmp emptyDir: nothing writes to the read-only root."""
    return [var.value(var.default or "") for var in contract.POD_FILESYSTEM_ENV]


def env_entry(var: EnvVarSpec) -> dict[str, Any]:
    """The core/v1 EnvVar of a spec env entry."""
    if var.value is not None:
        return {"name": var.name, "value": var.value}
    src = var.value_from
    assert src is not None  # the spec requires exactly one of value, valueFrom
    ref: dict[str, Any]
    for key, sel in (("secretKeyRef", src.secret_key_ref), ("configMapKeyRef", src.config_map_key_ref)):
        if sel is not None:
            ref = {"name": sel.name, "key": sel.key}
            if sel.optional:
                ref["optional"] = True
            return {"name": var.name, "valueFrom": {key: ref}}
    if src.field_ref is not None:
        return {"name": var.name, "valueFrom": {"fieldRef": {"fieldPath": src.field_ref.field_path}}}
    res = src.resource_field_ref
    assert res is not None
    ref = {"resource": res.resource}
    if res.divisor:
        ref["divisor"] = res.divisor
    return {"name": var.name, "valueFrom": {"resourceFieldRef": ref}}


def environment(spec: JobSpec, role: str, base: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`base` (the contract's variables), the filesystem defaults, then the spec's env in order; a
    later entry replaces an earlier one of the same name, except the contract's own."""
    protected = {e["name"] for e in base if e["name"] in contract.OPERATOR_ENV_NAMES}
    out = list(base)
    extra = filesystem_env() + [env_entry(v) for _, settings in spec.pod_settings(role) for v in settings.env]
    for entry in extra:
        if entry["name"] in protected:
            continue  # refused by the spec's validation; a contract variable is never overridden
        out = [e for e in out if e["name"] != entry["name"]] + [entry]
    return out


# --------------------------------------------------------------------------------------------
# Metadata, image, resources
# --------------------------------------------------------------------------------------------


def metadata(spec: JobSpec, role: str, meta: dict[str, Any]) -> dict[str, Any]:
    """The spec's labels and annotations (`spec.pod`'s, then the role's) beneath the operator's."""
    out = dict(meta)
    labels: dict[str, str] = {}
    annotations: dict[str, str] = {}
    for _, settings in spec.pod_settings(role):
        labels.update(settings.labels)
        annotations.update(settings.annotations)
    out["labels"] = {**labels, **meta.get("labels", {})}
    if annotations or "annotations" in meta:
        out["annotations"] = {**annotations, **meta.get("annotations", {})}
    return out


def image(spec: JobSpec, container: dict[str, Any], pod_spec: dict[str, Any]) -> None:
    if spec.image_pull_policy:
        container["imagePullPolicy"] = spec.image_pull_policy
    if spec.image_pull_secrets:
        pod_spec["imagePullSecrets"] = [{"name": s.name} for s in spec.image_pull_secrets]


def resources(spec: JobSpec, role: str, res: dict[str, Any]) -> dict[str, Any]:
    """`ephemeral-storage` request and device resources (requests = limits) of `role`'s pods."""
    requests = dict(res.get("requests", {}))
    limits = dict(res.get("limits", {}))
    if role == contract.CONTROLLER_ROLE:
        ephemeral, devices = spec.controller.resources.ephemeral_storage, {}
    else:
        role_res = getattr(spec.roles, role).resources
        ephemeral, devices = role_res.ephemeral_storage, role_res.devices
    if ephemeral:
        requests[EPHEMERAL_STORAGE] = ephemeral
    for name, count in devices.items():
        requests[name] = limits[name] = str(count)
    return {"requests": requests, "limits": limits}
