"""Bad input gives a clear error or a counted, logged skip; nothing hangs."""

from __future__ import annotations

import json

import pytest

from .conftest import PROMPTS, make_job, read_metrics


def _run(job, tmp_path, **kw):
    from rlhf_trainer.controller import run

    return run(job, run_dir=tmp_path / "run", **kw)


@pytest.mark.timeout(120)
def test_missing_model_path_names_it(tmp_path):
    job = make_job(model={"path": str(tmp_path / "no-such-model")})
    with pytest.raises(FileNotFoundError, match="no-such-model"):
        _run(job, tmp_path)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("content", [None, ""])
def test_unreadable_or_empty_data_is_an_error(tiny_model, tmp_path, content):
    data = tmp_path / "prompts.jsonl"
    if content is not None:
        data.write_text(content)
    job = make_job(data={"path": str(data)})
    with pytest.raises((FileNotFoundError, ValueError, OSError), match="prompts.jsonl"):
        _run(job, tmp_path)


@pytest.mark.timeout(120)
def test_unknown_algorithm_lists_the_valid_ones(tiny_model, tmp_path):
    job = make_job(algorithm={"name": "nowhere.algos:Missing", "params": {}})
    with pytest.raises(ValueError, match="grpo"):
        _run(job, tmp_path)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_failing_reward_and_overlong_prompts_are_counted_skips(tiny_model, ray_session, tmp_path):
    rows = [json.loads(line) for line in PROMPTS.read_text().splitlines()[:64]]
    rows += [{"prompt": "1+1=" * 40, "answer": "2"}] * 8  # far beyond maxPromptLength
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    job = make_job(
        data={"path": str(data), "maxPromptLength": 16, "shuffle": False},
        reward={
            "functions": [
                {"path": "rlhf_trainer.rewards.builtin:arithmetic_exact"},
                {"path": "runtime_rewards:fails_on_seven"},
            ],
            "onError": "skip",
        },
        training={"steps": 3, "promptsPerStep": 8},
    )
    _run(job, tmp_path)
    rows_out = read_metrics(tmp_path / "run")
    assert len(rows_out) == 3
    assert sum(r["reward/errors"] for r in rows_out) > 0
    assert sum(r["reward/invalid"] for r in rows_out) > 0
    assert all(r["data/skipped_prompts"] == 8 for r in rows_out)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_failing_reward_with_fail_policy_stops_the_job_naming_the_error(tiny_model, ray_session, tmp_path):
    job = make_job(
        reward={"functions": [{"path": "runtime_rewards:fails_on_seven"}], "onError": "fail"},
        training={"steps": 4, "promptsPerStep": 8},
    )
    with pytest.raises(Exception, match="cannot score response"):
        _run(job, tmp_path)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_overlong_prompt_with_error_policy_is_a_clear_error(tiny_model, ray_session, tmp_path):
    data = tmp_path / "prompts.jsonl"
    data.write_text(json.dumps({"prompt": "1+1=" * 40, "answer": "2"}) + "\n")
    job = make_job(data={"path": str(data), "maxPromptLength": 16, "overlongPrompts": "error"})
    with pytest.raises(ValueError, match="16"):
        _run(job, tmp_path)
