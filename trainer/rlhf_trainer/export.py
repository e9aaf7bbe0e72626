"""`rlhf export CHECKPOINT OUT`: the policy of a checkpoint as a Hugging Face model directory.

    OUT/config.json              the policy's transformers config, `dtype` set to the exported dtype
    OUT/generation_config.json   when the policy has one
    OUT/tokenizer.json, ...      the tokenizer, as the actor saved it into the checkpoint
    OUT/model.safetensors        the weights; above 5 GiB, model-0000i-of-0000N.safetensors shards
                                 and model.safetensors.index.json, as `save_pretrained` writes them
    OUT/adapter/                 with `--adapter`, a LoRA run's adapter alone in peft's format
                                 (adapter_config.json, adapter_model.safetensors)

A LoRA run (`spec.model.lora`) checkpoints the merged weights (base + (alpha/r)·B·A, under the
base model's names), so OUT is a plain model that loads without `peft`.

`AutoModelForCausalLM.from_pretrained(OUT)` loads it. A group of tied weights (the input
embedding and the LM head of most small models) is stored once, under the name the model's own
parameter order puts first, as `save_pretrained` does; the checkpoint's copies of a tied group
must be equal. Which names are tied, and which names and shapes the model expects, come from
the config alone: the model is built on the meta device, without memory for its weights.

Tensors are streamed from the checkpoint into the output one at a time (bounded memory, progress
lines every few seconds), into a temporary sibling directory renamed to OUT when complete.

The end of `rlhf run` exports its final checkpoint to `<output.dir>/final` (`FINAL_DIR`; there is
no spec field for it yet). Importing this module is cheap (argparse only): torch, safetensors and
transformers are imported by the functions that use them.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import secrets
import shutil
import struct
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

#: Where the end of `rlhf run` writes the policy, inside the run directory (`spec.output.dir`).
FINAL_DIR = "final"
#: Output files larger than this are split into shards (the size `save_pretrained` uses).
MAX_SHARD_BYTES = 5 * 2**30
DTYPE_CHOICES = ("auto", "float32", "bfloat16", "float16")
#: Seconds between progress lines.
PROGRESS_EVERY = 5.0
POLICY_PART = "actor"
WEIGHTS = "model.safetensors"
#: A sharded part's DCP checkpoint (`checkpoint.SHARDS_DIR`; this module stays torch-free at import).
SHARDS_DIR = "dcp"
#: The prefix of the model's tensors in a sharded part (`workers.modeling.MODEL_KEY`).
SHARDED_MODEL_PREFIX = "model."
#: A LoRA checkpoint's adapter folder (`workers.lora.ADAPTER_DIR`; this module stays torch-free).
ADAPTER_DIR = "adapter"


class ExportError(RuntimeError):
    """A checkpoint that cannot be exported; the message says what was expected."""


# --------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------


def add_subcommands(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "export",
        help="write a checkpoint's policy as a Hugging Face model directory (from_pretrained loads it)",
        description="Write the policy of CHECKPOINT as a Hugging Face model directory OUT: config.json, "
        "generation_config.json, the tokenizer and model.safetensors. CHECKPOINT is a step-NNNNNN "
        "directory, a checkpoint directory (its newest complete checkpoint) or a run directory. "
        f"`rlhf run` does this itself at the end, into <output.dir>/{FINAL_DIR}.",
    )
    p.add_argument(
        "checkpoint", metavar="CHECKPOINT", help="a checkpoint, checkpoint directory or run directory"
    )
    p.add_argument("out", metavar="OUT", help="the model directory to write")
    p.add_argument(
        "--dtype",
        choices=DTYPE_CHOICES,
        default="auto",
        help="dtype of the exported floating-point weights; auto: the dtype in the policy's config",
    )
    p.add_argument(
        "--adapter",
        action="store_true",
        help="also write the LoRA adapter alone (peft format) to OUT/adapter; the checkpoint must come from a "
        "run with spec.model.lora",
    )
    p.add_argument("--force", action="store_true", help="replace OUT when it exists")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress lines")
    p.set_defaults(func=cmd_export)


def cmd_export(args: argparse.Namespace) -> int:
    from rlhf_trainer.checkpoint import CheckpointError

    try:
        done = export_policy(
            args.checkpoint,
            args.out,
            dtype=args.dtype,
            replace=args.force,
            adapter=args.adapter,
            log=None if args.quiet else sys.stderr,
        )
    except (CheckpointError, ExportError, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    print(done.path)
    return 0


# --------------------------------------------------------------------------------------------
# Export
# --------------------------------------------------------------------------------------------


@dataclass
class Entry:
    """One tensor of the output: its name there, the checkpoint's name it is read from, and
    the shape and dtype it is written with."""

    name: str
    source: str
    shape: tuple[int, ...]
    dtype: Any  # torch.dtype

    @property
    def nbytes(self) -> int:
        n = self.dtype.itemsize
        for d in self.shape:
            n *= d
        return int(n)


@dataclass
class Exported:
    path: Path
    checkpoint: Path
    step: int
    tensors: int
    bytes: int
    files: list[str] = field(default_factory=list)
    seconds: float = 0.0


def export_policy(
    source: str | Path,
    out: str | Path,
    *,
    dtype: str = "auto",
    replace: bool = False,
    adapter: bool = False,
    log: IO[str] | None = sys.stderr,
    max_shard_bytes: int = MAX_SHARD_BYTES,
) -> Exported:
    """Write the policy of checkpoint `source` (see `checkpoint.resolve`) as a Hugging Face
    model directory `out`. `replace`: an existing `out` is replaced (else it is an error).
    `adapter`: also copy a LoRA checkpoint's adapter (peft format) to `out/adapter`."""
    from rlhf_trainer import checkpoint

    started = time.perf_counter()
    if dtype not in DTYPE_CHOICES:
        raise ExportError(f"dtype {dtype!r} is not one of {', '.join(DTYPE_CHOICES)}")
    step_dir = checkpoint.resolve(source)
    part = policy_part(step_dir)
    if adapter and not (part / ADAPTER_DIR / "adapter_model.safetensors").is_file():
        raise ExportError(
            f"--adapter: {part} has no {ADAPTER_DIR}/adapter_model.safetensors; only a run with "
            "spec.model.lora writes an adapter"
        )
    target = Path(out).expanduser().resolve()
    if target.exists() and not replace and (not target.is_dir() or any(target.iterdir())):
        raise ExportError(f"{target} exists and is not empty; pass --force to replace it")

    config = json.loads((part / "config.json").read_text())
    out_dtype = _dtype_named(config.get("dtype") or config.get("torch_dtype")) if dtype == "auto" else dtype
    with open_weights(part) as weights:
        entries = plan(part, weights, out_dtype)
        total = sum(e.nbytes for e in entries)
        shards = split(entries, max_shard_bytes)
        progress = Progress(log, len(entries), total)
        progress.say(
            f"exporting the policy of {step_dir} ({len(entries)} tensors, {_size(total)}, "
            f"{out_dtype or 'as stored'}) to {target}"
        )
        tmp = target.parent / f".{target.name}.export-{secrets.token_hex(4)}"
        tmp.mkdir(parents=True)
        try:
            files = write_model_files(part, tmp, config, out_dtype)
            n = len(shards)
            names = [WEIGHTS] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
            for name, shard in zip(names, shards):
                write_safetensors(tmp / name, shard, weights, progress)
            files += names
            if adapter:
                shutil.copytree(part / ADAPTER_DIR, tmp / ADAPTER_DIR)
                files.append(ADAPTER_DIR)
            if n > 1:
                index = {
                    "metadata": {"total_size": total},
                    "weight_map": {e.name: name for name, shard in zip(names, shards) for e in shard},
                }
                (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
                files.append("model.safetensors.index.json")
            _replace_dir(tmp, target)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    seconds = time.perf_counter() - started
    progress.say(f"exported {target} in {seconds:.1f}s ({', '.join(sorted(files))})")
    step = int(step_dir.name.split("-")[-1])
    return Exported(target, step_dir, step, len(entries), total, sorted(files), seconds)


def policy_part(step_dir: Path) -> Path:
    """The checkpoint's actor part, with the files an export needs."""
    from rlhf_trainer import checkpoint

    if POLICY_PART not in checkpoint.parts(step_dir):
        raise ExportError(
            f"checkpoint {step_dir} holds no {POLICY_PART} part (it holds {', '.join(checkpoint.parts(step_dir))})"
        )
    part = checkpoint.part_dir(step_dir, POLICY_PART)
    if not (part / WEIGHTS).is_file() and not (part / SHARDS_DIR / ".metadata").is_file():
        raise ExportError(
            f"{part} has neither {WEIGHTS} nor {SHARDS_DIR}/.metadata (the policy's weights, gathered or "
            "sharded); was the checkpoint written by `rlhf run`?"
        )
    for name, what in (("config.json", "the policy's config"),):
        if not (part / name).is_file():
            raise ExportError(f"{part} has no {name} ({what}); was the checkpoint written by `rlhf run`?")
    if not (part / "tokenizer").is_dir():
        raise ExportError(f"{part} has no tokenizer/ directory; was the checkpoint written by `rlhf run`?")
    return part


def plan(part: Path, weights: Any, out_dtype: str | None) -> list[Entry]:
    """The tensors to write, in the model's own order: every name the model's state dict holds,
    a tied group once (under its first name), each checked against the checkpoint's shapes."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        config = AutoConfig.from_pretrained(str(part))
        with torch.device("meta"):  # names, shapes and ties without memory for the weights
            skeleton = AutoModelForCausalLM.from_config(config)
    except Exception as err:  # an architecture this transformers does not know, a broken config
        raise ExportError(
            f"{part / 'config.json'} does not describe a causal LM transformers can build: {err}"
        ) from err
    groups: dict[int, list[str]] = {}
    shapes: dict[str, tuple[int, ...]] = {}
    for name, value in skeleton.state_dict(keep_vars=True).items():
        groups.setdefault(id(value), []).append(name)  # tied names share one parameter
        shapes[name] = tuple(value.shape)
    stored = set(weights.names())
    expected = {n for names in groups.values() for n in names}
    unexpected = sorted(stored - expected)
    if unexpected:
        raise ExportError(
            f"{part / WEIGHTS} holds tensors a {type(skeleton).__name__} of this config has no place for: "
            f"{_some(unexpected)}"
        )
    entries = []
    target = getattr(torch, out_dtype) if out_dtype else None
    for names in groups.values():
        present = [n for n in names if n in stored]
        if not present:
            raise ExportError(f"{part / WEIGHTS} lacks {_some(names)} (expected by its config.json)")
        shape = weights.shape(present[0])
        if shape != shapes[names[0]]:
            raise ExportError(
                f"{part / WEIGHTS}: {present[0]} has shape {list(shape)}, its config.json says {list(shapes[names[0]])}"
            )
        if len(present) > 1:
            check_tied(part, weights, present)
        stored_dtype = weights.dtype(present[0])
        dtype = target if target is not None and stored_dtype.is_floating_point else stored_dtype
        entries.append(Entry(names[0], present[0], shape, dtype))
    return entries


def check_tied(part: Path, weights: Any, names: list[str]) -> None:
    """The checkpoint holds every name of a tied group (FSDP state dicts do): one tensor."""
    import torch

    first = weights.tensor(names[0])
    for other in names[1:]:
        if not torch.equal(first, weights.tensor(other)):
            raise ExportError(
                f"{part / WEIGHTS}: {names[0]} and {other} differ, but the config ties them "
                "(tie_word_embeddings); the checkpoint was not written from this config"
            )


# --------------------------------------------------------------------------------------------
# The checkpoint's weights, gathered (one safetensors file) or sharded (DCP), read tensor by tensor
# --------------------------------------------------------------------------------------------


class SafetensorsWeights:
    """The gathered part's `model.safetensors`, read lazily."""

    def __init__(self, path: Path):
        from safetensors import safe_open

        self.path = path
        self._file = safe_open(str(path), framework="pt").__enter__()

    def names(self) -> list[str]:
        return list(self._file.keys())

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._file.get_slice(name).get_shape())

    def dtype(self, name: str) -> Any:
        return _slice_dtype(self._file.get_slice(name))

    def tensor(self, name: str) -> Any:
        return self._file.get_tensor(name)

    def close(self) -> None:
        self._file.__exit__(None, None, None)


