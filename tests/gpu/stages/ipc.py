"""Stage `ipc`: CUDA IPC of pickled tensor handles into a second process, the way weights reach a
colocated vLLM engine's workers (`torch.multiprocessing.reductions.reduce_tensor`: a picklable
`(rebuild, args)` holding a CUDA IPC memory handle). The parent shares fp32 and bf16 tensors, two
names of one tied tensor, and one 1 GiB tensor; the child opens the handles, checks that the tied
names share storage, and returns the digests (`sync.tensor_digest`), which must equal the
parent's. The parent keeps its tensors alive until the child is done, as the protocol requires.

    python ipc.py --child HANDLES_FILE     # the second process (run by the stage itself)
"""

from __future__ import annotations

import json
import pickle
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from common import Skip, Stage, main

GIB = 2**30


def shared_tensors() -> dict[str, Any]:
    import torch

    g = torch.Generator(device="cuda").manual_seed(0)
    tied = torch.randn(512, 1024, device="cuda", generator=g)
    return {
        "fp32": torch.randn(1024, 4097, device="cuda", generator=g),
        "bf16": torch.randn(2048, 4096, device="cuda", generator=g).to(torch.bfloat16),
        "embed.weight": tied,
        "lm_head.weight": tied,  # tied weights: one storage under two names
        "one_gib": torch.randn(GIB // 4, device="cuda", generator=g),
    }


def child(handles: Path) -> None:
    """Open every handle, digest the tensors, report whether the tied names share storage."""
    import torch

    from rlhf_trainer.sync import tensor_digest

    torch.cuda.set_device(0)
    t0 = time.perf_counter()
    items = pickle.loads(handles.read_bytes())
    tensors = {name: rebuild(*args) for name, (rebuild, args) in items.items()}
    opened = time.perf_counter() - t0
    out = {
        "open_seconds": opened,
        "digests": {name: tensor_digest([(name, t)]) for name, t in tensors.items()},
        "tied_shares_storage": tensors["embed.weight"].data_ptr() == tensors["lm_head.weight"].data_ptr(),
        "devices": sorted({str(t.device) for t in tensors.values()}),
    }
    print("RESULT " + json.dumps(out), flush=True)


def body(stage: Stage) -> None:
    if not stage.device.startswith("cuda"):
        raise Skip("needs a GPU (CUDA IPC handles exist only for CUDA tensors; no CPU rehearsal)")
    import torch
    from torch.multiprocessing.reductions import reduce_tensor

    from rlhf_trainer.sync import tensor_digest

    tensors = shared_tensors()
    torch.cuda.synchronize()
    handles = stage.scratch / "handles.pkl"
    handles.write_bytes(pickle.dumps({name: reduce_tensor(t) for name, t in tensors.items()}))
    stage.figure("ipc_handle_bytes", handles.stat().st_size)
    t0 = time.perf_counter()
    done = subprocess.run(
        [sys.executable, __file__, "--child", str(handles)], capture_output=True, text=True, timeout=45
    )
    stage.figure("ipc_child_seconds", time.perf_counter() - t0, "s")
    print(done.stdout + done.stderr, flush=True)
    line = next((ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")), None)
    stage.check(
        "child opened the handles", done.returncode == 0 and line is not None, f"exit {done.returncode}"
    )
    got = json.loads(line[len("RESULT ") :])  # type: ignore[index]
    stage.figure("ipc_open_seconds", got["open_seconds"], "s")
    for name, t in tensors.items():
        want = tensor_digest([(name, t)])
        stage.check(
            f"digest {name} ({t.dtype}, {t.numel() * t.element_size() / 2**20:.0f} MiB)",
            got["digests"][name] == want,
            f"{got['digests'][name][:12]} vs {want[:12]}",
        )
    stage.check("tied names share one storage in the child", got["tied_shares_storage"])
    del tensors  # only now: the child has closed its handles


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        for part in ("api", "trainer"):
            sys.path.insert(0, str(Path(__file__).resolve().parents[3] / part))
        child(Path(sys.argv[2]))
        sys.exit(0)
    sys.exit(main("ipc", body))
