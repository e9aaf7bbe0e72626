"""Bad input is refused once, the same way everywhere.

The table of tests/admission_cases.py runs here through `rlhf validate` (the whole loader) and
through the CRD's own schema and CEL rules alone (`admission.admit`, what the API server
evaluates), and in tests/cluster/test_admission_table.py through a real API server."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from admission_cases import CREATE_CASES, ROOT, UPDATE_CASES, base, variant

from rlhf_api import admission, algorithm_params, cel
from rlhf_trainer.cli import main

EXAMPLES = sorted((ROOT / "manifests" / "examples").glob("*.yaml"))


def _validate(
    tmp_path: Path, doc: dict[str, Any], old: dict[str, Any] | None, capsys: Any
) -> tuple[int, str]:
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(doc))
    argv = ["validate", str(path)]
    if old is not None:
        (tmp_path / "old.yaml").write_text(yaml.safe_dump(old))
        argv += ["--old", str(tmp_path / "old.yaml")]
    rc = main(argv)
    out = capsys.readouterr()
    return rc, out.out + out.err


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_every_example_is_valid_in_both_places(path: Path, tmp_path: Path, capsys: Any) -> None:
    doc = next(d for d in yaml.safe_load_all(path.read_text()) if d and d.get("kind") == "RLTrainingJob")
    _, errs = admission.admit(doc)
    assert errs == [], errs
    assert main(["validate", str(path)]) == 0, capsys.readouterr().err


def test_the_table_is_large_and_covers_each_class() -> None:
    assert len(CREATE_CASES) >= 60
    assert {c[1] for c in CREATE_CASES} >= {
        "names",
        "impossible",
        "empty",
        "params",
        "metadata",
        "types",
        "cross-field",
    }
    assert len(UPDATE_CASES) >= 10
    assert sum(1 for c in UPDATE_CASES if c[2] is None) >= 3


@pytest.fixture(autouse=True)
def _strict_messages(monkeypatch: pytest.MonkeyPatch) -> None:
    """A messageExpression the Python CEL library cannot evaluate fails the test (the server's
    text and `rlhf validate`'s would differ)."""
    monkeypatch.setattr(admission, "STRICT_MESSAGES", True)


@pytest.mark.parametrize("case,kind,change,field", CREATE_CASES, ids=[c[0] for c in CREATE_CASES])
def test_invalid_manifest_is_refused_by_both_naming_the_field(
    case: str, kind: str, change: Any, field: str, tmp_path: Path, capsys: Any
) -> None:
    doc = variant(change)
    # The API server's verdict, from the CRD's own schema and rules evaluated here.
    _, errs = admission.admit(doc)
    assert any(e.startswith(field) for e in errs), (
        f"{case}: the CRD's rules do not refuse it at {field}: {errs}"
    )
    # `rlhf validate`'s verdict, with its own message.
    rc, out = _validate(tmp_path, doc, None, capsys)
    assert rc == 1, f"{case}: rlhf validate accepted it\n{out}"
    assert f"- {field}" in out, f"{case}: the message does not name {field}\n{out}"


@pytest.mark.parametrize("case,change,field", UPDATE_CASES, ids=[c[0] for c in UPDATE_CASES])
def test_updates_immutable_refused_elastic_allowed(
    case: str, change: Any, field: str | None, tmp_path: Path, capsys: Any
) -> None:
    old, new = base(), variant(change)
    _, errs = admission.admit(new, old)
    rc, out = _validate(tmp_path, new, old, capsys)
    if field is None:
        assert errs == [] and rc == 0, f"{case}: refused\n{errs}\n{out}"
    else:
        assert any(e.startswith(field) for e in errs), f"{case}: {errs}"
        assert rc == 1 and f"- {field}" in out, f"{case}\n{out}"


def test_the_base_is_valid_and_an_unchanged_update_too() -> None:
    assert admission.admit(base())[1] == []
    assert admission.admit(base(), base())[1] == []


def test_transition_rules_need_an_old_object() -> None:
    """On create there is no old object: immutability does not apply (the server skips the rule)."""
    doc = base()
    doc["spec"]["model"].pop("tokenizer")
    assert admission.admit(doc)[1] == []
    assert admission.admit(doc, base())[1] != []  # ... but removing it from an existing job is a change


def test_defaults_fill_every_documented_default() -> None:
    doc = yaml.safe_load((ROOT / "manifests" / "examples" / "quickstart.yaml").read_text())
    stored, errs = admission.admit(doc)
    assert errs == []
    spec = stored["spec"]
    assert spec["nodePools"] == [] and spec["pod"]["env"] == [] and spec["pod"]["labels"] == {}
    assert spec["roles"]["rollout"]["pod"]["volumes"] == []
    assert "customParams" not in spec["algorithm"]  # free-form: no default (a rule asks has())


def test_a_rule_reading_an_absent_field_is_an_evaluation_error_as_on_the_server() -> None:
    """What broke `kubectl apply` of the examples: a rule reading a field without a default."""
    schema = {
        "type": "object",
        "properties": {"nodePools": {"type": "array", "items": {"type": "string"}}},
        "x-kubernetes-validations": [
            {"rule": "self.nodePools.all(p, p != '')", "message": "names must be unique"}
        ],
    }
    errs: list[str] = []
    admission._walk(schema, {}, admission._ABSENT, "spec", errs)
    assert errs and "no such key: nodePools" in errs[0], errs


def test_a_wrongly_typed_field_blocks_the_cel_rules_as_on_the_server() -> None:
    """The API server evaluates no CEL rule once the schema finds a wrong type (its hasBlockingErr):
    a rule over `spec.rollout` would only fail to evaluate. `parse_job` now runs the CRD's checks
    after the loader's own errors, so without this a wrong type came with CEL evaluation noise."""
    from rlhf_api.fields import SpecError
    from rlhf_api.loader import parse_job

    doc = base()
    doc["spec"]["rollout"] = 5
    errs = admission.admit(doc)[1]
    assert errs[-1] == admission.RULES_NOT_CHECKED, errs
    assert not any("evaluating rule" in e for e in errs), errs
    with pytest.raises(SpecError) as err:
        parse_job(doc)
    assert err.value.errors[0].startswith("spec.rollout: expected a mapping"), err.value.errors
    assert not any("evaluating rule" in e or "CELEvalError" in e for e in err.value.errors), err.value.errors
    # A bound (not blocking) still lets the rules run: both kinds of violation are reported.
    doc = base()
    doc["spec"]["rollout"]["temperature"] = -1.0
    doc["spec"]["roles"]["placement"] = "colocated"
    doc["spec"]["rollout"]["maxStaleness"] = 1
    errs = admission.admit(doc)[1]
    assert any(e.startswith("spec.rollout.temperature") for e in errs), errs
    assert any(e.startswith("spec.rollout.maxStaleness") for e in errs), errs


def test_messages_name_the_value_and_what_is_valid(tmp_path: Path, capsys: Any) -> None:
    doc = base()
    doc["spec"]["roles"]["rollout"]["replicas"] = 9
    doc["spec"]["roles"]["actor"]["resources"]["memory"] = "lots"
    doc["spec"]["algorithm"]["params"]["klCoeff"] = 0.01
    _, errs = admission.admit(doc)
    text = "\n".join(errs)
    assert (
        "spec.roles.rollout.replicas: Invalid value: 9: rollout.replicas must lie in [minReplicas, maxReplicas] = [1, 4]"
        in text
    )
    assert 'spec.roles.actor.resources.memory: Invalid value: "lots"' in text and "8Gi" in text
    assert 'unknown field "spec.algorithm.params.klCoeff"' in text and "klCoef" in text
    # The loader's own wording for params: the path, the value and every valid key.
    errs = algorithm_params.check_params("grpo", {"klCoeff": 0.01})
    assert errs[0].startswith(
        "spec.algorithm.params.klCoeff: unknown param 'klCoeff' of algorithm grpo (value 0.01); valid: "
    )
    assert "klCoef" in errs[0] and "epsilon" in errs[0]
    errs = algorithm_params.check_params("ppo", {"gamma": 1.5})
    assert errs == ["spec.algorithm.params.gamma: param 'gamma': gamma must be in [0, 1], got 1.5"]


def test_a_custom_algorithm_keeps_free_form_params() -> None:
    doc = base()
    doc["spec"]["algorithm"] = {
        "name": "my_pkg.algos:MyAlgo",
        "params": {"klCoef": 0.01},
        "customParams": {"anything": {"nested": [1, 2]}, "myCoef": "x"},
    }
    stored, errs = admission.admit(doc)
    assert errs == []
    assert stored["spec"]["algorithm"]["customParams"]["anything"] == {"nested": [1, 2]}
    assert algorithm_params.check_params("my_pkg.algos:MyAlgo", {"anything": 1}) == []


def test_every_rule_of_the_crd_compiles_in_python() -> None:
    """A rule the Python CEL library cannot parse would make `rlhf validate` disagree with the server."""
    from rlhf_operator.crd import build_crd

    schema = build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]

    def rules(node: Any) -> Any:
        if isinstance(node, dict):
            for r in node.get("x-kubernetes-validations", []):
                yield r["rule"]
                if "messageExpression" in r:
                    yield r["messageExpression"]
            for v in node.values():
                yield from rules(v)
        elif isinstance(node, list):
            for v in node:
                yield from rules(v)

    found = list(rules(schema))
    assert len(found) > 50
    for expr in found:
        cel.program(expr)


