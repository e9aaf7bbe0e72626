"""PromptDataset: the three file formats, chat templates, overlong prompts, bad input, resumable order."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from rlhf_api.sections import DataSpec
from rlhf_trainer.data import DataError, PromptDataset, load_rows
from rlhf_trainer.tiny_model import build_char_tokenizer

ROWS: list[dict[str, Any]] = [{"prompt": f"{i}+{i}=", "answer": str(2 * i), "id": i} for i in range(10)]


@pytest.fixture(scope="module")
def tok() -> Any:
    return build_char_tokenizer()


def _jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _spec(path: Path, **kw: Any) -> DataSpec:
    return DataSpec(path=str(path), **kw)


def _check_rows(ds: PromptDataset, tok: Any) -> None:
    assert len(ds) == 10 and ds.skipped == 0
    item = next(i for i in ds.items if i.index == 3)
    assert item.text == "3+3=" and item.ids == tok("3+3=").input_ids
    assert item.columns == {"answer": "6", "id": 3}


def test_jsonl(tmp_path: Path, tok: Any) -> None:
    _check_rows(PromptDataset(_spec(_jsonl(tmp_path / "p.jsonl", ROWS)), tok), tok)


def test_parquet(tmp_path: Path, tok: Any) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(ROWS), tmp_path / "p.parquet")
    _check_rows(PromptDataset(_spec(tmp_path / "p.parquet"), tok), tok)


def test_datasets_folder(tmp_path: Path, tok: Any) -> None:
    import datasets  # a dev dependency: its absence is a broken setup, not a skip

    datasets.Dataset.from_list(ROWS).save_to_disk(str(tmp_path / "ds"))
    _check_rows(PromptDataset(_spec(tmp_path / "ds"), tok), tok)
    datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS)}).save_to_disk(str(tmp_path / "dd"))
    _check_rows(PromptDataset(_spec(tmp_path / "dd"), tok), tok)


def test_chat_template_with_strings_and_message_lists(tmp_path: Path, tok: Any) -> None:
    rows: list[dict[str, Any]] = [
        {"prompt": "1+1="},
        {"prompt": [{"role": "system", "content": "add"}, {"role": "user", "content": "2+2="}]},
    ]
    ds = PromptDataset(_spec(_jsonl(tmp_path / "c.jsonl", rows), chat_template=True), tok)
    assert [i.text for i in ds.items] == ["1+1=", "add\n2+2="]
    assert ds.items[0].ids == tok("1+1=", add_special_tokens=False).input_ids
    # the messages before the policy's template travel with the prompt (the reward model's input)
    assert [i.messages for i in ds.items] == [[{"role": "user", "content": "1+1="}], rows[1]["prompt"]]
    assert PromptDataset(_spec(_jsonl(tmp_path / "e.jsonl", rows[:1])), tok).items[0].messages is None
    with pytest.raises(DataError, match="row 1: prompt is a list"):
        PromptDataset(_spec(_jsonl(tmp_path / "d.jsonl", rows)), tok)


def test_overlong_prompts_skip_and_count(tmp_path: Path, tok: Any, caplog: pytest.LogCaptureFixture) -> None:
    rows: list[dict[str, Any]] = [*ROWS[:3], {"prompt": "x" * 50, "answer": "?"}, ROWS[3]]
    ds = PromptDataset(_spec(_jsonl(tmp_path / "p.jsonl", rows), max_prompt_length=10), tok)
    assert ds.skipped == 1 and ds.skipped_indices == [3] and len(ds) == 4
    assert "prompt 3 of" in caplog.text and "51 tokens" in caplog.text


def test_overlong_prompts_error_names_the_prompt(tmp_path: Path, tok: Any) -> None:
    rows: list[dict[str, Any]] = [*ROWS[:3], {"prompt": "x" * 50}]
    spec = _spec(_jsonl(tmp_path / "p.jsonl", rows), max_prompt_length=10, overlong_prompts="error")
    with pytest.raises(DataError, match=r"prompt 3 of .* has 51 tokens, more than data.maxPromptLength 10"):
        PromptDataset(spec, tok)


def test_all_prompts_overlong_is_an_error(tmp_path: Path, tok: Any) -> None:
    with pytest.raises(DataError, match="all 10 prompts are longer"):
        PromptDataset(_spec(_jsonl(tmp_path / "p.jsonl", ROWS), max_prompt_length=2), tok)


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda d: d / "missing.jsonl", "does not exist"),
        (lambda d: _jsonl(d / "empty.jsonl", []), "holds no rows"),
        (
            lambda d: (d / "bad.jsonl").write_text('{"prompt": "a"}\n{not json\n') and d / "bad.jsonl",
            "line 2: not valid JSON",
        ),
        (
            lambda d: (d / "list.jsonl").write_text("[1, 2]\n") and d / "list.jsonl",
            "line 1: expected a JSON object",
        ),
        (
            lambda d: (d / "bad.parquet").write_bytes(b"not parquet") and d / "bad.parquet",
            "not a readable Parquet file",
        ),
        (lambda d: (d / "p.csv").write_text("prompt\n") and d / "p.csv", "cannot tell the format"),
        (lambda d: (d / "notads").mkdir() or d / "notads", "not a folder written by Dataset.save_to_disk"),
        (lambda d: (d / "bin.jsonl").write_bytes(b"\xff\xfe\x00") and d / "bin.jsonl", "cannot be read"),
    ],
)
def test_bad_files_give_clear_errors(tmp_path: Path, tok: Any, make: Any, message: str) -> None:
    path = make(tmp_path)
    with pytest.raises(DataError, match=message) as exc:
        PromptDataset(_spec(path), tok)
    assert str(path) in str(exc.value)


def test_missing_prompt_column(tmp_path: Path, tok: Any) -> None:
    path = _jsonl(tmp_path / "p.jsonl", [{"question": "1+1=", "answer": "2"}])
    with pytest.raises(
        DataError, match=r"no prompt column 'prompt'; columns: answer, question \(set data.promptField\)"
    ):
        PromptDataset(_spec(path), tok)
    assert PromptDataset(_spec(path, prompt_field="question"), tok).items[0].text == "1+1="
    with pytest.raises(DataError, match="row 1: prompt column 'prompt' is missing"):
        PromptDataset(_spec(_jsonl(tmp_path / "q.jsonl", [ROWS[0], {"answer": "2"}])), tok)


def test_epochs_cycle_with_a_seeded_shuffle(tmp_path: Path, tok: Any) -> None:
    ds = PromptDataset(_spec(_jsonl(tmp_path / "p.jsonl", ROWS)), tok, seed=7)
    first = [i.index for i in ds.next_batch(10)]
    second = [i.index for i in ds.next_batch(10)]
    assert sorted(first) == sorted(second) == list(range(10))  # each epoch serves every prompt once
    assert first != second and first != list(range(10))  # reshuffled per epoch
    assert ds.epoch == 1 and ds.consumed == 20
    again = PromptDataset(_spec(_jsonl(tmp_path / "p.jsonl", ROWS)), tok, seed=7)
    assert [i.index for i in again.next_batch(10)] == first  # same seed, same order
    plain = PromptDataset(_spec(tmp_path / "p.jsonl", shuffle=False), tok)
    assert [i.index for i in plain.next_batch(12)] == [*range(10), 0, 1]


def test_resume_continues_exactly(tmp_path: Path, tok: Any) -> None:
    path = _jsonl(tmp_path / "p.jsonl", ROWS)
    straight = PromptDataset(_spec(path), tok, seed=3)
    expected = [[i.index for i in straight.next_batch(4)] for _ in range(7)]
    run = PromptDataset(_spec(path), tok, seed=3)
    got = [[i.index for i in run.next_batch(4)] for _ in range(3)]
    state = json.loads(json.dumps(run.state_dict()))  # as a checkpoint would store it
    resumed = PromptDataset(_spec(path), tok, seed=3)
    resumed.load_state_dict(state)
    got += [[i.index for i in resumed.next_batch(4)] for _ in range(4)]
    assert got == expected and resumed.consumed == 28
    with pytest.raises(ValueError, match="n must be >= 1"):
        resumed.next_batch(0)


def test_load_rows_expands_the_home_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    _jsonl(tmp_path / "p.jsonl", ROWS[:2])
    assert len(load_rows("~/p.jsonl")) == 2
