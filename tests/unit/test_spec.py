"""The job spec: loading, error messages that name the field, defaults, the OpenAPI schema."""

from __future__ import annotations

import copy
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

from rlhf_api.fields import SpecError, to_dict
from rlhf_api.loader import load_manifest, parse_job, parse_spec
from rlhf_api.pods import (
    EmptyDirSourceSpec,
    ImagePullSecretSpec,
    KeySelectorSpec,
    PersistentVolumeClaimSourceSpec,
    PodSettingsSpec,
)
from rlhf_api.reference import reference_markdown
from rlhf_api.schema import openapi_schema
from rlhf_api.storage import StorageFindings, cluster_storage_findings, pod_path

MINIMAL = {
    "apiVersion": "rlhf.dev/v1alpha1",
    "kind": "RLTrainingJob",
    "metadata": {"name": "demo"},
    "spec": {
        "model": {"path": "models/tiny"},
        "data": {"path": "data/prompts.jsonl"},
        "reward": {"functions": [{"path": "my_rewards:exact"}]},
    },
}


def job(**overrides):
    doc = copy.deepcopy(MINIMAL)
    for dotted, value in overrides.items():
        node = doc["spec"]
        *parents, leaf = dotted.split("__")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return doc


def errors_of(doc) -> list[str]:
    with pytest.raises(SpecError) as info:
        parse_job(doc)
    return info.value.errors


def test_minimal_manifest_gets_defaults():
    j = parse_job(job())
    assert j.metadata_name == "demo" and j.namespace == "default"
    assert j.spec.algorithm.name == "grpo"
    assert j.spec.rollout.samples_per_prompt == 4
    assert j.spec.roles.placement == "colocated"
    assert j.spec.roles.rollout.min_replicas == 1
    assert j.spec.reward.functions[0].weight == 1.0


def test_eval_and_trackers_are_off_unless_asked_for():
    j = parse_job(job())
    assert j.spec.eval is None and j.spec.output.samples_per_step == 4
    assert not any(
        (j.spec.output.trackers.tensorboard, j.spec.output.trackers.wandb, j.spec.output.trackers.mlflow)
    )
    e = parse_job(job(eval={"path": "data/eval.jsonl", "maxPrompts": 64, "samples": 8})).spec.eval
    assert (e.path, e.every, e.max_prompts, e.greedy, e.samples, e.rewards) == (
        "data/eval.jsonl",
        10,
        64,
        True,
        8,
        [],
    )


