"""Prompt datasets: load, tokenize and serve prompts batch by batch, resumably.

`PromptDataset(data_spec, tokenizer, seed)` reads every row of a JSONL file, a Parquet file or
a folder written by `datasets.Dataset.save_to_disk`, renders and tokenizes each prompt once
(applying the tokenizer's chat template when `data_spec.chat_template` is set), and drops or
rejects prompts longer than `max_prompt_length` tokens. `next_batch(n)` serves prompts in a
seeded shuffled order, epoch after epoch; `state_dict()` holds the epoch and position so a
resumed run continues with exactly the prompts an uninterrupted run would have used.
"""

from __future__ import annotations

import json
import logging
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


class DataError(ValueError):
    """A prompt file that cannot be used; the message names the file (and row or column)."""


@dataclass
class PromptItem:
    """One prompt, ready for a rollout engine."""

    index: int
    """Row number in the data file (0-based)."""
    text: str
    """The prompt as the model sees it (after the chat template, if any)."""
    ids: list[int]
    """Token ids of `text` (special tokens as the tokenizer adds them)."""
    columns: dict[str, Any] = field(default_factory=dict)
    """Every other column of the row (passed to reward functions)."""
    messages: list[dict[str, Any]] | None = None
    """With `data.chatTemplate`: the prompt as chat messages, before the policy's template (the
    reward model renders them with its own). None: the prompt is plain text."""


def _detect_format(path: Path, fmt: str) -> str:
    if fmt != "auto":
        return fmt
    if path.is_dir():
        return "datasets"
    suffix = path.suffix.lower()
    if suffix in (".jsonl", ".json", ".ndjson"):
        return "jsonl"
    if suffix in (".parquet", ".pq"):
        return "parquet"
    raise DataError(
        f"data file {str(path)!r}: cannot tell the format from the extension {suffix!r}; use .jsonl, "
        ".parquet or a datasets folder, or set data.format to jsonl, parquet or datasets"
    )


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    rows = []
    with path.open(encoding="utf-8") as fh:
        for line_no, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise DataError(
                    f"data file {str(path)!r}, line {line_no}: not valid JSON ({err.msg})"
                ) from err
            if not isinstance(row, dict):
                raise DataError(
                    f"data file {str(path)!r}, line {line_no}: expected a JSON object, got {type(row).__name__}"
                )
            rows.append(row)
    return rows


def _read_parquet(path: Path) -> list[dict[str, Any]]:
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except Exception as err:  # noqa: BLE001 - pyarrow raises several types for a bad file
        raise DataError(f"data file {str(path)!r}: not a readable Parquet file ({err})") from err
    return table.to_pylist()


def _read_datasets(path: Path) -> list[dict[str, Any]]:
    try:
        from datasets import load_from_disk
    except ImportError as err:
        raise DataError(
            f"data folder {str(path)!r}: reading a datasets folder needs the `datasets` package"
        ) from err
    try:
        ds = load_from_disk(str(path))
    except Exception as err:  # noqa: BLE001
        raise DataError(
            f"data folder {str(path)!r}: not a folder written by Dataset.save_to_disk ({err})"
        ) from err
    if (
        hasattr(ds, "keys")
        and not hasattr(ds, "column_names")
        or isinstance(getattr(ds, "column_names", None), dict)
    ):
        splits = list(ds.keys())
        split = "train" if "train" in splits else splits[0]
        log.info("data folder %s holds splits %s; using %r", path, splits, split)
        ds = ds[split]
    return [dict(r) for r in ds]


def load_rows(path: str | Path, fmt: str = "auto") -> list[dict[str, Any]]:
    """Every row of a prompt file as a dict. Raises `DataError` for a missing, unreadable or empty file."""
    p = Path(path).expanduser()
    if not p.exists():
        raise DataError(f"data file {str(p)!r} does not exist")
    kind = _detect_format(p, fmt)
    if kind in ("jsonl", "parquet") and p.is_dir():
        raise DataError(f"data file {str(p)!r} is a folder; data.format {kind} expects a file")
    readers = {"jsonl": _read_jsonl, "parquet": _read_parquet, "datasets": _read_datasets}
    if kind not in readers:
        raise DataError(f"data.format {kind!r} is not valid; valid: auto, {', '.join(readers)}")
    try:
        rows = readers[kind](p)
    except DataError:
        raise
    except (OSError, UnicodeDecodeError) as err:
        raise DataError(f"data file {str(p)!r} cannot be read: {err}") from err
    if not rows:
        raise DataError(f"data file {str(p)!r} holds no rows")
    return rows