def test_admission_and_params_import_without_torch() -> None:
    code = (
        "import sys, rlhf_api.admission, rlhf_api.algorithm_params; "
        "rlhf_api.admission.job_schema(); assert 'torch' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_every_name_the_operator_derives_from_an_admitted_job_is_valid() -> None:
    """At the limits the rules allow, the Service, pods, ConfigMap and Secret names stay valid."""
    import re

    from rlhf_api import contract

    doc = base()
    name = "a" * admission.MAX_JOB_NAME
    doc["metadata"]["name"] = name
    doc["spec"]["roles"]["reference"]["replicas"] = 100  # last pod: <50>-reference-99, 63 characters
    doc["spec"]["roles"]["rollout"]["maxReplicas"] = 900  # the job within its 1024 pods
    assert admission.admit(doc)[1] == []
    label = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
    assert re.match(admission.JOB_NAME_RE, name) and len(name) <= 63  # the headless Service, label values
    last = {"actor": 2, "critic": 1, "reference": 100, "reward": 1, "rollout": 900}
    for role, count in last.items():
        pod = contract.pod_name(name, role, count - 1)
        assert label.match(pod) and len(pod) <= 63, pod
    assert label.match(contract.pod_name(name, contract.CONTROLLER_ROLE))
    for other in (contract.spec_config_map_name(name), contract.ray_token_secret_name(name, "0" * 36)):
        assert len(other) <= 253 and all(label.match(p) for p in other.split("."))
    doc["spec"]["roles"]["reference"]["replicas"] = 101  # <50>-reference-100: 64 characters
    assert any(e.startswith("metadata.name: pod ") for e in admission.admit(doc)[1])


def test_params_errors_name_the_key_with_the_algorithm_library_loaded_too() -> None:
    """Once torch's algorithm library is imported, names are looked up in its registries; the
    error still names the key."""
    pytest.importorskip("torch")
    import rlhf_trainer.algorithms  # noqa: F401  (binds the registries)

    errs = algorithm_params.check_params("grpo", {"advantageEstimator": "gaee"})
    assert len(errs) == 1 and errs[0].startswith(
        "spec.algorithm.params.advantageEstimator: unknown advantage estimator 'gaee'"
    )


def test_the_torch_free_choices_are_the_registries_entries() -> None:
    """The CRD lists each component's built-in names without importing torch; they must be the
    registries' own."""
    pytest.importorskip("torch")
    from rlhf_trainer.algorithms import registry

    for choices in (
        algorithm_params.ADVANTAGE_ESTIMATOR_NAMES,
        algorithm_params.POLICY_LOSS_NAMES,
        algorithm_params.LOSS_AGGREGATION_NAMES,
        algorithm_params.KL_ESTIMATOR_NAMES,
        algorithm_params.KL_CONTROLLER_NAMES,
        algorithm_params.PREFERENCE_LOSS_NAMES,
    ):
        assert sorted(choices.names) == getattr(registry, choices.registry).names(), choices.registry
    assert sorted(algorithm_params.BUILTIN_PARAMS) == registry.ALGORITHMS.names()
    for name, params in algorithm_params.BUILTIN_PARAMS.items():
        assert registry.ALGORITHMS.get(name).Params is params


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_the_defaulted_spec_the_operator_hands_to_the_pods_is_admitted_too(path: Path) -> None:
    """The controller pod loads `to_dict(spec)` (every default written out) back through the same
    rules: a Python default the CRD's rules refuse would stop every job at start."""
    from rlhf_api.fields import to_dict
    from rlhf_api.loader import load_manifest

    job = load_manifest(path)
    doc = {
        "apiVersion": "rlhf.dev/v1alpha1",
        "kind": "RLTrainingJob",
        "metadata": {"name": job.metadata_name},
    }
    doc["spec"] = to_dict(job.spec)
    assert admission.admit(doc)[1] == []
