"""Progress where stderr is no terminal (a pod's log): lines, the first, the last and at most one
per interval in between."""

from __future__ import annotations

import pytest

from rlhf_trainer.startup import LineProgress


def test_lines_first_last_and_per_interval(capsys: pytest.CaptureFixture[str]) -> None:
    p = LineProgress(total=5, initial=0, desc="job", interval=3600)
    for i in range(5):
        p.set_postfix(reward=f"{i / 10:.3f}")
        p.update(1)
    lines = capsys.readouterr().err.strip().splitlines()
    assert [line.split("  ")[0] for line in lines] == ["job: step 1/5", "job: step 5/5"]
    assert "reward 0.000" in lines[0] and "reward 0.400" in lines[1]
    assert lines[1].endswith("s/step)")


def test_a_resumed_run_counts_from_its_first_step(capsys: pytest.CaptureFixture[str]) -> None:
    p = LineProgress(total=30, initial=20, desc="job", interval=0.0)
    p.update(1)
    p.update(1)
    steps = [line.split("  ")[0] for line in capsys.readouterr().err.splitlines()]
    assert steps == ["job: step 21/30", "job: step 22/30"]
