"""The chart's monitoring files are copies of manifests/monitoring/, refreshed by `rlhf crd --write`
and checked by `rlhf crd --check`: one source, no hand-kept copy to drift."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

from rlhf_operator import chart_copies


def test_the_chart_copies_are_up_to_date() -> None:
    assert chart_copies.stale() == [], "run `rlhf crd --write`"
    names = {copy.name for _, copy in chart_copies.pairs()}
    assert {"prometheus-rules.yaml", "rlhf-job.json", "rlhf-operator.json"} <= names


def _tree(tmp: Path) -> Path:
    """A copy of the repository's monitoring sources and the chart's copies."""
    for rel in (chart_copies.SOURCE, chart_copies.CHART / "files", chart_copies.CHART / "dashboards"):
        shutil.copytree(chart_copies.ROOT / rel, tmp / rel)
    return tmp


def test_an_edited_source_a_hand_edited_copy_and_a_leftover_are_found_and_fixed(tmp_path: Path) -> None:
    root = _tree(tmp_path)
    assert chart_copies.stale(root) == []
    src = root / chart_copies.SOURCE
    (src / "prometheus-rules.yaml").write_text((src / "prometheus-rules.yaml").read_text() + "# new\n")
    hand_edited = root / chart_copies.CHART / "dashboards" / "rlhf-job.json"
    hand_edited.write_text(hand_edited.read_text().replace("rlhf", "RLHF"))
    leftover = root / chart_copies.CHART / "dashboards" / "removed.json"
    leftover.write_text("{}")
    rules_copy = root / chart_copies.CHART / "files" / "prometheus-rules.yaml"
    assert set(chart_copies.stale(root)) == {rules_copy, hand_edited, leftover}
    assert set(chart_copies.write(root)) == {rules_copy, hand_edited, leftover}
    assert chart_copies.stale(root) == [] and not leftover.exists()
    assert rules_copy.read_text().endswith("# new\n")


def test_crd_check_reports_a_stale_chart_copy() -> None:
    """`rlhf crd --check` without files checks the CRDs and the chart's monitoring copies."""
    res = subprocess.run(
        [sys.executable, "-m", "rlhf_trainer.cli", "crd", "--check"], capture_output=True, text=True
    )
    assert res.returncode == 0, res.stderr
    assert "prometheus-rules.yaml" in res.stdout