def test_camel_case_keys_map_to_fields():
    j = parse_job(
        job(
            rollout__maxNewTokens=17,
            training__promptsPerStep=3,
            roles__rollout={"replicas": 2, "maxReplicas": 4},
        )
    )
    assert j.spec.rollout.max_new_tokens == 17
    assert j.spec.training.prompts_per_step == 3
    assert j.spec.roles.rollout.replicas == 2 and j.spec.roles.rollout.max_replicas == 4


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        ({"model__pth": "x"}, "spec.model.pth: unknown field; valid fields: path, tokenizer"),
        ({"rollout__engine": "sglang"}, "spec.rollout.engine: 'sglang' is not valid; valid: hf, vllm"),
        ({"rollout__topP": 1.5}, "spec.rollout.topP: 1.5 is above the maximum 1.0"),
        ({"rollout__temperature": -1}, "spec.rollout.temperature: -1.0 is below the minimum 0.0"),
        ({"training__steps": "ten"}, "spec.training.steps: 'ten' is not an integer"),
        ({"training__steps": True}, "spec.training.steps: True is not an integer"),
        (
            {"algorithm__name": "ppo2"},
            'spec.algorithm.name: Invalid value: "ppo2": algorithm.name must be one of ppo, grpo, gspo, dr_grpo, rloo, reinforce_plus_plus, remax, online_dpo, dynamic_kl_ppo or an import path package.module:Class (got "ppo2")',
        ),
        (
            {"roles__rollout": {"minReplicas": 3, "maxReplicas": 2, "replicas": 2}},
            "spec.roles.rollout.minReplicas: Invalid value: 3: rollout.minReplicas must be <= rollout.maxReplicas (2); got 3",
        ),
        (
            {"roles__rollout": {"replicas": 5, "maxReplicas": 4}},
            "spec.roles.rollout.replicas: Invalid value: 5: rollout.replicas must lie in [minReplicas, maxReplicas] = [1, 4]; got 5",
        ),
        (
            {"roles__actor": {"nodePool": "h100"}},
            'spec.roles.actor.nodePool: Invalid value: "h100": spec.roles.actor.nodePool must name an entry of spec.nodePools: "h100" is not one; valid: none defined',
        ),
        (
            {"roles__actor": {"resources": {"gpus": -1}}},
            "spec.roles.actor.resources.gpus: -1 is below the minimum 0",
        ),
        (
            {"roles__actor": {"resources": {"memory": "lots"}}},
            "spec.roles.actor.resources.memory: 'lots' is not valid; valid: a Kubernetes quantity such as 8Gi",
        ),
        (
            {"reward": {"functions": []}},
            'spec.reward: Invalid value: "object": reward needs at least one function or a model; valid: functions: [{path: my_rewards:exact_match}]',
        ),
        (
            {"reward__functions": [{"path": "not an import path"}]},
            "spec.reward.functions[0].path: 'not an import path' is not valid; valid: an import path",
        ),
        (
            {"training__miniBatchSize": 7},
            "spec.training.miniBatchSize: Invalid value: 7: spec.training.miniBatchSize must divide promptsPerStep × samplesPerPrompt = 32 responses (0: the whole batch); got 7",
        ),
        (
            {"training__maxTokensPerMicroBatch": 0},
            "spec.training.maxTokensPerMicroBatch: 0 is below the minimum 1",
        ),
        (
            {"training__maxTokensPerMicroBatch": 2.5},
            "spec.training.maxTokensPerMicroBatch: 2.5 is not an integer",
        ),
        (
            {"eval": {"path": "e.jsonl", "greedy": False}},
            "spec.eval.samples: Invalid value: 0: spec.eval.samples must be >= 1 when spec.eval.greedy is false (nothing to evaluate otherwise)",
        ),
        ({"eval": {"every": 5}}, "spec.eval.path: required field is missing"),
        ({"eval": {"path": "e.jsonl", "samples": -1}}, "spec.eval.samples: -1 is below the minimum 0"),
        (
            {"eval": {"path": "e.jsonl", "rewards": [{"path": "nope"}]}},
            "spec.eval.rewards[0].path: 'nope' is not valid",
        ),
        ({"output": {"samplesPerStep": -2}}, "spec.output.samplesPerStep: -2 is below the minimum 0"),
        (
            {"output": {"trackers": {"tensorboard": "yes"}}},
            "spec.output.trackers.tensorboard: 'yes' is not true or false",
        ),
        ({"rollout__maxStaleness": -1}, "spec.rollout.maxStaleness: -1 is below the minimum 0"),
        ({"rollout__maxStaleness": "one"}, "spec.rollout.maxStaleness: 'one' is not"),
        (
            {"rollout__maxStaleness": 1, "roles__placement": "colocated"},
            "spec.rollout.maxStaleness: 1 needs spec.roles.placement: disaggregated",
        ),
        (
            {"rollout__importanceWeightCap": 0.5},
            "spec.rollout.importanceWeightCap: 0.5 is below the minimum 1",
        ),
        # As the API server: a null is dropped, so the required section is missing.
        ({"data": None}, "spec.data: required field is missing"),
    ],
)
def test_bad_values_name_the_field_and_what_is_valid(overrides, expected):
    errs = errors_of(job(**overrides))
    assert any(expected in e for e in errs), errs


def test_max_tokens_per_micro_batch_is_unset_by_default_and_parsed_when_given():
    assert parse_job(job()).spec.training.max_tokens_per_micro_batch is None
    doc = job(training__maxTokensPerMicroBatch=4096)
    assert parse_job(doc).spec.training.max_tokens_per_micro_batch == 4096


def test_missing_required_section_is_named():
    doc = job()
    del doc["spec"]["model"]
    assert any(e.startswith("spec.model: required field is missing") for e in errors_of(doc))


def test_metadata_and_kind_are_checked():
    doc = job()
    doc["kind"] = "Job"
    doc["metadata"]["name"] = "Bad_Name"
    errs = errors_of(doc)
    assert any(e.startswith("kind: 'Job' is not valid") for e in errs)
    assert any(e.startswith("metadata.name") and "Bad_Name" in e for e in errs), errs


def test_all_errors_reported_at_once():
    errs = errors_of(job(rollout__engine="x", training__steps=0, model__typo=1))
    checked = [e for e in errs if "validation rules were not checked" not in e]
    assert len(checked) == 3, errs
    # As the API server: after a blocking schema error the CEL rules are not run, and it says so.
    assert len(errs) == 4 and "correct the existing errors" in errs[-1]