class ShardedWeights:
    """The sharded part's DCP checkpoint: the model's tensors (`model.<name>`), each read alone
    into one process (DCP reassembles it from every rank's shard files; nothing else is read, the
    optimizer state neither)."""

    def __init__(self, directory: Path):
        from torch.distributed.checkpoint import FileSystemReader
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        self.directory = directory
        metadata = FileSystemReader(str(directory)).read_metadata()
        self._meta = {
            key.removeprefix(SHARDED_MODEL_PREFIX): value
            for key, value in metadata.state_dict_metadata.items()
            if key.startswith(SHARDED_MODEL_PREFIX) and isinstance(value, TensorStorageMetadata)
        }

    def names(self) -> list[str]:
        return list(self._meta)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._meta[name].size)

    def dtype(self, name: str) -> Any:
        return self._meta[name].properties.dtype

    def tensor(self, name: str) -> Any:
        import torch
        from torch.distributed import checkpoint as dcp
        from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader

        out = torch.empty(self.shape(name), dtype=self.dtype(name))
        dcp.load(
            {SHARDED_MODEL_PREFIX + name: out},
            storage_reader=FileSystemReader(str(self.directory)),
            planner=DefaultLoadPlanner(allow_partial_load=True),
            no_dist=True,
        )
        return out

    def close(self) -> None:
        pass