class PromptDataset:
    """Tokenized prompts served in seeded, shuffled epochs. See the module docstring."""

    def __init__(self, data_spec: Any, tokenizer: Any, seed: int = 0):
        self.spec = data_spec
        self.tokenizer = tokenizer
        self.seed = seed
        rows = load_rows(data_spec.path, data_spec.format)
        field_name = data_spec.prompt_field
        if field_name not in rows[0]:
            raise DataError(
                f"data file {data_spec.path!r}: no prompt column {field_name!r}; columns: {', '.join(sorted(rows[0]))} "
                "(set data.promptField)"
            )
        self.items: list[PromptItem] = []
        self.skipped: int = 0
        """Prompts dropped for being longer than `max_prompt_length`."""
        self.skipped_indices: list[int] = []
        for i, row in enumerate(rows):
            if field_name not in row or row[field_name] is None:
                raise DataError(
                    f"data file {data_spec.path!r}, row {i}: prompt column {field_name!r} is missing"
                )
            text, messages = self._render(row[field_name], i)
            ids = list(tokenizer(text, add_special_tokens=not data_spec.chat_template).input_ids)
            if len(ids) > data_spec.max_prompt_length:
                msg = (
                    f"prompt {i} of {data_spec.path!r} has {len(ids)} tokens, more than "
                    f"data.maxPromptLength {data_spec.max_prompt_length}"
                )
                if data_spec.overlong_prompts == "error":
                    raise DataError(msg + " (data.overlongPrompts: error)")
                log.warning("skipping %s", msg)
                self.skipped += 1
                self.skipped_indices.append(i)
                continue
            columns = {k: v for k, v in row.items() if k != field_name}
            self.items.append(PromptItem(index=i, text=text, ids=ids, columns=columns, messages=messages))
        if not self.items:
            raise DataError(
                f"data file {data_spec.path!r}: all {len(rows)} prompts are longer than "
                f"data.maxPromptLength {data_spec.max_prompt_length}"
            )
        self.epoch = 0
        self.position = 0
        self.consumed = 0
        """Prompts served so far, over all epochs (restored by `load_state_dict`)."""
        self._order = self._epoch_order(0)

    def _render(self, value: Any, i: int) -> tuple[str, list[dict[str, Any]] | None]:
        """The prompt as the policy sees it, and its chat messages (with `chatTemplate`)."""
        if self.spec.chat_template:
            messages = [{"role": "user", "content": value}] if isinstance(value, str) else value
            if not isinstance(messages, list) or not all(
                isinstance(m, dict) and "content" in m for m in messages
            ):
                raise DataError(
                    f"data file {self.spec.path!r}, row {i}: with chatTemplate the prompt must be a string or a "
                    f"list of {{role, content}} messages, got {value!r:.80}"
                )
            if getattr(self.tokenizer, "chat_template", None) is None:
                raise DataError("data.chatTemplate is true but the tokenizer has no chat template")
            rendered = self.tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=True
            )
            return str(rendered), [dict(m) for m in messages]
        if not isinstance(value, str):
            raise DataError(
                f"data file {self.spec.path!r}, row {i}: prompt is a {type(value).__name__}, expected a string "
                "(set data.chatTemplate: true for lists of chat messages)"
            )
        return value, None

    def __len__(self) -> int:
        return len(self.items)

    def _epoch_order(self, epoch: int) -> list[int]:
        order = list(range(len(self.items)))
        if self.spec.shuffle:
            random.Random(f"{self.seed}:{epoch}").shuffle(order)
        return order

    def next_batch(self, n: int) -> list[PromptItem]:
        """The next `n` prompts, continuing into the next (reshuffled) epoch when this one runs out."""
        if n < 1:
            raise ValueError(f"next_batch: n must be >= 1, got {n}")
        out = []
        for _ in range(n):
            if self.position >= len(self._order):
                self.epoch += 1
                self.position = 0
                self._order = self._epoch_order(self.epoch)
            out.append(self.items[self._order[self.position]])
            self.position += 1
            self.consumed += 1
        return out

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position, "consumed": self.consumed, "seed": self.seed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.seed = int(state.get("seed", self.seed))
        self.epoch = int(state["epoch"])
        self.position = int(state["position"])
        self.consumed = int(state.get("consumed", 0))
        self._order = self._epoch_order(self.epoch)