def test_load_manifest_errors(tmp_path):
    with pytest.raises(SpecError, match="cannot read the manifest"):
        load_manifest(tmp_path / "absent.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("spec: [unclosed")
    with pytest.raises(SpecError, match="not valid YAML"):
        load_manifest(bad)
    two = tmp_path / "two.yaml"
    two.write_text(yaml.safe_dump_all([MINIMAL, MINIMAL]))
    with pytest.raises(SpecError, match="expected exactly one RLTrainingJob document, found 2"):
        load_manifest(two)
    good = tmp_path / "good.yaml"
    good.write_text(yaml.safe_dump(MINIMAL))
    assert load_manifest(good).spec.model.path == "models/tiny"


def test_to_dict_round_trips():
    j = parse_job(job(rollout__maxNewTokens=9))
    again = parse_spec(to_dict(j.spec))
    assert again == j.spec


def _walk(schema, path="spec"):
    yield path, schema
    for key, sub in schema.get("properties", {}).items():
        yield from _walk(sub, f"{path}.{key}")
    if "items" in schema:
        yield from _walk(schema["items"], f"{path}[]")


def test_schema_documents_every_field_and_carries_constraints():
    schema = openapi_schema()
    for path, node in _walk(schema):
        if path.endswith("[]") and "properties" not in node:
            continue  # scalar or free-form list items are described by their list
        assert node.get("description"), f"{path} has no description"
    props = schema["properties"]
    assert props["rollout"]["properties"]["engine"]["enum"] == ["hf", "vllm"]
    assert props["rollout"]["properties"]["topP"]["maximum"] == 1.0
    assert props["training"]["properties"]["steps"]["minimum"] == 1
    assert props["training"]["properties"]["steps"]["default"] == 20
    assert set(schema["required"]) == {"model", "data", "reward"}
    # Immutability is a transition rule of the parent, so that adding or removing the field counts.
    model_rules = {r.get("fieldPath"): r["rule"] for r in props["model"]["x-kubernetes-validations"]}
    assert (
        model_rules[".path"]
        == "has(self.path) == has(oldSelf.path) && (!has(self.path) || self.path == oldSelf.path)"
    )
    assert ".tokenizer" in model_rules
    ro = props["roles"]["properties"]["rollout"]
    assert not any(
        "oldSelf" in r["rule"] and r.get("fieldPath") == ".replicas" for r in ro["x-kubernetes-validations"]
    ), "rollout replicas must stay mutable (/scale)"
    assert any("minReplicas <= self.maxReplicas" in r["rule"] for r in ro["x-kubernetes-validations"])
    # Built-in params are typed (unknown keys refused); a custom algorithm's own go in customParams.
    params = props["algorithm"]["properties"]["params"]
    assert "x-kubernetes-preserve-unknown-fields" not in params
    assert (
        params["properties"]["klCoef"]["type"] == "number"
        and params["properties"]["klCoef"]["minimum"] == 0.0
    )
    assert props["algorithm"]["properties"]["customParams"]["x-kubernetes-preserve-unknown-fields"] is True
    # Every documented default is in the schema, empty lists and maps included.
    assert props["nodePools"]["default"] == [] and props["pod"]["properties"]["labels"]["default"] == {}


def test_spec_imports_without_torch():
    code = "import sys, rlhf_api.loader, rlhf_trainer.cli; assert 'torch' not in sys.modules and 'ray' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_cli_validate(tmp_path):
    good = tmp_path / "good.yaml"
    good.write_text(yaml.safe_dump(MINIMAL))
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(job(rollout__engine="x")))
    (tmp_path / "my_rewards.py").write_text("def exact(prompts, responses):\n    return []\n")
    ok = subprocess.run(  # the reward module in the current directory, as the trainer imports it
        [sys.executable, "-m", "rlhf_trainer.cli", "validate", str(good)],
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert ok.returncode == 0 and "valid (demo, algorithm grpo)" in ok.stdout, ok.stderr
    res = subprocess.run(
        [sys.executable, "-m", "rlhf_trainer.cli", "validate", str(bad)], capture_output=True, text=True
    )
    assert res.returncode == 1
    assert "spec.rollout.engine: 'x' is not valid" in textwrap.dedent(res.stderr)


def test_manifest_reference_doc_is_fresh():
    from pathlib import Path

    doc = Path(__file__).resolve().parents[2] / "docs" / "manifest-reference.md"
    assert doc.read_text() == reference_markdown(), (
        "docs/manifest-reference.md is stale: run `rlhf validate --reference > docs/manifest-reference.md`"
    )


# --------------------------------------------------------------------------------------------
# Pods: volumes, env, labels, pull settings, controller, devices (cluster only)
# --------------------------------------------------------------------------------------------

EXAMPLES = Path(__file__).resolve().parents[2] / "manifests" / "examples"
VOL = {"name": "v", "mountPath": "/data", "emptyDir": {}}
WORK_PVC = {"name": "work", "mountPath": "/workspace", "persistentVolumeClaim": {"claimName": "rlhf-work"}}
DNS_SUBDOMAIN = (
    "a DNS subdomain: lowercase letters, digits, '-' and '.', starting and ending with a letter or digit"
)
OPERATOR_OWNS_ENV = "is set by the operator (the pod contract); valid: any other name"
OWNED_KEY = (
    "is set by the operator (the rlhf.dev/ namespace, and the scheduling keys from spec.scheduling); valid: "
    "any other key"
)
LABEL_KEY = (
    "is not valid; valid: an optional DNS-subdomain prefix and '/', then a name of at most 63 letters, "
    "digits, '-', '_' or '.', starting and ending with a letter or digit"
)


def test_pod_settings_default_to_nothing_and_the_controller_to_its_old_fixed_size():
    spec = parse_job(job()).spec
    assert spec.pod == PodSettingsSpec() and spec.roles.actor.pod == PodSettingsSpec()
    assert spec.image_pull_policy is None and spec.image_pull_secrets == []
    ctl = spec.controller
    assert (ctl.resources.cpu, ctl.resources.memory, ctl.resources.shm) == ("1", "2Gi", "1Gi")
    assert ctl.node_pool is None and ctl.resources.ephemeral_storage is None
    assert spec.roles.actor.resources.devices == {} and spec.roles.actor.resources.ephemeral_storage is None


def test_every_pod_setting_parses_and_round_trips():
    j = load_manifest(EXAMPLES / "grpo-pvc.yaml")
    spec = j.spec
    work, models = spec.pod.volumes
    assert work.persistent_volume_claim == PersistentVolumeClaimSourceSpec(claim_name="rlhf-workspace")
    assert (models.mount_path, models.read_only, models.writable) == ("/models", True, False)
    hf_token = spec.pod.env[0]
    assert hf_token.value is None and hf_token.value_from.secret_key_ref == KeySelectorSpec(
        "hf-token", "token", True
    )
    assert spec.roles.actor.resources.devices == {"rdma/hca": 1}
    assert spec.roles.rollout.pod.volumes[0].empty_dir == EmptyDirSourceSpec(size_limit="20Gi")
    assert spec.controller.node_pool == "cpu" and spec.controller.resources.ephemeral_storage == "20Gi"
    assert spec.image_pull_secrets == [ImagePullSecretSpec("registry-credentials")]
    assert [v.name for v in spec.pod_volumes("rollout")] == ["work", "models", "vllm-cache"]
    assert [v.name for v in spec.pod_volumes("actor")] == ["work", "models"]
    assert parse_spec(to_dict(spec)) == spec


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        # volumes
        (
            {"pod": {"volumes": [{"name": "v", "mountPath": "/data"}]}},
            'spec.pod.volumes[0]: Invalid value: "object": a volume needs exactly one of persistentVolumeClaim, hostPath, emptyDir, configMap, secret; got none',
        ),
        (
            {"pod": {"volumes": [{**VOL, "hostPath": {"path": "/x"}}]}},
            'spec.pod.volumes[0]: Invalid value: "object": a volume needs exactly one of persistentVolumeClaim, '
            "hostPath, emptyDir, configMap, secret; got hostPath emptyDir",
        ),
        (
            {"pod": {"volumes": [{**VOL, "nfs": {"server": "x"}}]}},
            "spec.pod.volumes[0].nfs: unknown field; valid fields: name, mountPath, subPath, readOnly, "
            "persistentVolumeClaim, hostPath, emptyDir, configMap, secret",
        ),
        (
            {"pod": {"volumes": [{**VOL, "name": "tmp"}]}},
            'spec.pod.volumes[0].name: Invalid value: "tmp": "tmp" is a volume the operator adds itself; valid: any other DNS label',
        ),
        (
            {"pod": {"volumes": [{**VOL, "mountPath": "data"}]}},
            'spec.pod.volumes[0].mountPath: Invalid value: "data": "data" is not valid; valid: a normalized absolute path such as /data',
        ),
        (
            {"pod": {"volumes": [{**VOL, "mountPath": "/data/../etc"}]}},
            'spec.pod.volumes[0].mountPath: Invalid value: "/data/../etc": "/data/../etc" is not valid; valid: a normalized absolute path such as /data',
        ),
        (
            {"pod": {"volumes": [{**VOL, "mountPath": "/etc/rlhf/x"}]}},
            'spec.pod.volumes[0].mountPath: Invalid value: "/etc/rlhf/x": "/etc/rlhf/x" is not valid; the operator owns /dev/shm and /etc/rlhf',
        ),
        (
            {"pod": {"volumes": [{**VOL, "mountPath": "/"}]}},
            'spec.pod.volumes[0].mountPath: Invalid value: "/": "/" is not valid; valid: a normalized absolute path such as /data',
        ),
        (
            {"pod": {"volumes": [{**VOL, "subPath": "../up"}]}},
            'spec.pod.volumes[0].subPath: Invalid value: "../up": "../up" is not valid; valid: a relative path without \'..\'',
        ),
        (
            {"pod": {"volumes": [VOL, {**VOL, "mountPath": "/other"}]}},
            'spec.pod.volumes: Invalid value: "array": volume names must be unique in each pod; used twice: v, v',
        ),
        (
            {"pod": {"volumes": [VOL, {**VOL, "name": "w"}]}},
            'spec.pod.volumes: Invalid value: "array": volume mountPaths must be unique in each pod; used twice: /data, /data',
        ),
        (
            {
                "pod": {"volumes": [VOL]},
                "roles": {"rollout": {"pod": {"volumes": [{**VOL, "mountPath": "/x"}]}}},
            },
            'spec.roles.rollout.pod.volumes: Invalid value: "array": spec.roles.rollout.pod.volumes: v already used as a volume name in spec.pod.volumes',
        ),
        (
            {"pod": {"volumes": [VOL]}, "controller": {"pod": {"volumes": [{**VOL, "name": "w"}]}}},
            'spec.controller.pod.volumes: Invalid value: "array": spec.controller.pod.volumes: /data already used as a volume mountPath in spec.pod.volumes',
        ),
        (
            {
                "pod": {
                    "volumes": [
                        {"name": "v", "mountPath": "/m", "persistentVolumeClaim": {"claimName": "Bad_Claim"}}
                    ]
                }
            },
            f"spec.pod.volumes[0].persistentVolumeClaim.claimName: 'Bad_Claim' is not valid; valid: {DNS_SUBDOMAIN}",
        ),
        (
            {"pod": {"volumes": [{"name": "v", "mountPath": "/m", "hostPath": {"path": "relative"}}]}},
            "spec.pod.volumes[0].hostPath.path: 'relative' is not valid; valid: an absolute path",
        ),
        (
            {
                "pod": {
                    "volumes": [{"name": "v", "mountPath": "/m", "hostPath": {"path": "/x", "type": "Dir"}}]
                }
            },
            "spec.pod.volumes[0].hostPath.type: 'Dir' is not valid; valid: DirectoryOrCreate, Directory, "
            "FileOrCreate, File, Socket, CharDevice, BlockDevice",
        ),
        (
            {"pod": {"volumes": [{"name": "v", "mountPath": "/m", "emptyDir": {"medium": "Disk"}}]}},
            "spec.pod.volumes[0].emptyDir.medium: 'Disk' is not valid; valid: Memory",
        ),
        (
            {
                "pod": {
                    "volumes": [
                        {
                            "name": "v",
                            "mountPath": "/m",
                            "configMap": {"name": "c", "items": [{"key": "k", "path": "/abs"}]},
                        }
                    ]
                }
            },
            'spec.pod.volumes[0].configMap.items[0].path: Invalid value: "/abs": "/abs" is not valid; valid: a relative path without \'..\'',
        ),
        (
            {
                "pod": {
                    "volumes": [
                        {"name": "v", "mountPath": "/m", "secret": {"secretName": "s", "defaultMode": 1000}}
                    ]
                }
            },
            "spec.pod.volumes[0].secret.defaultMode: 1000 is above the maximum 511",
        ),
        # env
        (
            {"pod": {"env": [{"name": "A"}]}},
            'spec.pod.env[0]: Invalid value: "object": an env var needs exactly one of value, valueFrom; got none',
        ),
        (
            {
                "pod": {
                    "env": [
                        {"name": "A", "value": "1", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}
                    ]
                }
            },
            'spec.pod.env[0]: Invalid value: "object": an env var needs exactly one of value, valueFrom; got value valueFrom',
        ),
        (
            {"pod": {"env": [{"name": "A", "valueFrom": {}}]}},
            'spec.pod.env[0].valueFrom: Invalid value: "object": valueFrom needs exactly one of secretKeyRef, '
            "configMapKeyRef, fieldRef, resourceFieldRef; got none",
        ),
        (
            {"pod": {"env": [{"name": "A", "valueFrom": {"fieldRef": {"fieldPath": "spec.containers"}}}]}},
            "spec.pod.env[0].valueFrom.fieldRef.fieldPath: 'spec.containers' is not valid; valid: metadata.name, "
            "metadata.namespace, metadata.uid, metadata.labels['KEY'], metadata.annotations['KEY'], spec.nodeName, "
            "spec.serviceAccountName, status.hostIP, status.hostIPs, status.podIP, status.podIPs",
        ),
        (
            {"pod": {"env": [{"name": "A", "valueFrom": {"resourceFieldRef": {"resource": "limits.gpu"}}}]}},
            "spec.pod.env[0].valueFrom.resourceFieldRef.resource: 'limits.gpu' is not valid; valid: requests.cpu, "
            "requests.memory, requests.ephemeral-storage, limits.cpu, limits.memory, limits.ephemeral-storage",
        ),
        (
            {"pod": {"env": [{"name": "1A", "value": "x"}]}},
            "spec.pod.env[0].name: '1A' is not valid; valid: letters, digits, '_', '-' and '.', not starting with a digit",
        ),
        (
            {"pod": {"env": [{"name": "RLHF_ROLE", "value": "x"}]}},
            f'spec.pod.env[0].name: Invalid value: "RLHF_ROLE": "RLHF_ROLE" {OPERATOR_OWNS_ENV}',
        ),
        (
            {"roles": {"actor": {"pod": {"env": [{"name": "RAY_AUTH_TOKEN", "value": "x"}]}}}},
            f'spec.roles.actor.pod.env[0].name: Invalid value: "RAY_AUTH_TOKEN": "RAY_AUTH_TOKEN" {OPERATOR_OWNS_ENV}',
        ),
        (
            {"pod": {"env": [{"name": "A", "value": "1"}, {"name": "A", "value": "2"}]}},
            'spec.pod.env: Invalid value: "array": env names must be unique; defined twice: A, A',
        ),
        ({"pod": {"env": [{"name": "A", "value": 1}]}}, "spec.pod.env[0].value: 1 is not a string"),
        # labels and annotations
        (
            {"pod": {"labels": {"rlhf.dev/role": "x"}}},
            'spec.pod.labels: Invalid value: "object": label key "rlhf.dev/role" ' + OWNED_KEY,
        ),
        (
            {"roles": {"reward": {"pod": {"annotations": {"x.rlhf.dev/a": "x"}}}}},
            'spec.roles.reward.pod.annotations: Invalid value: "object": annotation key "x.rlhf.dev/a" '
            + OWNED_KEY,
        ),
        (
            {"pod": {"labels": {"kueue.x-k8s.io/queue-name": "q"}}},
            'spec.pod.labels: Invalid value: "object": label key "kueue.x-k8s.io/queue-name" ' + OWNED_KEY,
        ),
        (
            {"controller": {"pod": {"annotations": {"scheduling.k8s.io/group-name": "g"}}}},
            'spec.controller.pod.annotations: Invalid value: "object": annotation key "scheduling.k8s.io/group-name" '
            + OWNED_KEY,
        ),
        (
            {"pod": {"labels": {"bad key!": "x"}}},
            f'spec.pod.labels: Invalid value: "object": label key "bad key!" {LABEL_KEY}, e.g. team or example.com/team',
        ),
        (
            {"pod": {"labels": {"team": "not valid"}}},
            'spec.pod.labels: Invalid value: "object": label "team": value "not valid" is not a valid label value; '
            "valid: at most 63 letters, digits, '-', '_' or '.', starting and ending with a letter or digit (or empty)",
        ),
        (
            {"pod": {"unknown": 1}},
            "spec.pod.unknown: unknown field; valid fields: env, labels, annotations, volumes",
        ),
        # resources, devices, controller, image
        (
            {"roles": {"actor": {"resources": {"devices": {"rdma/hca": 0}}}}},
            'spec.roles.actor.resources.devices: Invalid value: "object": "rdma/hca": the count must be >= 1 '
            "(leave the device out for none)",
        ),
        (
            {"roles": {"actor": {"resources": {"devices": {"nvidia.com/gpu": 1}}}}},
            'spec.roles.actor.resources.devices: Invalid value: "object": nvidia.com/gpu is set by gpus; use the '
            "role's resources.gpus",
        ),
        (
            {"roles": {"rollout": {"resources": {"devices": {"memory": 1}}}}},
            'spec.roles.rollout.resources.devices: Invalid value: "object": "memory" is not an extended resource '
            "name; valid: domain/name outside kubernetes.io, e.g. rdma/hca or vpc.amazonaws.com/efa",
        ),
        (
            {"roles": {"actor": {"resources": {"devices": {"example.kubernetes.io/x": 1}}}}},
            'spec.roles.actor.resources.devices: Invalid value: "object": "example.kubernetes.io/x" is not an '
            "extended resource name; valid: domain/name outside kubernetes.io, e.g. rdma/hca or vpc.amazonaws.com/efa",
        ),
        (
            {"roles": {"actor": {"resources": {"devices": {"rdma/hca": "one"}}}}},
            "spec.roles.actor.resources.devices.rdma/hca: 'one' is not an integer",
        ),
        (
            {"roles": {"rollout": {"resources": {"ephemeralStorage": "big"}}}},
            "spec.roles.rollout.resources.ephemeralStorage: 'big' is not valid; valid: a Kubernetes quantity",
        ),
        (
            {"controller": {"nodePool": "cpu"}},
            'spec.controller.nodePool: Invalid value: "cpu": spec.controller.nodePool must name an entry of spec.nodePools: "cpu" is not one; valid: none defined',
        ),
        (
            {"controller": {"resources": {"gpus": 1}}},
            "spec.controller.resources.gpus: unknown field; valid fields: cpu, memory, shm, ephemeralStorage",
        ),
        (
            {"imagePullPolicy": "Sometimes"},
            "spec.imagePullPolicy: 'Sometimes' is not valid; valid: Always, IfNotPresent, Never",
        ),
        ({"imagePullSecrets": ["regcred"]}, "spec.imagePullSecrets[0]: expected a mapping, got 'regcred'"),
        (
            {"imagePullSecrets": [{"name": "Reg_Cred"}]},
            f"spec.imagePullSecrets[0].name: 'Reg_Cred' is not valid; valid: {DNS_SUBDOMAIN}",
        ),
    ],
)
def test_bad_pod_settings_name_the_field_the_value_and_what_is_valid(overrides, expected):
    doc = job()
    doc["spec"].update(overrides)
    errs = errors_of(doc)
    if "is not valid; valid: a Kubernetes quantity" in expected:
        assert any(e.startswith(expected) for e in errs), errs
    else:
        assert expected in errs, errs


