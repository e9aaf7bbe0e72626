"""The spec snippets of docs/trainer.md are valid: each YAML block under a section named here is
merged into the quickstart manifest's spec and checked by `rlhf validate`."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from rlhf_trainer.cli import main

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "trainer.md"


def yaml_blocks(section: str) -> list[dict[str, Any]]:
    """The YAML blocks of docs/trainer.md's `## <section>` (up to the next `## `), parsed."""
    text = DOC.read_text()
    body = text.split(f"\n## {section}\n", 1)[1].split("\n## ", 1)[0]
    return [yaml.safe_load(b) for b in re.findall(r"```yaml\n(.*?)```", body, flags=re.S)]


@pytest.mark.parametrize(("section", "key"), [("Evaluation", "eval"), ("Reward models", "reward")])
def test_the_documented_snippet_validates(
    section: str, key: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    blocks = [b for b in yaml_blocks(section) if isinstance(b, dict) and key in b]
    assert blocks, f"docs/trainer.md's section {section!r} has no YAML block of spec.{key}"
    for i, block in enumerate(blocks):
        doc = yaml.safe_load((ROOT / "manifests" / "examples" / "quickstart.yaml").read_text())
        doc["spec"].update(block)
        path = tmp_path / f"{key}-{i}.yaml"
        path.write_text(yaml.safe_dump(doc))
        assert main(["validate", str(path)]) == 0, capsys.readouterr().err
        assert "valid" in capsys.readouterr().out
