"""Weight-sync benchmark: seconds to push a Qwen2-0.5B-shaped bf16 model (synthetic tensors) from
one source to 1, 2 and 4 receivers over gloo with `SyncGroup` (bucketed broadcast + acks), and
the ratio to a raw `torch.distributed.broadcast` of the same bytes as one flat tensor, in the same
processes and the same run. Also the source's peak extra memory: the sync's own accounting
(buffers + materialized tensors) and the measured peak-RSS delta (Linux `VmHWM`, reset through
`/proc/self/clear_refs`).

    python benchmarks/weight_sync.py                     # full size, ~494M params, ~0.99 GB
    python benchmarks/weight_sync.py --size 50M --receivers 1 2 --repeats 2

Every process holds the model once (a flat buffer the named tensors are views of), so the
memory needed is about (receivers + 1) x model bytes.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "api"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "trainer"))
from rlhf_trainer.sync import SyncGroup, WeightReceiver, connect_store, tensor_digest  # noqa: E402

HOST = "127.0.0.1"

# Qwen2-0.5B: 24 layers, hidden 896, 14 heads of 64, 2 KV heads, FFN 4864, vocab 151936, tied
# embeddings (no separate lm_head) -> 494,032,768 parameters.
QWEN2_05B = dict(layers=24, hidden=896, heads=14, kv_heads=2, head_dim=64, ffn=4864, vocab=151936)


def qwen2_shapes(
    layers: int, hidden: int, heads: int, kv_heads: int, head_dim: int, ffn: int, vocab: int
) -> list[tuple[str, tuple[int, ...]]]:
    shapes: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (vocab, hidden))]
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes += [
            (p + "self_attn.q_proj.weight", (heads * head_dim, hidden)),
            (p + "self_attn.q_proj.bias", (heads * head_dim,)),
            (p + "self_attn.k_proj.weight", (kv_heads * head_dim, hidden)),
            (p + "self_attn.k_proj.bias", (kv_heads * head_dim,)),
            (p + "self_attn.v_proj.weight", (kv_heads * head_dim, hidden)),
            (p + "self_attn.v_proj.bias", (kv_heads * head_dim,)),
            (p + "self_attn.o_proj.weight", (hidden, heads * head_dim)),
            (p + "mlp.gate_proj.weight", (ffn, hidden)),
            (p + "mlp.up_proj.weight", (ffn, hidden)),
            (p + "mlp.down_proj.weight", (hidden, ffn)),
            (p + "input_layernorm.weight", (hidden,)),
            (p + "post_attention_layernorm.weight", (hidden,)),
        ]
    shapes.append(("model.norm.weight", (hidden,)))
    return shapes


def numel(shapes: list[tuple[str, tuple[int, ...]]]) -> int:
    return sum(int(torch.Size(s).numel()) for _, s in shapes)


def shapes_for(size: float) -> list[tuple[str, tuple[int, ...]]]:
    """Qwen2-0.5B scaled to about `size` parameters: fewer layers and a smaller vocabulary."""
    full = numel(qwen2_shapes(**QWEN2_05B))
    f = min(1.0, size / full)
    cfg = dict(
        QWEN2_05B, layers=max(1, round(QWEN2_05B["layers"] * f)), vocab=max(64, int(QWEN2_05B["vocab"] * f))
    )
    return qwen2_shapes(**cfg)


def parse_size(s: str) -> float:
    units = {"K": 1e3, "M": 1e6, "B": 1e9, "G": 1e9}
    return float(s[:-1]) * units[s[-1].upper()] if s[-1].upper() in units else float(s)


def flat_model(
    shapes: list[tuple[str, tuple[int, ...]]], seed: int
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One flat uint8 buffer and bf16 views of it with the model's names."""
    total = numel(shapes) * 2
    flat = torch.empty(total, dtype=torch.uint8)
    named, off = {}, 0
    for name, shape in shapes:
        n = int(torch.Size(shape).numel()) * 2
        named[name] = flat[off : off + n].view(torch.bfloat16).view(shape)
        off += n
    if seed >= 0:
        g = torch.Generator().manual_seed(seed)
        flat.copy_(torch.randint(0, 256, (total,), dtype=torch.uint8, generator=g))
    return flat, named