def _storage(**spec_updates):
    doc = job()
    doc["spec"].update(spec_updates)
    j = parse_job(doc)
    return cluster_storage_findings(j.spec, j.metadata_name)


CKPT_FIX = (
    "mount a volume at or above {where} in spec.pod.volumes (a persistentVolumeClaim with access mode "
    "ReadWriteMany, so that they all see it)"
)
# (case, spec updates, errors, warnings); GRPO defaults: controller, actor, reference, reward pods (GRPO trains no critic: spec.unused_roles).
STORAGE = [
    (
        "a shared PVC at the working directory: relative run and checkpoint dirs are on it",
        {"pod": {"volumes": [WORK_PVC]}},
        [],
        [],
    ),
    (
        "no volumes: checkpoints on each pod's own workspace emptyDir (models/tiny may be a hub id: not checked)",
        {},
        [
            "spec.checkpoint.dir: '<output.dir>/checkpoints' (/workspace/runs/demo/checkpoints in the pods) is on "
            "the emptyDir 'workspace' of the controller pod and actor pod: every pod has its own, so "
            "the files one of them writes there are invisible to the others; "
            + CKPT_FIX.format(where="/workspace/runs/demo/checkpoints")
        ],
        [
            "spec.output.dir: 'runs/demo' (/workspace/runs/demo in the pods) is on the emptyDir 'workspace' of the "
            "controller pod: it is lost when the pod is replaced (a gang restart); mount a volume at or above "
            "/workspace/runs/demo in spec.pod.volumes to keep it",
            "spec.data.path: 'data/prompts.jsonl' (/workspace/data/prompts.jsonl in the pods) is on the emptyDir "
            "'workspace' of the controller pod, which starts empty; put it on a volume (spec.pod.volumes) or in "
            "the image",
        ],
    ),
    (
        "each of several reward models is checked where the reward pods read it",
        {
            "pod": {"volumes": [WORK_PVC]},
            "reward": {"functions": [], "models": [{"path": "models/rm-a"}, {"path": "/tmp/rm-b"}]},
        },
        [],
        [
            "spec.reward.models[1].path: '/tmp/rm-b' is on the emptyDir 'tmp' of the reward pod, which starts "
            "empty; put it on a volume (spec.pod.volumes) or in the image"
        ],
    ),
    (
        "an absolute checkpoint dir on no volume: the read-only root filesystem",
        {
            "pod": {"volumes": [WORK_PVC]},
            "checkpoint": {"dir": "/checkpoints/demo"},
            "roles": {"critic": {"replicas": 0}, "actor": {"replicas": 2}},
        },
        [
            "spec.checkpoint.dir: '/checkpoints/demo' is on the read-only root filesystem of the controller pod "
            "and actor pods; " + CKPT_FIX.format(where="/checkpoints/demo")
        ],
        [],
    ),
    (
        "the checkpoint volume mounted in the actor pods only",
        {
            "checkpoint": {"dir": "/ckpt"},
            "output": {"dir": "/tmp/runs/{name}"},
            "roles": {
                "critic": {"replicas": 0},
                "actor": {
                    "pod": {
                        "volumes": [
                            {"name": "c", "mountPath": "/ckpt", "persistentVolumeClaim": {"claimName": "c"}}
                        ]
                    }
                },
            },
            "model": {"path": "/models/m"},
            "data": {"path": "/data/p.jsonl"},
        },
        [
            "spec.checkpoint.dir: '/ckpt' is on the read-only root filesystem of the controller pod; "
            + CKPT_FIX.format(where="/ckpt")
        ],
        [
            "spec.output.dir: '/tmp/runs/demo' is on the emptyDir 'tmp' of the controller pod: it is lost when the "
            "pod is replaced (a gang restart); mount a volume at or above /tmp/runs/demo in spec.pod.volumes to keep it"
        ],
    ),
    (
        "different claims at the same path",
        {
            "checkpoint": {"dir": "/ckpt/demo"},
            "pod": {"volumes": [WORK_PVC]},
            "controller": {
                "pod": {
                    "volumes": [
                        {"name": "c", "mountPath": "/ckpt", "persistentVolumeClaim": {"claimName": "a"}}
                    ]
                }
            },
            "roles": {
                "critic": {"replicas": 0},
                "actor": {
                    "pod": {
                        "volumes": [
                            {"name": "c", "mountPath": "/ckpt", "persistentVolumeClaim": {"claimName": "b"}}
                        ]
                    }
                },
            },
        },
        [
            "spec.checkpoint.dir: '/ckpt/demo' is on different volumes in the controller pod and actor pod "
            "(controller: volume 'c' (persistentVolumeClaim); actor: volume 'c' (persistentVolumeClaim)); mount the "
            "same volume there in all of them (spec.pod.volumes)"
        ],
        [],
    ),
    (
        "a read-only claim",
        {"pod": {"volumes": [{**WORK_PVC, "readOnly": True}]}},
        [
            "spec.output.dir: 'runs/demo' (/workspace/runs/demo in the pods) is on the read-only volume 'work' "
            "(persistentVolumeClaim) of the controller pod; mount a volume at or above /workspace/runs/demo in "
            "spec.pod.volumes",
            "spec.checkpoint.dir: '<output.dir>/checkpoints' (/workspace/runs/demo/checkpoints in the pods) is on "
            "the read-only volume 'work' (persistentVolumeClaim) of the controller pod and actor pod; "
            + CKPT_FIX.format(where="/workspace/runs/demo/checkpoints"),
        ],
        [],
    ),
    (
        "a hostPath: shared only on one node (a warning, not an error)",
        {
            "pod": {
                "volumes": [{"name": "work", "mountPath": "/workspace", "hostPath": {"path": "/srv/rlhf"}}]
            }
        },
        [],
        [
            "spec.output.dir: 'runs/demo' (/workspace/runs/demo in the pods) is on the hostPath volume 'work': the "
            "controller pod finds them again after a restart only on the same node; a persistentVolumeClaim "
            "(ReadWriteMany) does not depend on that",
            "spec.checkpoint.dir: '<output.dir>/checkpoints' (/workspace/runs/demo/checkpoints in the pods) is on the "
            "hostPath volume 'work': the controller pod and actor pod see the same files only while they "
            "run on the same node; a persistentVolumeClaim (ReadWriteMany) does not depend on that",
        ],
    ),
    (
        "the model on a volume some readers lack; a hub id is not checked",
        {
            "pod": {"volumes": [WORK_PVC]},
            "roles": {
                "actor": {
                    "pod": {
                        "volumes": [
                            {"name": "m", "mountPath": "/models", "persistentVolumeClaim": {"claimName": "m"}}
                        ]
                    }
                }
            },
            "model": {"path": "/models/tiny", "tokenizer": "Qwen/Qwen2.5-0.5B"},
        },
        [],
        [
            "spec.model.path: '/models/tiny' is on a volume in some pods but on the image's filesystem in the "
            "controller pod and reference pod, which read it too; mount the volume there as well "
            "(spec.pod.volumes)"
        ],
    ),
    (
        "the evaluation's prompts where the controller pod starts with an empty directory",
        {
            "pod": {"volumes": [WORK_PVC]},
            "eval": {"path": "/scratch/eval.jsonl"},
            "controller": {"pod": {"volumes": [{"name": "s", "mountPath": "/scratch", "emptyDir": {}}]}},
        },
        [],
        [
            "spec.eval.path: '/scratch/eval.jsonl' is on the emptyDir 's' of the controller pod, which starts "
            "empty; put it on a volume (spec.pod.volumes) or in the image"
        ],
    ),
]


