"""The Kubernetes pod types a job may set (cluster only): volumes and their sources, env vars,
labels, annotations, devices and resources, each with the CEL rules that the API server and
`rlhf validate` evaluate on it.

Importable without torch, Ray or a Kubernetes client.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Literal

from rlhf_api.contract import (
    GROUP,
    KUEUE_POD_GROUP_NAME,
    KUEUE_POD_GROUP_TOTAL_COUNT,
    KUEUE_QUEUE_NAME,
    OPERATOR_ENV_NAMES,
    OPERATOR_VOLUMES,
    POD_SHM_DIR,
    POD_SPEC_DIR,
    POD_TMP_DIR,
    POD_WORKSPACE_DIR,
    SCHEDULER_PLUGINS_POD_GROUP,
    VOLCANO_POD_GROUP,
)
from rlhf_api.fields import DNS_LABEL_RE, QUANTITY_RE, _cel_in, _cel_string, _f, _one_of_rule, camel

# --------------------------------------------------------------------------------------------
# Pods: storage, environment, metadata (cluster only)
# --------------------------------------------------------------------------------------------

DNS_SUBDOMAIN_RE = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
DNS_SUBDOMAIN = (
    "a DNS subdomain: lowercase letters, digits, '-' and '.', starting and ending with a letter or digit"
)
ENV_NAME_RE = r"^[-._a-zA-Z][-._a-zA-Z0-9]*$"
CONFIG_KEY_RE = r"^[-._a-zA-Z0-9]+$"
CONFIG_KEY = "letters, digits, '-', '_' and '.', e.g. prompts.jsonl"
FIELD_PATH_RE = (
    r"^(metadata\.(name|namespace|uid|labels\['[^']+'\]|annotations\['[^']+'\])"
    r"|spec\.(nodeName|serviceAccountName)|status\.(hostIP|hostIPs|podIP|podIPs))$"
)
FIELD_PATHS = (
    "metadata.name, metadata.namespace, metadata.uid, metadata.labels['KEY'], "
    "metadata.annotations['KEY'], spec.nodeName, spec.serviceAccountName, status.hostIP, "
    "status.hostIPs, status.podIP, status.podIPs"
)
#: `domain/name` of an extended resource a device plugin advertises (`rdma/hca`, `vpc.amazonaws.com/efa`).
EXTENDED_RESOURCE_RE = r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?/[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$"
_LABEL_VALUE_RE = r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$"
#: A label or annotation key: an optional DNS-subdomain prefix and '/', then a name (the lengths,
#: at most 253 and 63, are a separate check).
_METADATA_KEY_RE = r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?([.][a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]$"

#: Names of the volumes the operator adds itself.
#: Label and annotation keys the operator sets (besides every key in the `rlhf.dev/` namespace).
OPERATOR_METADATA_KEYS = (
    "app.kubernetes.io/managed-by",
    "app.kubernetes.io/part-of",
    KUEUE_QUEUE_NAME,
    KUEUE_POD_GROUP_NAME,
    KUEUE_POD_GROUP_TOTAL_COUNT,
    SCHEDULER_PLUGINS_POD_GROUP,
    VOLCANO_POD_GROUP,
)


#: Field rules (the API server evaluates them; so do `rlhf validate` and the loader, `admission`).
_RELATIVE_PATH_CEL = [
    (
        "size(self) > 0 && !self.startsWith('/') && !self.matches('(^|/)[.][.](/|$)')",
        "'\"' + self + '\" is not valid; valid: a relative path without \\'..\\''",
    )
]
_MOUNT_PATH_CEL = [
    (
        "self.startsWith('/') && self != '/' && !self.endsWith('/') && !self.contains('//')"
        " && !self.matches('/[.][.]?(/|$)')",
        "'\"' + self + '\" is not valid; valid: a normalized absolute path such as /data'",
    ),
    (
        " && ".join(f"self != '{d}' && !self.startsWith('{d}/')" for d in (POD_SHM_DIR, POD_SPEC_DIR)),
        f"'\"' + self + '\" is not valid; the operator owns {POD_SHM_DIR} and {POD_SPEC_DIR}'",
    ),
]
_VOLUME_NAME_CEL = [
    (
        f"!(self in {_cel_in(OPERATOR_VOLUMES)})",
        "'\"' + self + '\" is a volume the operator adds itself; valid: any other DNS label'",
    )
]
_ENV_NAME_CEL = [
    (
        f"!(self in {_cel_in(OPERATOR_ENV_NAMES)})",
        "'\"' + self + '\" is set by the operator (the pod contract); valid: any other name'",
    )
]


def _metadata_key_cel(kind: str) -> list[tuple[str, str]]:
    """Rules of a map of pod `kind`s (labels, annotations) on its keys: `[prefix/]name`, and not
    one the operator owns. (The API server bounds the cost of a rule over a map's keys by the
    map's maxProperties.)"""

    def bad_syntax(k: str) -> str:
        return f"!({k}.matches('^([^/]{{1,253}}/)?[^/]{{1,63}}$') && {k}.matches({_cel_string(_METADATA_KEY_RE)}))"

    def owned(k: str) -> str:
        group = GROUP.replace(".", "[.]")
        return f"({k}.matches('^([^/]*[.])?{group}/') || {k} in {_cel_in(OPERATOR_METADATA_KEYS)})"

    return [
        (
            f"!self.exists(k, {bad_syntax('k')})",
            f"'{kind} key \"' + self.filter(k, {bad_syntax('k')})[0] + '\" is not valid; valid: an optional "
            "DNS-subdomain prefix and \\'/\\', then a name of at most 63 letters, digits, \\'-\\', \\'_\\' or "
            "\\'.\\', starting and ending with a letter or digit, e.g. team or example.com/team'",
        ),
        (
            f"!self.exists(k, {owned('k')})",
            f"'{kind} key \"' + self.filter(k, {owned('k')})[0] + '\" is set by the operator (the {GROUP}/ "
            "namespace, and the scheduling keys from spec.scheduling); valid: any other key'",
        ),
    ]


_LABEL_VALUE_OK = f"self[k].matches({_cel_string(_LABEL_VALUE_RE)})"  # (at most 63: the schema's maxLength)
_LABELS_CEL = [
    *_metadata_key_cel("label"),
    (
        f"self.all(k, {_LABEL_VALUE_OK})",
        f"'label \"' + self.filter(k, !({_LABEL_VALUE_OK}))[0] + '\": value \"' + "
        f"self[self.filter(k, !({_LABEL_VALUE_OK}))[0]] + '\" is not a valid label value; valid: at most 63 "
        "letters, digits, \\'-\\', \\'_\\' or \\'.\\', starting and ending with a letter or digit (or empty)'",
    ),
]
_ANNOTATIONS_CEL = _metadata_key_cel("annotation")

_DEVICE_KEY_OK = f"k.matches({_cel_string(EXTENDED_RESOURCE_RE)}) && !k.matches('^[^/]*kubernetes[.]io/')"
_DEVICES_CEL = [
    (
        f"self.all(k, {_DEVICE_KEY_OK})",
        f"'\"' + self.filter(k, !({_DEVICE_KEY_OK}))[0] + '\" is not an extended resource name; valid: "
        "domain/name outside kubernetes.io, e.g. rdma/hca or vpc.amazonaws.com/efa'",
    ),
    ("!('nvidia.com/gpu' in self)", "'nvidia.com/gpu is set by gpus; use the role\\'s resources.gpus'"),
    (
        "self.all(k, self[k] >= 1)",
        "'\"' + self.filter(k, self[k] < 1)[0] + '\": the count must be >= 1 (leave the device out for none)'",
    ),
]


@dataclass
class KeyToPathSpec:
    """One key of a ConfigMap or Secret, projected as a file (core/v1 KeyToPath)."""

    key: str = _f(doc="Key in the ConfigMap or Secret.", pattern=CONFIG_KEY_RE, valid=CONFIG_KEY)
    path: str = _f(
        doc="File path relative to the mount path (no `..`).",
        cel=_RELATIVE_PATH_CEL,
        max_length=256,
    )
    mode: int | None = _f(
        None,
        doc="Mode bits of the file (decimal 0-511, i.e. 0-0777); defaults to `defaultMode`.",
        minimum=0,
        maximum=511,
    )


@dataclass
class PersistentVolumeClaimSourceSpec:
    """An existing PersistentVolumeClaim in the job's namespace (core/v1 PersistentVolumeClaimVolumeSource).

    A directory several pods write (the checkpoint directory: controller, actor and critic pods)
    needs a claim whose access mode is ReadWriteMany, unless all those pods run on one node."""

    claim_name: str = _f(
        doc="Name of the PersistentVolumeClaim.", pattern=DNS_SUBDOMAIN_RE, valid=DNS_SUBDOMAIN
    )
    read_only: bool = _f(False, doc="Attach the claim read-only.")


@dataclass
class HostPathSourceSpec:
    """A directory or file of the node (core/v1 HostPathVolumeSource): shared only by pods on the same node."""

    path: str = _f(doc="Absolute path on the node.", pattern=r"^/", valid="an absolute path")
    type: (
        Literal[
            "DirectoryOrCreate", "Directory", "FileOrCreate", "File", "Socket", "CharDevice", "BlockDevice"
        ]
        | None
    ) = _f(None, doc="What must exist at `path`; unset: no check.")


@dataclass
class EmptyDirSourceSpec:
    """A directory that starts empty and lives as long as the pod (core/v1 EmptyDirVolumeSource): private to each pod."""

    medium: Literal["Memory"] | None = _f(
        None, doc="`Memory`: a tmpfs, counted against the pod's memory limit; unset: the node's disk."
    )
    size_limit: str | None = _f(None, doc="Largest size (Kubernetes quantity).", pattern=QUANTITY_RE)


@dataclass
class ConfigMapSourceSpec:
    """A ConfigMap's keys as files (core/v1 ConfigMapVolumeSource); always mounted read-only."""

    name: str = _f(
        doc="Name of the ConfigMap in the job's namespace.", pattern=DNS_SUBDOMAIN_RE, valid=DNS_SUBDOMAIN
    )
    items: list[KeyToPathSpec] = _f(
        [], doc="Only these keys, at these paths; unset: every key as a file of its name."
    )
    default_mode: int | None = _f(
        None, doc="Mode bits of the files (decimal 0-511, i.e. 0-0777); unset: 0644.", minimum=0, maximum=511
    )
    optional: bool = _f(False, doc="Start the pod even if the ConfigMap (or a listed key) does not exist.")


@dataclass
class SecretSourceSpec:
    """A Secret's keys as files (core/v1 SecretVolumeSource); always mounted read-only."""

    secret_name: str = _f(
        doc="Name of the Secret in the job's namespace.", pattern=DNS_SUBDOMAIN_RE, valid=DNS_SUBDOMAIN
    )
    items: list[KeyToPathSpec] = _f(
        [], doc="Only these keys, at these paths; unset: every key as a file of its name."
    )
    default_mode: int | None = _f(
        None, doc="Mode bits of the files (decimal 0-511, i.e. 0-0777); unset: 0644.", minimum=0, maximum=511
    )
    optional: bool = _f(False, doc="Start the pod even if the Secret (or a listed key) does not exist.")


_VOLUME_SOURCES = ("persistent_volume_claim", "host_path", "empty_dir", "config_map", "secret")


@dataclass
class VolumeSpec:
    """A volume and where it is mounted in the trainer container (a core/v1 Volume and its VolumeMount
    in one entry): exactly one of persistentVolumeClaim, hostPath, emptyDir, configMap, secret."""

    name: str = _f(
        doc="Volume name, unique in each pod; not one the operator uses itself ("
        + ", ".join(OPERATOR_VOLUMES)
        + ").",
        pattern=DNS_LABEL_RE,
        cel=_VOLUME_NAME_CEL,
    )
    mount_path: str = _f(
        doc=f"Absolute path in the container. A volume mounted exactly at {POD_WORKSPACE_DIR} (the working "
        f"directory) or {POD_TMP_DIR} replaces the per-pod emptyDir the operator puts there; not /, "
        f"{POD_SHM_DIR} or {POD_SPEC_DIR} (nor below them).",
        cel=_MOUNT_PATH_CEL,
        # Short enough that the API server's cost estimate of the rules comparing paths stays low.
        max_length=256,
    )
    sub_path: str | None = _f(
        None,
        doc="Mount this relative path of the volume instead of its root.",
        cel=_RELATIVE_PATH_CEL,
        max_length=256,
    )
    read_only: bool = _f(False, doc="Mount read-only (configMap and secret volumes always are).")
    persistent_volume_claim: PersistentVolumeClaimSourceSpec | None = _f(
        None, doc="An existing PersistentVolumeClaim (models, prompts, checkpoints, run directories)."
    )
    host_path: HostPathSourceSpec | None = _f(None, doc="A path on the node.")
    empty_dir: EmptyDirSourceSpec | None = _f(None, doc="A scratch directory private to each pod (caches).")
    config_map: ConfigMapSourceSpec | None = _f(
        None, doc="A ConfigMap's keys as files (small prompt files, configs)."
    )
    secret: SecretSourceSpec | None = _f(None, doc="A Secret's keys as files (credentials).")

    CEL_RULES: ClassVar[list[tuple[Any, ...]]] = [_one_of_rule(_VOLUME_SOURCES, "a volume")]

    @property
    def source_kind(self) -> str:
        """`persistentVolumeClaim`, `hostPath`, `emptyDir`, `configMap` or `secret`."""
        return next(camel(n) for n in _VOLUME_SOURCES if getattr(self, n) is not None)

    @property
    def writable(self) -> bool:
        pvc = self.persistent_volume_claim
        return not (self.read_only or self.config_map or self.secret or (pvc and pvc.read_only))


@dataclass
class KeySelectorSpec:
    """One key of a Secret or a ConfigMap in the job's namespace (core/v1 SecretKeySelector, ConfigMapKeySelector)."""

    name: str = _f(doc="Name of the Secret or ConfigMap.", pattern=DNS_SUBDOMAIN_RE, valid=DNS_SUBDOMAIN)
    key: str = _f(doc="The key whose value becomes the variable's.", pattern=CONFIG_KEY_RE, valid=CONFIG_KEY)
    optional: bool = _f(False, doc="Start the pod even if the object or the key does not exist.")


@dataclass
class FieldSelectorSpec:
    """A field of the pod (core/v1 ObjectFieldSelector, the downward API)."""

    field_path: str = _f(doc=f"One of {FIELD_PATHS}.", pattern=FIELD_PATH_RE, valid=FIELD_PATHS)


@dataclass
class ResourceFieldSelectorSpec:
    """A request or limit of the trainer container (core/v1 ResourceFieldSelector)."""

    resource: Literal[
        "requests.cpu",
        "requests.memory",
        "requests.ephemeral-storage",
        "limits.cpu",
        "limits.memory",
        "limits.ephemeral-storage",
    ] = _f(doc="Which request or limit.")
    divisor: str | None = _f(
        None, doc="Unit of the value (Kubernetes quantity, e.g. 1Mi); unset: 1.", pattern=QUANTITY_RE
    )


_ENV_SOURCES = ("secret_key_ref", "config_map_key_ref", "field_ref", "resource_field_ref")


@dataclass
class EnvVarSourceSpec:
    """Where a variable's value comes from (core/v1 EnvVarSource): exactly one of secretKeyRef,
    configMapKeyRef, fieldRef, resourceFieldRef."""

    secret_key_ref: KeySelectorSpec | None = _f(None, doc="A key of a Secret (tokens, credentials).")
    config_map_key_ref: KeySelectorSpec | None = _f(None, doc="A key of a ConfigMap.")
    field_ref: FieldSelectorSpec | None = _f(None, doc="A field of the pod (downward API).")
    resource_field_ref: ResourceFieldSelectorSpec | None = _f(
        None, doc="A request or limit of the container."
    )

    CEL_RULES: ClassVar[list[tuple[Any, ...]]] = [_one_of_rule(_ENV_SOURCES, "valueFrom")]


@dataclass
class EnvVarSpec:
    """An environment variable of the trainer container (core/v1 EnvVar): `value` or `valueFrom`."""

    name: str = _f(
        doc="Variable name; not one of the operator's contract variables ("
        + ", ".join(OPERATOR_ENV_NAMES)
        + ").",
        pattern=ENV_NAME_RE,
        valid="letters, digits, '_', '-' and '.', not starting with a digit",
        cel=_ENV_NAME_CEL,
        max_length=256,
    )
    value: str | None = _f(
        None, doc="The value; `$(OTHER)` expands a variable defined before it (the operator's come first)."
    )
    value_from: EnvVarSourceSpec | None = _f(None, doc="Take the value from a Secret, ConfigMap or the pod.")

    CEL_RULES: ClassVar[list[tuple[Any, ...]]] = [_one_of_rule(("value", "value_from"), "an env var")]


@dataclass
class PodSettingsSpec:
    """What is added to pods (all of the job's pods in `spec.pod`, one role's in `spec.roles.<role>.pod`,
    the controller pod's in `spec.controller.pod`).

    Environment variables follow the operator's own, in order (`spec.pod`, then the role's); one
    named like an operator default (HOME, XDG_CACHE_HOME, HF_HOME, MPLCONFIGDIR, NCCL_DEBUG, ...)
    replaces it, and a role's replaces `spec.pod`'s of the same name. Immutable once the job
    exists (a scale-up would otherwise run pods of two shapes): delete and recreate the job to
    change them."""

    env: list[EnvVarSpec] = _f(
        [], doc="Environment variables (`value`, or `valueFrom` a Secret, ConfigMap or pod field)."
    )
    labels: dict[str, str] = _f(
        {},
        doc=f"Pod labels; keys in the {GROUP}/ namespace and the scheduling keys the operator sets are refused.",
        cel=_LABELS_CEL,
        value_max_length=63,
    )
    annotations: dict[str, str] = _f(
        {},
        doc=f"Pod annotations; keys in the {GROUP}/ namespace and the scheduling keys the operator sets are refused.",
        cel=_ANNOTATIONS_CEL,
    )
    volumes: list[VolumeSpec] = _f(
        [],
        doc="Volumes mounted into the trainer container (the model, prompts, checkpoints, run directory, caches).",
    )

    CEL_RULES: ClassVar[list[tuple[Any, ...]]] = [
        (
            "self.env.all(e, self.env.exists_one(f, f.name == e.name))",
            "env names must be unique",
            {
                "fieldPath": ".env",
                "messageExpression": "'env names must be unique; defined twice: ' + "
                "self.env.filter(e, !self.env.exists_one(f, f.name == e.name)).map(e, e.name).join(', ')",
            },
        ),
        *[
            (
                f"self.volumes.all(v, self.volumes.exists_one(w, w.{key} == v.{key}))",
                f"volume {key}s must be unique in each pod",
                {
                    "fieldPath": ".volumes",
                    "messageExpression": f"'volume {key}s must be unique in each pod; used twice: ' + "
                    f"self.volumes.filter(v, !self.volumes.exists_one(w, w.{key} == v.{key})).map(v, v.{key}).join(', ')",
                },
            )
            for key in ("name", "mountPath")
        ],
    ]


@dataclass
class ImagePullSecretSpec:
    """A Secret of type kubernetes.io/dockerconfigjson in the job's namespace (core/v1 LocalObjectReference)."""

    name: str = _f(doc="Name of the Secret.", pattern=DNS_SUBDOMAIN_RE, valid=DNS_SUBDOMAIN)


@dataclass
class ResourcesSpec:
    """Resources of each pod of a role."""

    gpus: int = _f(
        0,
        doc="`nvidia.com/gpu` per pod (requests = limits), and what the role's ranks ask Ray for: actor, "
        "critic, reference and reward run one rank per GPU (a pod with N GPUs runs N ranks); a rollout pod "
        "runs one engine over all of its GPUs. 0: CPU.",
        minimum=0,
    )
    cpu: str = _f("1", doc="CPU request per pod (Kubernetes quantity).", pattern=QUANTITY_RE)
    memory: str = _f(
        "4Gi", doc="Memory request and limit per pod (Kubernetes quantity).", pattern=QUANTITY_RE
    )
    shm: str = _f("1Gi", doc="Size of the memory-backed /dev/shm.", pattern=QUANTITY_RE)
    ephemeral_storage: str | None = _f(
        None,
        doc=f"`ephemeral-storage` request per pod: the node disk behind {POD_TMP_DIR}, the default "
        f"{POD_WORKSPACE_DIR}, emptyDir volumes and logs (Kubernetes quantity); unset: none.",
        pattern=QUANTITY_RE,
    )
    devices: dict[str, int] = _f(
        {},
        doc="Extended resources per pod, requests = limits: network or other devices a device plugin "
        "advertises, e.g. `rdma/hca: 1` or `vpc.amazonaws.com/efa: 4` (GPUs go in `gpus`).",
        cel=_DEVICES_CEL,
    )
