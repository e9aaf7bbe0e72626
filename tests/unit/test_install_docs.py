"""The install path as documented: every document applies the CRD server-side (the CRD is too large
for client-side apply's last-applied annotation, and the size the documents give is the real one),
and docs/install.md is linked from the README and names the chart values that exist."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
CRD = ROOT / "crds" / "rlhf.dev_rltrainingjobs.yaml"
#: What client-side `kubectl apply` may store in kubectl.kubernetes.io/last-applied-configuration
#: (the API server's limit on all of an object's annotations together).
ANNOTATION_LIMIT = 262_144
DOCS = [
    ROOT / "README.md",
    ROOT / "charts" / "rlhf-operator" / "README.md",
    *sorted((ROOT / "docs").glob("*.md")),
]
SAYS_SIZE = [
    ROOT / "docs" / "install.md",
    ROOT / "docs" / "operator.md",
    ROOT / "charts" / "rlhf-operator" / "README.md",
]


def _crd_json_bytes() -> int:
    """The CRD as the last-applied annotation would hold it (compact JSON)."""
    return len(json.dumps(yaml.safe_load(CRD.read_text()), separators=(",", ":")))


def test_the_crd_is_too_large_for_client_side_apply() -> None:
    """Why the documents say --server-side: were this false, they could drop it."""
    assert _crd_json_bytes() > ANNOTATION_LIMIT


@pytest.mark.parametrize("doc", SAYS_SIZE, ids=lambda p: str(p.relative_to(ROOT)))
def test_the_documented_size_is_the_crds(doc: Path) -> None:
    said = [int(n) for n in re.findall(r"about (\d+) kB as\s+JSON", doc.read_text())]
    assert said, f"{doc} does not say the CRD's size"
    real = _crd_json_bytes() / 1000
    for kb in said:
        assert abs(kb - real) / real < 0.1, f"{doc} says about {kb} kB; the CRD is {real:.0f} kB"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_document_applies_the_crds_client_side(doc: Path) -> None:
    for line in doc.read_text().splitlines():
        for cmd in re.findall(r"kubectl apply[^`#|]*crds/", line):
            assert "--server-side" in cmd, f"{doc}: {line.strip()}"


def test_install_md_is_linked_and_names_real_chart_values() -> None:
    assert "(docs/install.md)" in (ROOT / "README.md").read_text()
    text = (ROOT / "docs" / "install.md").read_text()
    values = yaml.safe_load((ROOT / "charts" / "rlhf-operator" / "values.yaml").read_text())
    for key in re.findall(r"--set(?:-string)? ([\w.]+)=", text):
        node = values
        for part in key.split("."):
            assert isinstance(node, dict) and part in node, f"docs/install.md sets {key}, not a chart value"
            node = node[part]
    assert "kubectl apply --server-side -f crds/" in text
    assert (ROOT / "manifests" / "examples" / "first-job.yaml").exists()
    first = [
        d for d in yaml.safe_load_all((ROOT / "manifests" / "examples" / "first-job.yaml").read_text()) if d
    ]
    (job,) = [d for d in first if d["kind"] == "RLTrainingJob"]
    assert "image" not in job["spec"], "the first job runs the chart's default trainer image"