@pytest.mark.parametrize("case,updates,errors,warnings", STORAGE, ids=[c[0] for c in STORAGE])
def test_cluster_storage_findings(case, updates, errors, warnings):
    found = _storage(**updates)
    assert found.errors == errors
    assert found.warnings == warnings


def test_pod_paths_resolve_against_the_working_directory_and_home():
    assert pod_path("runs/demo") == "/workspace/runs/demo"
    assert pod_path("./data/../p.jsonl") == "/workspace/p.jsonl"
    assert pod_path("/abs/x") == "/abs/x"
    assert pod_path("~/.cache/m") == "/tmp/home/.cache/m"


def test_every_example_manifest_is_valid_and_the_pvc_example_is_valid_on_a_cluster():
    names = sorted(p.name for p in EXAMPLES.glob("*.yaml"))
    assert "grpo-pvc.yaml" in names
    for name in names:
        load_manifest(EXAMPLES / name)
    j = load_manifest(EXAMPLES / "grpo-pvc.yaml")
    assert cluster_storage_findings(j.spec, j.metadata_name) == StorageFindings([], [])


def test_cli_validate_cluster(tmp_path):
    cmd = [sys.executable, "-m", "rlhf_trainer.cli", "validate", "--cluster"]
    ok = subprocess.run([*cmd, str(EXAMPLES / "grpo-pvc.yaml")], capture_output=True, text=True)
    assert ok.returncode == 0 and "valid (grpo-pvc, algorithm grpo)" in ok.stdout, ok.stderr
    # The GPU example without its volumes: the checkpoints would land on the read-only root.
    doc = yaml.safe_load((EXAMPLES / "grpo-h100.yaml").read_text())
    del doc["spec"]["pod"], doc["spec"]["output"]
    bare = tmp_path / "grpo-h100.yaml"
    bare.write_text(yaml.safe_dump(doc))
    res = subprocess.run([*cmd, str(bare)], capture_output=True, text=True)
    assert res.returncode == 1
    assert "grpo-h100.yaml: invalid on a cluster" in res.stderr
    assert "spec.checkpoint.dir: '/checkpoints/grpo-h100' is on the read-only root filesystem" in res.stderr
    assert "warning: spec.output.dir: 'runs/grpo-h100'" in res.stderr
    local = subprocess.run(cmd[:-1] + [str(bare)], capture_output=True, text=True)
    assert local.returncode == 0 and not local.stderr  # without --cluster: the schema checks only
