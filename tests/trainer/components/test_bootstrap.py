"""Bootstrap: the char tokenizer, prompt files, and `ensure_model` (idempotent, atomic, safe when
several processes race). The real recipe and its learnability check run under `-m slow`."""

from __future__ import annotations

import json
import multiprocessing
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from rlhf_trainer import bootstrap
from rlhf_trainer.bootstrap import RECIPES, Recipe, ensure_model, ensure_prompts, write_prompts
from rlhf_trainer.rewards.builtin import arithmetic_exact
from rlhf_trainer.tiny_model import build_char_tokenizer


def test_char_tokenizer_round_trip(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    tok = build_char_tokenizer()
    tok.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    ids = loaded("12+7=").input_ids
    assert ids[0] == loaded.bos_token_id and len(ids) == 6  # BOS + one id per character
    assert loaded.decode(ids + [loaded.eos_token_id], skip_special_tokens=True) == "12+7="
    assert (loaded.pad_token_id, loaded.bos_token_id, loaded.eos_token_id) == (0, 1, 2)
    batch = loaded(["1+1=", "10+10="], padding=True).input_ids
    assert batch[0][:2] == [0, 0] and loaded.padding_side == "left"
    chat = loaded.apply_chat_template(
        [{"role": "user", "content": "3+4="}], tokenize=False, add_generation_prompt=True
    )
    assert chat == "3+4="


def test_write_prompts_is_seeded_and_matches_the_reward(tmp_path: Path) -> None:
    path = write_prompts("tiny-arithmetic", tmp_path / "data" / "p.jsonl", 50, seed=1)
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(rows) == 50 and set(rows[0]) == {"prompt", "answer"}
    a, b = rows[0]["prompt"].rstrip("=").split("+")
    assert int(rows[0]["answer"]) == int(a) + int(b)
    again = write_prompts("tiny-arithmetic", tmp_path / "q.jsonl", 50, seed=1)
    assert again.read_text() == path.read_text()
    answers = [r["answer"] for r in rows]
    assert arithmetic_exact([r["prompt"] for r in rows], answers, answer=answers) == [1.0] * 50
    assert ensure_prompts("tiny-arithmetic", path, 5).read_text() == path.read_text()  # kept when present


def _slow_recipe(counter: Path, version: int = 1) -> Recipe:
    def build(path: Path, seed: int) -> dict[str, Any]:
        with counter.open("a") as fh:
            fh.write("built\n")
        time.sleep(0.5)  # wide window for a racing process
        (path / "config.json").write_text("{}")
        return {"seed": seed}

    rows = lambda n, seed: [{"prompt": f"v{version}", "answer": "0"}] * n  # noqa: E731
    return Recipe(name="test-slow", build=build, rows=rows, reward="x:y", version=version)


def _ensure(path: str) -> None:
    ensure_model(SimpleNamespace(path=path, bootstrap="test-slow"))


def test_ensure_model_builds_once_under_concurrency(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    counter = tmp_path / "builds.txt"
    monkeypatch.setitem(RECIPES, "test-slow", _slow_recipe(counter))
    target = tmp_path / "models" / "tiny"
    ctx = multiprocessing.get_context("fork")  # children inherit the patched recipe table
    procs = [ctx.Process(target=_ensure, args=(str(target),)) for _ in range(3)]
    for p in procs:
        p.start()
    _ensure(str(target))
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    assert counter.read_text() == "built\n"
    assert json.loads((target / "bootstrap.json").read_text())["recipe"] == "test-slow"
    assert (target / "config.json").exists()
    assert [p.name for p in target.parent.iterdir() if ".tmp-" in p.name] == []  # no temp dir left
    _ensure(str(target))  # idempotent
    assert counter.read_text() == "built\n"


def test_a_model_or_prompt_file_from_an_older_recipe_version_is_rebuilt(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    counter = tmp_path / "builds.txt"
    target = tmp_path / "m"
    monkeypatch.setitem(RECIPES, "test-slow", _slow_recipe(counter, version=1))
    _ensure(str(target))
    prompts = ensure_prompts("test-slow", tmp_path / "p.jsonl", 2)
    assert json.loads(prompts.read_text().splitlines()[0])["prompt"] == "v1"
    monkeypatch.setitem(RECIPES, "test-slow", _slow_recipe(counter, version=2))
    _ensure(str(target))
    assert counter.read_text() == "built\nbuilt\n"
    assert json.loads((target / "bootstrap.json").read_text())["version"] == 2
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".m.")) == [
        ".m.lock"
    ]  # old copy gone
    _ensure(str(target))  # current: kept
    assert counter.read_text() == "built\nbuilt\n"
    assert json.loads(ensure_prompts("test-slow", prompts, 2).read_text().splitlines()[0])["prompt"] == "v2"
    # files the recipe did not make are never replaced
    mine = tmp_path / "mine.jsonl"
    mine.write_text('{"prompt": "user"}\n')
    assert ensure_prompts("test-slow", mine, 2).read_text() == '{"prompt": "user"}\n'
    (tmp_path / "own-model").mkdir()
    ensure_model(SimpleNamespace(path=str(tmp_path / "own-model"), bootstrap="test-slow"))
    assert list((tmp_path / "own-model").iterdir()) == []


def test_a_failed_build_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(path: Path, seed: int) -> dict[str, Any]:
        (path / "half-written").write_text("x")
        raise RuntimeError("disk full")

    monkeypatch.setitem(RECIPES, "broken", Recipe("broken", broken, lambda n, s: [], "x:y"))
    target = tmp_path / "m"
    with pytest.raises(RuntimeError, match="disk full"):
        ensure_model(SimpleNamespace(path=str(target), bootstrap="broken"))
    assert not target.exists()
    assert [p.name for p in tmp_path.iterdir() if ".tmp-" in p.name] == []


def test_missing_model_and_unknown_recipe(tmp_path: Path) -> None:
    missing = str(tmp_path / "nowhere")
    with pytest.raises(FileNotFoundError, match=r"model.path '.*nowhere' does not exist.*tiny-arithmetic"):
        ensure_model(SimpleNamespace(path=missing, bootstrap=None))
    ensure_model(
        SimpleNamespace(path="Qwen/Qwen2.5-0.5B", bootstrap=None)
    )  # a hub id is the loader's business
    ensure_model(SimpleNamespace(path=str(tmp_path), bootstrap=None))  # exists: nothing to do
    with pytest.raises(ValueError, match="unknown bootstrap recipe 'nope'; valid: tiny-arithmetic"):
        ensure_model(SimpleNamespace(path=missing, bootstrap="nope"))


@pytest.mark.slow
def test_tiny_arithmetic_is_learnable(tmp_path: Path) -> None:
    """The real recipe: low-but-nonzero initial reward, and plain REINFORCE raises it clearly."""
    target = tmp_path / "tiny-arithmetic"
    with bootstrap.torch_threads(1):
        ensure_model(SimpleNamespace(path=str(target), bootstrap="tiny-arithmetic"))
        facts = json.loads((target / "bootstrap.json").read_text())
        assert facts["warmup_greedy_accuracy"] >= 0.9
        rewards = bootstrap.reinforce_check(target, steps=40, report=lambda _: None)
    first, last = sum(rewards[:8]) / 8, sum(rewards[-8:]) / 8
    assert 0.02 < first < 0.45, rewards
    assert last > first + 0.2, rewards