@contextlib.contextmanager
def open_weights(part: Path) -> Iterator[SafetensorsWeights | ShardedWeights]:
    """The part's weights, in whichever layout it holds them."""
    weights: SafetensorsWeights | ShardedWeights = (
        ShardedWeights(part / SHARDS_DIR)
        if (part / SHARDS_DIR).is_dir()
        else SafetensorsWeights(part / WEIGHTS)
    )
    try:
        yield weights
    finally:
        weights.close()


def split(entries: list[Entry], max_bytes: int) -> list[list[Entry]]:
    """Consecutive shards of at most `max_bytes` (a larger tensor gets a shard of its own)."""
    shards: list[list[Entry]] = [[]]
    size = 0
    for e in entries:
        if shards[-1] and size + e.nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(e)
        size += e.nbytes
    return shards


def write_model_files(part: Path, out: Path, config: dict[str, Any], out_dtype: str | None) -> list[str]:
    """config.json (with the exported dtype), generation_config.json and the tokenizer files."""
    if out_dtype:
        config = {**config, "dtype": out_dtype}
        if "torch_dtype" in config:
            config["torch_dtype"] = out_dtype
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    files = ["config.json"]
    if (part / "generation_config.json").is_file():
        shutil.copy2(part / "generation_config.json", out / "generation_config.json")
        files.append("generation_config.json")
    for src in sorted((part / "tokenizer").rglob("*")):
        if src.is_file():
            dest = out / src.relative_to(part / "tokenizer")
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest)
            files.append(dest.relative_to(out).as_posix())
    return files