def _status(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    return 0


def _reset_peak_rss() -> bool:
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def worker(
    rank: int, n: int, port: int, size: float, repeats: int, bucket: int, inflight: int, out: str
) -> None:
    torch.set_num_threads(1)
    threads = int(os.environ.get("BENCH_GLOO_THREADS", "0")) or None  # default: SyncGroup's choice
    shapes = shapes_for(size)
    flat, named = flat_model(shapes, seed=1234 if rank == 0 else -1)
    store = connect_store(HOST, port, is_source=rank == 0, timeout=600)
    names = ["source"] + [f"replica-{i}" for i in range(n)]
    sg = SyncGroup(
        store,
        names[rank],
        timeout=600,
        bucket_bytes=bucket,
        hostname=HOST,
        max_inflight=inflight,
        gloo_threads=threads,
    )
    sg.rebuild(names, generation=1)
    # The raw baseline runs on a plain gloo group over the same members.
    raw: Any = dist.ProcessGroupGloo(dist.PrefixStore("raw/", store), rank, n + 1, timedelta(seconds=600))
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    if rank == 0:
        store.set("digest", tensor_digest(named.items()))
    raw_s: list[float] = []
    sync_s: list[float] = []
    peak_acct: list[int] = []
    peak_rss: list[int] = []
    digest_ok = True
    for rep in range(repeats):
        raw.barrier().wait()
        t0 = time.perf_counter()
        raw.broadcast([flat], opts).wait()
        raw_s.append(time.perf_counter() - t0)
        raw.barrier().wait()
        if rank == 0:
            rss0 = _status("VmRSS")
            hwm_ok = _reset_peak_rss()
            t0 = time.perf_counter()
            res = sg.push(named.items(), version=rep)
            sync_s.append(time.perf_counter() - t0)
            peak_acct.append(res.stats.peak_extra_bytes)
            if hwm_ok:
                peak_rss.append(_status("VmHWM") - rss0)
        else:
            flat.zero_()
            sg.receive(WeightReceiver(targets=named))
            if rep == repeats - 1:  # the source published its digest before the first push
                digest_ok = tensor_digest(named.items()) == store.get("digest").decode()
        raw.barrier().wait()
    Path(out, f"{rank}.json").write_text(
        json.dumps(
            {
                "raw": raw_s,
                "sync": sync_s,
                "peak_acct": peak_acct,
                "peak_rss": peak_rss,
                "digest_ok": digest_ok,
            }
        )
    )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


def run(n: int, size: float, repeats: int, bucket: int, inflight: int, out: Path) -> dict[str, Any]:
    out.mkdir(parents=True, exist_ok=True)
    for f in out.glob("*.json"):
        f.unlink()
    ctx = mp.get_context("spawn")
    port = _free_port()
    procs = [
        ctx.Process(target=worker, args=(r, n, port, size, repeats, bucket, inflight, str(out)))
        for r in range(n + 1)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    if any(p.exitcode for p in procs):
        raise RuntimeError(f"{n} receivers: exit codes {[p.exitcode for p in procs]}")
    src = json.loads((out / "0.json").read_text())
    receivers = [json.loads((out / f"{r}.json").read_text()) for r in range(1, n + 1)]
    raw = statistics.median(src["raw"])
    sync = statistics.median(src["sync"])
    return {
        "receivers": n,
        "raw_s": raw,
        "sync_s": sync,
        "ratio": sync / raw,
        "raw_all": src["raw"],
        "sync_all": src["sync"],
        "peak_extra_accounted_bytes": max(src["peak_acct"]),
        "peak_extra_rss_bytes": max(src["peak_rss"]) if src["peak_rss"] else None,
        "weights_equal": all(r["digest_ok"] for r in receivers),
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", default="494M", help="parameters, e.g. 494M (Qwen2-0.5B, default), 50M, 0.1B")
    ap.add_argument("--receivers", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--bucket-mb", type=float, default=64.0)
    ap.add_argument(
        "--max-inflight", type=int, default=8, help="messages posted ahead (SyncGroup.max_inflight)"
    )
    ap.add_argument("--json", type=Path, help="also write the results here")
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/rlhf-weight-sync-bench"))
    a = ap.parse_args(argv)
    size = parse_size(a.size)
    shapes = shapes_for(size)
    params = numel(shapes)
    bucket = int(a.bucket_mb * (1 << 20))
    print(f"model: {params / 1e6:.1f}M params, {len(shapes)} tensors, {params * 2 / 1e9:.3f} GB bf16; "
          f"bucket {a.bucket_mb:g} MiB; gloo on {HOST}; torch {torch.__version__}; {os.cpu_count()} CPUs")  # fmt: skip
    rows = []
    for n in a.receivers:
        r = run(n, size, a.repeats, bucket, a.max_inflight, a.workdir)
        rows.append(r)
        rss = r["peak_extra_rss_bytes"]
        print(
            f"receivers={n}: sync {r['sync_s']:.3f}s  raw broadcast {r['raw_s']:.3f}s  ratio {r['ratio']:.2f}  "
            f"peak extra on source {r['peak_extra_accounted_bytes'] / 2**20:.0f} MiB accounted"
            + (f", {rss / 2**20:.0f} MiB RSS" if rss is not None else "")
            + f"  weights equal: {r['weights_equal']}",
            flush=True,
        )
    if a.json:
        a.json.write_text(
            json.dumps(
                {"params": params, "bytes": params * 2, "bucket_bytes": bucket, "rows": rows}, indent=2
            )
        )


if __name__ == "__main__":
    main()
