"""One table of invalid RLTrainingJobs (and updates), run through `rlhf validate`
(tests/unit/test_admission.py) and through a real API server with the CRD
(tests/cluster/test_admission_table.py): both must refuse each one, naming the field.

Each create case: (id, class of mistake, change to the base manifest, field path the refusal names).
Each update case: (id, change from the base to the new object, field path or None when allowed).
The base is manifests/examples/grpo-h100.yaml (valid in both places) with a tokenizer added, so that
removing an optional immutable field can be tried too.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
_DELETE = object()


def base() -> dict[str, Any]:
    doc = yaml.safe_load((ROOT / "manifests" / "examples" / "grpo-h100.yaml").read_text())
    doc["metadata"] = {"name": "adm"}
    doc["spec"]["model"]["tokenizer"] = "/models/Qwen2.5-7B-Instruct"
    return doc


def setp(path: str, value: Any) -> Callable[[dict[str, Any]], None]:
    """Set (or with `_DELETE` remove) the value at a dotted path; list indices are numbers."""

    def change(doc: dict[str, Any]) -> None:
        *head, last = path.split(".")
        obj: Any = doc
        for key in head:
            obj = obj[int(key)] if isinstance(obj, list) else obj.setdefault(key, {})
        if value is _DELETE:
            del obj[last]
        elif isinstance(obj, list):
            obj[int(last)] = value
        else:
            obj[last] = value

    return change


def both(*changes: Callable[[dict[str, Any]], None]) -> Callable[[dict[str, Any]], None]:
    def change(doc: dict[str, Any]) -> None:
        for c in changes:
            c(doc)

    return change


def variant(change: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
    doc = copy.deepcopy(base())
    change(doc)
    return doc


def _vol(name: str, mount: str) -> dict[str, Any]:
    return {"name": name, "mountPath": mount, "emptyDir": {}}


A = "spec.algorithm"
P = "spec.algorithm.params"
R = "spec.roles"
_colocated_tp = both(
    setp("spec.roles.placement", "colocated"),
    setp("spec.rollout.tensorParallelSize", 16),
)

CREATE_CASES: list[tuple[str, str, Callable[[dict[str, Any]], None], str]] = [
    # -- names the operator derives from the job's (Service, pods, label values)
    ("name starts with a digit", "names", setp("metadata.name", "1grpo"), "metadata.name"),
    ("name with a dot", "names", setp("metadata.name", "grpo.h100"), "metadata.name"),
    ("name too long", "names", setp("metadata.name", "x" * 51), "metadata.name"),
    (
        "pod name past 63",
        "names",
        both(setp("metadata.name", "r" * 50), setp("spec.roles.reference.replicas", 101)),
        "metadata.name",
    ),
    (
        "rollout pod name past 63",
        "names",
        both(setp("metadata.name", "r" * 50), setp("spec.roles.rollout.maxReplicas", 100000)),
        "metadata.name",
    ),
    ("metadata typo", "metadata", setp("metadata.nmae", "x"), "metadata.nmae"),
    # -- what can never run
    (
        "group of one (grpo)",
        "impossible",
        both(setp("spec.rollout.samplesPerPrompt", 1), setp("spec.training.miniBatchSize", 0)),
        "spec.rollout.samplesPerPrompt",
    ),
    (
        "group of one (rloo)",
        "impossible",
        both(
            setp(f"{A}.name", "rloo"),
            setp(f"{A}.params", {}),
            setp("spec.rollout.samplesPerPrompt", 1),
            setp("spec.training.miniBatchSize", 0),
        ),
        "spec.rollout.samplesPerPrompt",
    ),
    (
        "online_dpo needs pairs",
        "impossible",
        both(
            setp(f"{A}.name", "online_dpo"), setp(f"{A}.params", {}), setp("spec.rollout.samplesPerPrompt", 1)
        ),
        "spec.rollout.samplesPerPrompt",
    ),
    (
        "ppo without critic",
        "impossible",
        both(setp(f"{A}.name", "ppo"), setp(f"{A}.params", {})),
        "spec.roles.critic.replicas",
    ),
    (
        "TP above rollout GPUs",
        "impossible",
        setp("spec.rollout.tensorParallelSize", 8),
        "spec.rollout.tensorParallelSize",
    ),
    ("TP above actor GPUs (colocated)", "impossible", _colocated_tp, "spec.rollout.tensorParallelSize"),
    (
        "async rollouts colocated",
        "impossible",
        both(setp(f"{R}.placement", "colocated"), setp("spec.rollout.maxStaleness", 1)),
        "spec.rollout.maxStaleness",
    ),
    (
        "async rollouts with top-p",
        "impossible",
        both(setp("spec.rollout.topP", 0.9), setp("spec.rollout.maxStaleness", 1)),
        "spec.rollout.maxStaleness",
    ),
    (
        "vLLM rollout without GPUs",
        "impossible",
        setp(f"{R}.rollout.resources.gpus", 0),
        "spec.rollout.engine",
    ),
    ("empty model path", "empty", setp("spec.model.path", ""), "spec.model.path"),
    ("empty data path", "empty", setp("spec.data.path", ""), "spec.data.path"),
    ("empty reward model path", "empty", setp("spec.reward.model", {"path": ""}), "spec.reward.model.path"),
    ("empty output dir", "empty", setp("spec.output", {"dir": ""}), "spec.output.dir"),
    ("empty checkpoint dir", "empty", setp("spec.checkpoint.dir", ""), "spec.checkpoint.dir"),
    ("empty eval path", "empty", setp("spec.eval", {"path": ""}), "spec.eval.path"),
    (
        "eval of nothing",
        "impossible",
        setp("spec.eval", {"path": "/data/eval.jsonl", "greedy": False}),
        "spec.eval.samples",
    ),
    (
        "eval temperature without samples",
        "impossible",
        setp("spec.eval", {"path": "/data/eval.jsonl", "temperature": 0.7}),
        "spec.eval.temperature",
    ),
    (
        "tracker typo",
        "types",
        setp("spec.output", {"trackers": {"tensorbord": True}}),
        "spec.output.trackers.tensorbord",
    ),
    # -- algorithm params
    ("params typo klCoeff", "params", setp(f"{P}.klCoeff", 0.01), f"{P}.klCoeff"),
    ("params snake_case key", "params", setp(f"{P}.kl_coef", 0.01), f"{P}.kl_coef"),
    ("negative klCoef", "params", setp(f"{P}.klCoef", -0.1), f"{P}.klCoef"),
    ("klCoef not a number", "params", setp(f"{P}.klCoef", "high"), f"{P}.klCoef"),
    ("clipRatioLow above 1", "params", setp(f"{P}.clipRatioLow", 1.5), f"{P}.clipRatioLow"),
    ("clipRatioC not above 1", "params", setp(f"{P}.clipRatioC", 1.0), f"{P}.clipRatioC"),
    ("gamma is not a grpo param", "params", setp(f"{P}.gamma", 0.9), f"{P}.gamma"),
    ("beta is not a grpo param", "params", setp(f"{P}.beta", 0.1), f"{P}.beta"),
    (
        "epsilon is not a ppo param",
        "params",
        both(setp(f"{A}.name", "ppo"), setp(f"{R}.critic.replicas", 1), setp(f"{P}.epsilon", 1e-6)),
        f"{P}.epsilon",
    ),
    (
        "unknown advantage estimator",
        "params",
        setp(f"{P}.advantageEstimator", "gaee"),
        f"{P}.advantageEstimator",
    ),
    ("unknown loss aggregation", "params", setp(f"{P}.lossAggMode", "mean"), f"{P}.lossAggMode"),
    ("unknown KL estimator", "params", setp(f"{P}.klEstimator", "k4"), f"{P}.klEstimator"),
    (
        "gaeMasking not a choice",
        "params",
        both(setp(f"{A}.name", "ppo"), setp(f"{R}.critic.replicas", 1), setp(f"{P}.gaeMasking", "skip")),
        f"{P}.gaeMasking",
    ),
    (
        "dynamic_kl_ppo betaMin above betaMax",
        "params",
        both(
            setp(f"{A}.name", "dynamic_kl_ppo"),
            setp(f"{R}.critic.replicas", 1),
            setp(f"{P}", {"betaMin": 0.5, "betaMax": 0.1, "klCoef": 0.2}),
        ),
        P,
    ),
    (
        "dynamic_kl_ppo klCoef outside its bounds",
        "params",
        both(
            setp(f"{A}.name", "dynamic_kl_ppo"),
            setp(f"{R}.critic.replicas", 1),
            setp(f"{P}", {"klCoef": 2.0}),
        ),
        P,
    ),
    (
        "online_dpo labelSmoothing above 0.5",
        "params",
        both(
            setp(f"{A}.name", "online_dpo"),
            setp(f"{P}", {"labelSmoothing": 0.7}),
            setp("spec.rollout.samplesPerPrompt", 2),
            setp("spec.training.miniBatchSize", 0),
        ),
        f"{P}.labelSmoothing",
    ),
    # -- verl's spellings (algorithm_params.PARAM_ALIASES, MOVED_PARAMS; docs/from-verl.md)
    (
        "verl alias clipRange beside clipRatioLow",
        "params",
        both(setp(f"{P}.clipRange", 0.3), setp(f"{P}.clipRatioLow", 0.2)),
        f"{P}.clipRange",
    ),
    (
        "verl alias klPenalty beside klEstimator",
        "params",
        both(setp(f"{P}.klPenalty", "kl"), setp(f"{P}.klEstimator", "k3")),
        f"{P}.klPenalty",
    ),
    ("verl klPenalty not an estimator", "params", setp(f"{P}.klPenalty", "fixed"), f"{P}.klPenalty"),
    (
        "verl alias of a param online_dpo lacks",
        "params",
        both(
            setp(f"{A}.name", "online_dpo"),
            setp(f"{P}", {"clipRange": 0.2}),
            setp("spec.rollout.samplesPerPrompt", 2),
            setp("spec.training.miniBatchSize", 0),
        ),
        f"{P}.clipRange",
    ),
    ("verl lr in params", "params", setp(f"{P}.lr", 1e-6), f"{P}.lr"),
    ("verl vfCoef in params", "params", setp(f"{P}.vfCoef", 0.1), f"{P}.vfCoef"),
    (
        "dynamic_kl_ppo betaInit (klCoef) outside its bounds",
        "params",
        both(
            setp(f"{A}.name", "dynamic_kl_ppo"),
            setp(f"{R}.critic.replicas", 1),
            setp(f"{P}", {"betaInit": 2.0}),
        ),
        P,
    ),
    ("customParams with a built-in", "params", setp(f"{A}.customParams", {"foo": 1}), f"{A}.customParams"),
    ("unknown algorithm", "params", setp(f"{A}.name", "ppo2"), f"{A}.name"),
    # -- types, enums, bounds, sizes
    ("unknown enum value", "types", setp("spec.rollout.engine", "tgi"), "spec.rollout.engine"),
    ("top-p above 1", "types", setp("spec.rollout.topP", 1.5), "spec.rollout.topP"),
    ("negative temperature", "types", setp("spec.rollout.temperature", -1.0), "spec.rollout.temperature"),
    ("negative maxStaleness", "types", setp("spec.rollout.maxStaleness", -1), "spec.rollout.maxStaleness"),
    (
        "importanceWeightCap below 1",
        "types",
        setp("spec.rollout.importanceWeightCap", 0.5),
        "spec.rollout.importanceWeightCap",
    ),
    ("steps not an integer", "types", setp("spec.training.steps", "ten"), "spec.training.steps"),
    ("steps zero", "types", setp("spec.training.steps", 0), "spec.training.steps"),
    ("huge integer", "types", setp("spec.training.steps", 2**70), "spec.training.steps"),
    ("negative GPUs", "types", setp(f"{R}.actor.resources.gpus", -1), "spec.roles.actor.resources.gpus"),
    (
        "bad memory quantity",
        "types",
        setp(f"{R}.actor.resources.memory", "lots"),
        "spec.roles.actor.resources.memory",
    ),
    (
        "bad cpu quantity",
        "types",
        setp(f"{R}.reward.resources.cpu", "two"),
        "spec.roles.reward.resources.cpu",
    ),
    (
        "bad shm quantity",
        "types",
        setp(f"{R}.rollout.resources.shm", "16GB"),
        "spec.roles.rollout.resources.shm",
    ),
    ("bad pull policy", "types", setp("spec.imagePullPolicy", "Sometimes"), "spec.imagePullPolicy"),
    ("bad placement", "types", setp(f"{R}.placement", "mixed"), "spec.roles.placement"),
    (
        "negative maxRestarts",
        "types",
        setp("spec.failurePolicy.maxRestarts", -1),
        "spec.failurePolicy.maxRestarts",
    ),
    ("port above 65535", "types", setp("spec.output", {"metricsPort": 70000}), "spec.output.metricsPort"),
    ("bad dtype", "types", setp("spec.model.dtype", "fp8"), "spec.model.dtype"),
    ("unknown field", "types", setp(f"{R}.actor.gpu", 8), "spec.roles.actor.gpu"),
    ("unknown section", "types", setp("spec.trainig", {"steps": 3}), "spec.trainig"),
    ("missing model", "types", setp("spec.model", _DELETE), "spec.model"),
    (
        "pool name not a DNS label",
        "types",
        setp("spec.nodePools.2.name", "CPU_pool"),
        "spec.nodePools[2].name",
    ),
    (
        "bad reward import path",
        "types",
        setp("spec.reward.functions.0.path", "not a path"),
        "spec.reward.functions[0].path",
    ),
    (
        "bad volume name",
        "types",
        setp("spec.pod", {"volumes": [{"name": "Data_Vol", "mountPath": "/data", "emptyDir": {}}]}),
        "spec.pod.volumes[0].name",
    ),
    (
        "bad claim name",
        "types",
        setp(
            "spec.pod",
            {
                "volumes": [
                    {
                        "name": "data",
                        "mountPath": "/data",
                        "persistentVolumeClaim": {"claimName": "Bad_Claim"},
                    }
                ]
            },
        ),
        "spec.pod.volumes[0].persistentVolumeClaim.claimName",
    ),
    # -- checks once only in the Python loader, now CEL rules of the CRD too
    ("label key syntax", "types", setp("spec.pod", {"labels": {"bad key!": "x"}}), "spec.pod.labels"),
    (
        "label key the operator owns",
        "types",
        setp(f"{R}.rollout.pod", {"labels": {"rlhf.dev/role": "x"}}),
        "spec.roles.rollout.pod.labels",
    ),
    ("label value", "types", setp("spec.pod", {"labels": {"team": "a b"}}), "spec.pod.labels"),
    (
        "annotation key the operator owns",
        "types",
        setp("spec.controller", {"pod": {"annotations": {"kueue.x-k8s.io/queue-name": "q"}}}),
        "spec.controller.pod.annotations",
    ),
    (
        "GPUs as a device",
        "types",
        setp(f"{R}.actor.resources.devices", {"nvidia.com/gpu": 8}),
        "spec.roles.actor.resources.devices",
    ),
    (
        "device in kubernetes.io",
        "types",
        setp(f"{R}.actor.resources.devices", {"example.kubernetes.io/nic": 1}),
        "spec.roles.actor.resources.devices",
    ),
    (
        "device count zero",
        "types",
        setp(f"{R}.actor.resources.devices", {"rdma/hca": 0}),
        "spec.roles.actor.resources.devices",
    ),
    (
        "LoRA without target modules",
        "types",
        setp("spec.model.lora", {"targetModules": []}),
        "spec.model.lora.targetModules",
    ),
    ("LoRA dropout of 1", "types", setp("spec.model.lora", {"dropout": 1.0}), "spec.model.lora.dropout"),
    # -- cross-field rules
    ("min above max", "cross-field", setp(f"{R}.rollout.minReplicas", 5), "spec.roles.rollout.minReplicas"),
    ("replicas above max", "cross-field", setp(f"{R}.rollout.replicas", 9), "spec.roles.rollout.replicas"),
    (
        "replicas below min",
        "cross-field",
        both(setp(f"{R}.rollout.minReplicas", 3), setp(f"{R}.rollout.replicas", 2)),
        "spec.roles.rollout.replicas",
    ),
    ("undefined actor pool", "cross-field", setp(f"{R}.actor.nodePool", "a100"), "spec.roles.actor.nodePool"),
    (
        "undefined controller pool",
        "cross-field",
        setp("spec.controller", {"nodePool": "a100"}),
        "spec.controller.nodePool",
    ),
    (
        "duplicate pool names",
        "cross-field",
        setp("spec.nodePools", [{"name": "h100"}, {"name": "h100"}, {"name": "l4"}, {"name": "cpu"}]),
        "spec.nodePools",
    ),
    (
        "mini-batch not dividing",
        "cross-field",
        setp("spec.training.miniBatchSize", 100),
        "spec.training.miniBatchSize",
    ),
    ("no actor", "cross-field", setp(f"{R}.actor.replicas", 0), "spec.roles.actor.replicas"),
    ("no reward", "cross-field", setp("spec.reward.functions", []), "spec.reward"),
    (
        "reward model and reward models together",
        "cross-field",
        both(
            setp("spec.reward.model", {"path": "/models/rm-a"}),
            setp("spec.reward.models", [{"path": "/models/rm-b"}, {"path": "/models/rm-c", "weight": 0.5}]),
        ),
        "spec.reward.models",
    ),
    (
        "reward model maxLength 0",
        "range",
        setp("spec.reward.model", {"path": "/models/rm-a", "maxLength": 0}),
        "spec.reward.model.maxLength",
    ),
    (
        "a reward models entry without a path",
        "empty",
        setp("spec.reward.models", [{"path": "/models/rm-a"}, {"path": ""}]),
        "spec.reward.models[1].path",
    ),
    (
        "backoff cap below backoff",
        "cross-field",
        setp("spec.failurePolicy.maxBackoffSeconds", 1),
        "spec.failurePolicy.maxBackoffSeconds",
    ),
    (
        "volume with two sources",
        "cross-field",
        setp(
            "spec.pod",
            {"volumes": [{"name": "d", "mountPath": "/d", "emptyDir": {}, "hostPath": {"path": "/x"}}]},
        ),
        "spec.pod.volumes[0]",
    ),
    (
        "env with value and valueFrom",
        "cross-field",
        setp(
            "spec.pod",
            {"env": [{"name": "A", "value": "1", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}]},
        ),
        "spec.pod.env[0]",
    ),
    # -- what the operator owns in each pod
    (
        "operator's volume name",
        "pod",
        setp("spec.pod", {"volumes": [_vol("dshm", "/cache")]}),
        "spec.pod.volumes[0].name",
    ),
    (
        "operator's env name",
        "pod",
        setp("spec.pod", {"env": [{"name": "RLHF_ROLE", "value": "x"}]}),
        "spec.pod.env[0].name",
    ),
    (
        "mount below /dev/shm",
        "pod",
        setp("spec.pod", {"volumes": [_vol("c", "/dev/shm/c")]}),
        "spec.pod.volumes[0].mountPath",
    ),
    (
        "mount path with ..",
        "pod",
        setp("spec.pod", {"volumes": [_vol("c", "/data/../etc")]}),
        "spec.pod.volumes[0].mountPath",
    ),
    (
        "subPath escaping the volume",
        "pod",
        setp("spec.pod", {"volumes": [{**_vol("c", "/c"), "subPath": "../x"}]}),
        "spec.pod.volumes[0].subPath",
    ),
    (
        "env defined twice",
        "pod",
        setp("spec.pod", {"env": [{"name": "A", "value": "1"}, {"name": "A", "value": "2"}]}),
        "spec.pod.env",
    ),
    (
        "two volumes at one path",
        "pod",
        setp("spec.pod", {"volumes": [_vol("a", "/c"), _vol("b", "/c")]}),
        "spec.pod.volumes",
    ),
    (
        "role volume named like spec.pod's",
        "pod",
        both(
            setp("spec.pod", {"volumes": [_vol("c", "/c")]}),
            setp(f"{R}.actor.pod", {"volumes": [_vol("c", "/d")]}),
        ),
        "spec.roles.actor.pod.volumes",
    ),
    (
        "role volume mounted where spec.pod's is",
        "pod",
        both(
            setp("spec.pod", {"volumes": [_vol("c", "/c")]}),
            setp("spec.controller", {"pod": {"volumes": [_vol("d", "/c")]}}),
        ),
        "spec.controller.pod.volumes",
    ),
    (
        "two volumes of one name",
        "pod",
        setp("spec.pod", {"volumes": [_vol("a", "/c"), _vol("a", "/d")]}),
        "spec.pod.volumes",
    ),
    (
        "env valueFrom with no source",
        "pod",
        setp("spec.pod", {"env": [{"name": "A", "valueFrom": {}}]}),
        "spec.pod.env[0].valueFrom",
    ),
    (
        "exit codes out of range",
        "cross-field",
        setp(
            "spec.failurePolicy.rules",
            [{"action": "FailJob", "onReasons": ["ContainerExitCode"], "exitCodes": [0]}],
        ),
        "spec.failurePolicy.rules[0].exitCodes",
    ),
    (
        "exit codes without the ContainerExitCode reason",
        "cross-field",
        setp("spec.failurePolicy.rules", [{"action": "FailJob", "onReasons": ["Evicted"], "exitCodes": [1]}]),
        "spec.failurePolicy.rules[0].exitCodes",
    ),
    (
        "dr_grpo with the std normalisation",
        "params",
        both(setp(f"{A}.name", "dr_grpo"), setp(f"{P}", {"normByStd": True})),
        f"{P}.normByStd",
    ),
    (
        "dynamic_kl_ppo with an adaptive controller",
        "params",
        both(
            setp(f"{A}.name", "dynamic_kl_ppo"),
            setp(f"{R}.critic.replicas", 1),
            setp(f"{P}", {"klController": "adaptive"}),
        ),
        f"{P}.klController",
    ),
    # -- algorithm and rollout together (issue 22: runs that would silently learn nothing)
    *[
        (
            f"{algo} with one sample per prompt",
            "cross-field",
            both(setp(f"{A}.name", algo), setp(f"{P}", {}), setp("spec.rollout.samplesPerPrompt", 1)),
            "spec.rollout.samplesPerPrompt",
        )
        for algo in ("gspo", "dr_grpo", "rloo")
    ],
    (
        "group-relative estimator with one sample per prompt",
        "cross-field",
        both(
            setp(f"{A}.name", "reinforce_plus_plus"),
            setp(f"{P}", {"advantageEstimator": "reinforce_plus_plus_baseline"}),
            setp("spec.rollout.samplesPerPrompt", 1),
        ),
        "spec.rollout.samplesPerPrompt",
    ),
    (
        "adaptive KL controller without a KL coefficient",
        "params",
        setp(f"{P}", {"klController": "adaptive", "klCoef": 0.0}),
        P,
    ),
    (
        "dynamic sampling with one sample per prompt",
        "cross-field",
        both(
            setp(f"{A}.name", "reinforce_plus_plus"),
            setp(f"{P}", {}),
            setp(f"{A}.dynamicSampling", {"enabled": True}),
            setp("spec.rollout.samplesPerPrompt", 1),
        ),
        f"{A}.dynamicSampling.enabled",
    ),
    (
        "dynamic sampling with negative extra rounds",
        "types",
        setp(f"{A}.dynamicSampling", {"enabled": True, "maxExtraRounds": -1}),
        f"{A}.dynamicSampling.maxExtraRounds",
    ),
    (
        "rollout correction for online_dpo",
        "cross-field",
        both(
            setp(f"{A}.name", "online_dpo"),
            setp(f"{P}", {}),
            setp(f"{A}.rolloutCorrection", {"enabled": True}),
        ),
        f"{A}.rolloutCorrection.enabled",
    ),
    (
        "rollout correction with top-p",
        "cross-field",
        both(setp(f"{A}.rolloutCorrection", {"enabled": True}), setp("spec.rollout.topP", 0.9)),
        f"{A}.rolloutCorrection.enabled",
    ),
    (
        "rollout correction cap below 1",
        "types",
        setp(f"{A}.rolloutCorrection", {"enabled": True, "cap": 0.5}),
        f"{A}.rolloutCorrection.cap",
    ),
    (
        "rollout correction unknown level",
        "types",
        setp(f"{A}.rolloutCorrection", {"enabled": True, "level": "batch"}),
        f"{A}.rolloutCorrection.level",
    ),
    (
        "overlong buffer as long as the responses",
        "cross-field",
        both(setp("spec.rollout.maxNewTokens", 64), setp(f"{P}.overlongBufferLength", 64)),
        f"{P}.overlongBufferLength",
    ),
    (
        "overlong buffer longer than its own max length",
        "params",
        setp(f"{P}", {"overlongBufferLength": 16, "overlongMaxLength": 8}),
        f"{P}.overlongBufferLength",
    ),
    ("maskTruncated not a bool", "params", setp(f"{P}.maskTruncated", "yes"), f"{P}.maskTruncated"),
    (
        "maskTruncated is not an online_dpo param",
        "params",
        both(setp(f"{A}.name", "online_dpo"), setp(f"{P}", {"maskTruncated": True})),
        f"{P}.maskTruncated",
    ),
    (
        "gspo adaptive KL at its default klCoef 0",
        "params",
        both(setp(f"{A}.name", "gspo"), setp(f"{P}", {"klController": "adaptive"})),
        P,
    ),
]


def _scale(n: int) -> Callable[[dict[str, Any]], None]:
    return setp(f"{R}.rollout.replicas", n)


# (id, change from the base, field path of the refusal, or None: the update is allowed)
UPDATE_CASES: list[tuple[str, Callable[[dict[str, Any]], None], str | None]] = [
    ("model path changed", setp("spec.model.path", "/models/other"), "spec.model.path"),
    ("tokenizer removed", setp("spec.model.tokenizer", _DELETE), "spec.model.tokenizer"),
    ("dtype changed", setp("spec.model.dtype", "float16"), "spec.model.dtype"),
    ("critic path added", setp("spec.model.criticPath", "/models/critic"), "spec.model.criticPath"),
    ("algorithm changed", setp(f"{A}.name", "rloo"), "spec.algorithm.name"),
    ("actor replicas changed", setp(f"{R}.actor.replicas", 4), "spec.roles.actor.replicas"),
    ("actor pool removed", setp(f"{R}.actor.nodePool", _DELETE), "spec.roles.actor.nodePool"),
    ("critic pool added", setp(f"{R}.critic.nodePool", "h100"), "spec.roles.critic.nodePool"),
    ("placement changed", setp(f"{R}.placement", "colocated"), "spec.roles.placement"),
    ("rollout resources changed", setp(f"{R}.rollout.resources.gpus", 8), "spec.roles.rollout.resources"),
    ("controller pool added", setp("spec.controller", {"nodePool": "cpu"}), "spec.controller.nodePool"),
    # Everything that shapes a pod is fixed while the job exists: a later scale-up or gang restart
    # would otherwise run pods of two versions side by side (docs/operator.md, Changing a job).
    ("image changed", setp("spec.image", "registry.example/rlhf-trainer:v2"), "spec.image"),
    ("pull policy added", setp("spec.imagePullPolicy", "Always"), "spec.imagePullPolicy"),
    ("pull secret added", setp("spec.imagePullSecrets", [{"name": "regcred"}]), "spec.imagePullSecrets"),
    ("env added to every pod", setp("spec.pod.env", [{"name": "HF_HUB_OFFLINE", "value": "1"}]), "spec.pod"),
    (
        "volume claim changed",
        setp("spec.pod.volumes.2.persistentVolumeClaim.claimName", "ckpt-v2"),
        "spec.pod",
    ),
    (
        "node pool selector changed",
        setp("spec.nodePools.2.nodeSelector", {"rlhf.dev/pool": "cpu2"}),
        "spec.nodePools",
    ),
    ("actor pod labels added", setp(f"{R}.actor.pod", {"labels": {"team": "rl"}}), "spec.roles.actor.pod"),
    (
        "rollout pod env added",
        setp(f"{R}.rollout.pod", {"env": [{"name": "X", "value": "1"}]}),
        "spec.roles.rollout.pod",
    ),
    (
        "controller pod env added",
        setp("spec.controller", {"pod": {"env": [{"name": "X", "value": "1"}]}}),
        "spec.controller.pod",
    ),
    (
        "scheduler name added",
        setp("spec.scheduling.schedulerName", "volcano"),
        "spec.scheduling.schedulerName",
    ),
    (
        "priority class added",
        setp("spec.scheduling.priorityClassName", "high"),
        "spec.scheduling.priorityClassName",
    ),
    ("queue name added", setp("spec.scheduling.queueName", "team-a"), "spec.scheduling.queueName"),
    ("pod group added", setp("spec.scheduling.podGroup", "volcano"), "spec.scheduling.podGroup"),
    ("pipeline added", setp("spec.pipeline", "mypkg.flows:build"), "spec.pipeline"),
    # klCoef 0 runs no reference pods: moving it across 0 adds or drops them
    ("klCoef to 0", setp(f"{P}.klCoef", 0.0), "spec.algorithm.params.klCoef"),
    ("klCoef to integer 0", setp(f"{P}.klCoef", 0), "spec.algorithm.params.klCoef"),
    # ... also spelled with the seeds' alias betaInit (the rule reads every spelling)
    ("klCoef to 0 as betaInit", setp(P, {"betaInit": 0.0}), "spec.algorithm.params.klCoef"),
    ("scaled above max", _scale(9), "spec.roles.rollout.replicas"),
    ("scaled within range", _scale(4), None),
    ("scaled to min", _scale(1), None),
    ("suspended", setp("spec.suspend", True), None),
    ("steps changed", setp("spec.training.steps", 40), None),
    ("autoscaling off", setp("spec.autoscaling.enabled", False), None),
    ("rollout bounds widened", both(setp(f"{R}.rollout.maxReplicas", 6), _scale(5)), None),
    ("gang timeout changed", setp("spec.scheduling.timeoutSeconds", 600), None),
    ("ttl changed", setp("spec.ttlSecondsAfterFinished", 3600), None),
    ("klCoef changed, not across 0", setp(f"{P}.klCoef", 0.01), None),
    ("klCoef removed (grpo's default is not 0)", setp(f"{P}.klCoef", _DELETE), None),
    ("klCoef replaced by betaInit, not across 0", setp(P, {"betaInit": 0.1}), None),
]
