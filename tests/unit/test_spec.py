"""The job spec: loading, error messages that name the field, defaults, the OpenAPI schema."""

from __future__ import annotations

import copy
import subprocess
import sys
import textwrap

import pytest
import yaml

from rlhf_trainer import spec as S

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
    with pytest.raises(S.SpecError) as info:
        S.parse_job(doc)
    return info.value.errors


def test_minimal_manifest_gets_defaults():
    j = S.parse_job(job())
    assert j.metadata_name == "demo" and j.namespace == "default"
    assert j.spec.algorithm.name == "grpo"
    assert j.spec.rollout.samples_per_prompt == 4
    assert j.spec.roles.placement == "colocated"
    assert j.spec.roles.rollout.min_replicas == 1
    assert j.spec.reward.functions[0].weight == 1.0


def test_camel_case_keys_map_to_fields():
    j = S.parse_job(
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
        ({"algorithm__name": "ppo2"}, "spec.algorithm.name: unknown algorithm 'ppo2'; valid: ppo, grpo"),
        (
            {"roles__rollout": {"minReplicas": 3, "maxReplicas": 2, "replicas": 2}},
            "minReplicas (3) must be <= maxReplicas (2)",
        ),
        (
            {"roles__rollout": {"replicas": 5, "maxReplicas": 4}},
            "spec.roles.rollout.replicas: 5 must lie in [minReplicas=1, maxReplicas=4]",
        ),
        (
            {"roles__actor": {"nodePool": "h100"}},
            "spec.roles.actor.nodePool: 'h100' is not a name in spec.nodePools (defined: none defined)",
        ),
        (
            {"roles__actor": {"resources": {"gpus": -1}}},
            "spec.roles.actor.resources.gpus: -1 is below the minimum 0",
        ),
        (
            {"roles__actor": {"resources": {"memory": "lots"}}},
            "spec.roles.actor.resources.memory: 'lots' does not match",
        ),
        ({"reward": {"functions": []}}, "spec.reward: needs at least one entry in `functions` or a `model`"),
        (
            {"reward__functions": [{"path": "not an import path"}]},
            "spec.reward.functions[0].path: 'not an import path' does not match",
        ),
        (
            {"training__miniBatchSize": 7},
            "spec.training.miniBatchSize: 7 must divide the batch of 32 responses",
        ),
        ({"data": None}, "spec.data: must not be null"),
    ],
)
def test_bad_values_name_the_field_and_what_is_valid(overrides, expected):
    errs = errors_of(job(**overrides))
    assert any(expected in e for e in errs), errs


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
    assert any(e.startswith("metadata.name: 'Bad_Name'") for e in errs)


def test_all_errors_reported_at_once():
    errs = errors_of(job(rollout__engine="x", training__steps=0, model__typo=1))
    assert len(errs) == 3


def test_load_manifest_errors(tmp_path):
    with pytest.raises(S.SpecError, match="cannot read the manifest"):
        S.load_manifest(tmp_path / "absent.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("spec: [unclosed")
    with pytest.raises(S.SpecError, match="not valid YAML"):
        S.load_manifest(bad)
    two = tmp_path / "two.yaml"
    two.write_text(yaml.safe_dump_all([MINIMAL, MINIMAL]))
    with pytest.raises(S.SpecError, match="expected exactly one RLTrainingJob document, found 2"):
        S.load_manifest(two)
    good = tmp_path / "good.yaml"
    good.write_text(yaml.safe_dump(MINIMAL))
    assert S.load_manifest(good).spec.model.path == "models/tiny"


def test_to_dict_round_trips():
    j = S.parse_job(job(rollout__maxNewTokens=9))
    again = S.parse_spec(S.to_dict(j.spec))
    assert again == j.spec


def _walk(schema, path="spec"):
    yield path, schema
    for key, sub in schema.get("properties", {}).items():
        yield from _walk(sub, f"{path}.{key}")
    if "items" in schema:
        yield from _walk(schema["items"], f"{path}[]")


def test_schema_documents_every_field_and_carries_constraints():
    schema = S.openapi_schema()
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
    rules = [r["rule"] for r in props["model"]["properties"]["path"]["x-kubernetes-validations"]]
    assert "self == oldSelf" in rules
    ro = props["roles"]["properties"]["rollout"]
    assert "x-kubernetes-validations" not in ro["properties"]["replicas"], (
        "rollout replicas must stay mutable (/scale)"
    )
    assert any("minReplicas <= self.maxReplicas" in r["rule"] for r in ro["x-kubernetes-validations"])
    assert props["algorithm"]["properties"]["params"]["x-kubernetes-preserve-unknown-fields"] is True


def test_spec_imports_without_torch():
    code = "import sys, rlhf_trainer.spec, rlhf_trainer.cli; assert 'torch' not in sys.modules and 'ray' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_cli_validate(tmp_path):
    good = tmp_path / "good.yaml"
    good.write_text(yaml.safe_dump(MINIMAL))
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(job(rollout__engine="x")))
    ok = subprocess.run(
        [sys.executable, "-m", "rlhf_trainer.cli", "validate", str(good)], capture_output=True, text=True
    )
    assert ok.returncode == 0 and "valid (demo, algorithm grpo)" in ok.stdout
    res = subprocess.run(
        [sys.executable, "-m", "rlhf_trainer.cli", "validate", str(bad)], capture_output=True, text=True
    )
    assert res.returncode == 1
    assert "spec.rollout.engine: 'x' is not valid" in textwrap.dedent(res.stderr)


def test_manifest_reference_doc_is_fresh():
    from pathlib import Path

    doc = Path(__file__).resolve().parents[2] / "docs" / "manifest-reference.md"
    assert doc.read_text() == S.reference_markdown(), (
        "docs/manifest-reference.md is stale: run `rlhf validate --reference > docs/manifest-reference.md`"
    )