# --------------------------------------------------------------------------------------------
# A streaming safetensors writer (the format: 8-byte little-endian header length, JSON header
# of dtype, shape and [begin, end) byte offsets per tensor, then the tensors' bytes in order)
# --------------------------------------------------------------------------------------------


def write_safetensors(path: Path, entries: list[Entry], weights: Any, progress: Progress) -> None:
    """Write `entries` read from the open checkpoint `weights` into `path`, one tensor at a time."""
    import torch

    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for e in entries:
        header[e.name] = {
            "dtype": _code(e.dtype),
            "shape": list(e.shape),
            "data_offsets": [offset, offset + e.nbytes],
        }
        offset += e.nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the tensor data starts 8-byte aligned
    with path.open("wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for e in entries:
            tensor = weights.tensor(e.source).to(e.dtype).contiguous()
            f.write(memoryview(tensor.reshape(-1).view(torch.uint8).numpy()))
            progress.advance(e.nbytes)
            del tensor


def _code(dtype: Any) -> str:
    import torch

    codes = {
        torch.float64: "F64",
        torch.float32: "F32",
        torch.float16: "F16",
        torch.bfloat16: "BF16",
        torch.int64: "I64",
        torch.int32: "I32",
        torch.int16: "I16",
        torch.int8: "I8",
        torch.uint8: "U8",
        torch.bool: "BOOL",
    }
    if dtype not in codes:
        raise ExportError(f"cannot export tensors of dtype {dtype}; supported: {', '.join(map(str, codes))}")
    return codes[dtype]


def _slice_dtype(view: Any) -> Any:
    import torch

    names = {
        "F64": torch.float64,
        "F32": torch.float32,
        "F16": torch.float16,
        "BF16": torch.bfloat16,
        "I64": torch.int64,
        "I32": torch.int32,
        "I16": torch.int16,
        "I8": torch.int8,
        "U8": torch.uint8,
        "BOOL": torch.bool,
    }
    code = view.get_dtype()
    if code not in names:
        raise ExportError(f"cannot export tensors of safetensors dtype {code}; supported: {', '.join(names)}")
    return names[code]


# --------------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------------


class Progress:
    """Progress lines on `stream` (stderr; none when None): at most one per `PROGRESS_EVERY` s."""

    def __init__(self, stream: IO[str] | None, tensors: int, total: int):
        self.stream = stream
        self.tensors = tensors
        self.total = total
        self.done_tensors = 0
        self.done = 0
        self.last = time.monotonic()

    def say(self, line: str) -> None:
        if self.stream is not None:
            print(line, file=self.stream, flush=True)

    def advance(self, nbytes: int) -> None:
        self.done += nbytes
        self.done_tensors += 1
        now = time.monotonic()
        if now - self.last >= PROGRESS_EVERY and self.done_tensors < self.tensors:
            self.last = now
            pct = 100.0 * self.done / max(self.total, 1)
            self.say(
                f"  {pct:3.0f}%  {self.done_tensors}/{self.tensors} tensors, {_size(self.done)} of {_size(self.total)}"
            )


def _replace_dir(new: Path, target: Path) -> None:
    """Put `new` at `target`; an old `target` is moved aside first and removed after."""
    old = None
    if target.exists() or target.is_symlink():
        old = target.parent / f".{target.name}.old-{secrets.token_hex(4)}"
        target.rename(old)
    new.rename(target)
    if old is not None:
        if old.is_dir() and not old.is_symlink():
            shutil.rmtree(old, ignore_errors=True)
        else:
            old.unlink()


def _dtype_named(value: Any) -> str | None:
    """`float32` from a config's dtype entry (`"float32"`, `"torch.float32"`); None if unknown."""
    name = str(value).removeprefix("torch.") if value else ""
    return name if name in DTYPE_CHOICES[1:] else None


def _size(n: float) -> str:
    if n < 1024:
        return f"{n:.0f} B"
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        n /= 1024
        if n < 1024 or unit == "TiB":
            break
    return f"{n:.1f} {unit}"


def _some(names: list[str], n: int = 5) -> str:
    more = f" and {len(names) - n} more" if len(names) > n else ""
    return ", ".join(names[:n]) + more
