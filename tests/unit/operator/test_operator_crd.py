"""The generated CRD: up to date in crds/ and the chart, documented, with the subresources asked for."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

from rlhf_operator import crd

ROOT = Path(__file__).resolve().parents[3]


def walk(schema: dict[str, Any], path: str = "") -> list[tuple[str, dict[str, Any]]]:
    out = [(path, schema)]
    for key, sub in (schema.get("properties") or {}).items():
        out.extend(walk(sub, f"{path}.{key}"))
    if isinstance(schema.get("items"), dict):
        out.extend(walk(schema["items"], f"{path}[]"))
    if isinstance(schema.get("additionalProperties"), dict):
        out.extend(walk(schema["additionalProperties"], f"{path}{{}}"))
    return out


def version() -> dict[str, Any]:
    return crd.build_crd()["spec"]["versions"][0]  # type: ignore[no-any-return]


def test_committed_crd_files_are_up_to_date() -> None:
    assert crd.stale_files() == [], "run `rlhf crd --write`"


def test_crd_check_command_fails_on_a_stale_file(tmp_path: Path) -> None:
    stale = tmp_path / "crd.yaml"
    stale.write_text(crd.render_crd().replace("rltj", "rtj"))
    fresh = tmp_path / "fresh.yaml"
    fresh.write_text(crd.render_crd())
    cmd = [sys.executable, "-m", "rlhf_trainer.cli", "crd", "--check"]
    assert subprocess.run([*cmd, str(fresh)], capture_output=True).returncode == 0
    res = subprocess.run([*cmd, str(stale)], capture_output=True, text=True)
    assert res.returncode == 1 and "stale" in res.stderr


def test_every_spec_and_status_field_has_a_description() -> None:
    root = version()["schema"]["openAPIV3Schema"]
    for part in ("spec", "status"):
        for path, schema in walk(root["properties"][part], part):
            if path.endswith("{}") or path.endswith("[]"):
                continue
            assert schema.get("description"), f"{path} has no description"


def test_strings_lists_and_maps_are_bounded_for_cel_costs() -> None:
    root = version()["schema"]["openAPIV3Schema"]
    for path, schema in walk(root["properties"]["spec"], "spec"):
        if schema.get("type") == "string" and "enum" not in schema:
            assert "maxLength" in schema, path
        if schema.get("type") == "array":
            assert "maxItems" in schema, path


def test_immutable_fields_and_cross_field_rules() -> None:
    spec = version()["schema"]["openAPIV3Schema"]["properties"]["spec"]
    # Each immutable field is kept by a transition rule of its parent naming it in `fieldPath`.
    immutable = [
        p + r["fieldPath"]
        for p, s in walk(spec, "spec")
        for r in s.get("x-kubernetes-validations", [])
        if "oldSelf" in r["rule"]
    ]
    assert "spec.model.path" in immutable
    assert "spec.algorithm.name" in immutable
    assert "spec.roles.actor.replicas" in immutable
    assert "spec.roles.rollout.resources" in immutable
    assert "spec.roles.rollout.replicas" not in immutable  # the one elastic field
    messages = [r["message"] for r in spec["x-kubernetes-validations"]]
    assert any("nodePool" in m for m in messages)


def test_scale_subresource_and_printer_columns() -> None:
    v = version()
    assert v["subresources"] == {
        "status": {},
        "scale": {
            "specReplicasPath": ".spec.roles.rollout.replicas",
            "statusReplicasPath": ".status.rollout.ready",
            "labelSelectorPath": ".status.rollout.selector",
        },
    }
    assert [c["name"] for c in v["additionalPrinterColumns"]] == [
        "Phase",
        "Step",
        "Reward",
        "Rollout",
        "Restarts",
        "Age",
    ]


def test_status_has_no_defaults_and_no_free_form_field() -> None:
    """The controller pod writes `status.progress`: a structured schema, so the API server prunes
    unknown keys and bounds every size and the depth of whatever the pod sends."""
    status = version()["schema"]["openAPIV3Schema"]["properties"]["status"]
    assert all("default" not in s for _, s in walk(status))
    assert not [p for p, s in walk(status) if s.get("x-kubernetes-preserve-unknown-fields")]
    metrics = status["properties"]["progress"]["properties"]["metrics"]
    assert metrics["maxProperties"] == 64 and metrics["additionalProperties"]["maxLength"] == 64
    assert status["properties"]["conditions"]["x-kubernetes-list-map-keys"] == ["type"]


def test_cli_module_imports_without_kopf_or_kubernetes() -> None:
    code = "import sys, rlhf_operator.cli; print(sorted(m for m in sys.modules if m.split('.')[0] in ('kopf', 'kubernetes')))"
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert res.stdout.strip() == "[]"


def test_chart_values_are_all_documented() -> None:
    """Every value has a `# --` comment (helm-docs style); the children of a documented value
    (e.g. resources.requests.cpu) are covered by it; a bare section only groups documented values."""
    lines = (ROOT / "charts" / "rlhf-operator" / "values.yaml").read_text().splitlines()
    covered_below: int | None = None
    for i, line in enumerate(lines):
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue
        indent = len(line) - len(line.lstrip())
        if covered_below is not None and indent > covered_below:
            continue
        covered_below = None
        if stripped.startswith("-"):
            continue
        j = i - 1
        while j >= 0 and lines[j].strip().startswith("#") and not lines[j].strip().startswith("# --"):
            j -= 1
        if j >= 0 and lines[j].strip().startswith("# --"):
            covered_below = indent
            continue
        assert stripped.endswith(":"), f"values.yaml line {i + 1} is undocumented: {line!r}"


def test_the_crd_carries_the_digest_of_its_own_spec_which_the_operator_expects() -> None:
    import yaml

    for path in crd.CRD_FILES:
        doc = yaml.safe_load(path.read_text())
        carried = doc["metadata"]["annotations"][crd.SCHEMA_DIGEST_ANNOTATION]
        assert carried == crd.schema_digest(doc["spec"]) == crd.expected_schema_digest(), path


def test_any_change_to_a_rule_changes_the_digest() -> None:
    spec = crd.build_crd()["spec"]
    root = spec["versions"][0]["schema"]["openAPIV3Schema"]
    root["x-kubernetes-validations"][0]["rule"] += " && true"
    assert crd.schema_digest(spec) != crd.expected_schema_digest()


def test_every_progress_key_the_trainer_writes_is_in_the_schema() -> None:
    """With a structured `status.progress`, the API server prunes what the schema does not name:
    the trainer's own reporter must write only named keys, and values within their bounds."""
    from rlhf_trainer.run_cli import StatusReporter

    metrics = {
        "reward/mean": 0.75,
        "actor/kl": 1e-3,
        "timing/step": 12.5,
        "perf/samples_per_second": 1e6,
        "actor/policy_version": 7,
        "eval/reward_mean": -1e300,
        "eval/step": 4,
    }
    progress = StatusReporter(None, "j", "ns").progress(3, 20, metrics, 2)["status"]["progress"]
    assert {"updated", "checkpointStep"} <= set(progress)
    schema = version()["schema"]["openAPIV3Schema"]["properties"]["status"]["properties"]["progress"]
    assert set(progress) <= set(schema["properties"]), set(progress) - set(schema["properties"])
    bound = schema["properties"]["metrics"]["additionalProperties"]["maxLength"]
    assert progress["metrics"] and all(len(v) <= bound for v in progress["metrics"].values())
