"""Stage `mfu`: train-step MFU of one actor rank, bf16 compute over fp32 master weights, on a
Qwen2-0.5B-shaped model with random weights made on the spot (`tests/gpu/figures.py`'s
`train_step_mfu`: MFU = 6 x parameters x tokens / step seconds / the GPU's peak dense bf16).
The peak comes from the GPU's name (H100/H200 SXM 989 TFLOP/s); an unknown GPU gets 989 and the
figure says so. A figure, not a check: only a failed step fails the stage.
"""

from __future__ import annotations

import sys

from common import Stage, main, require

#: Peak dense bf16 TFLOP/s by a substring of the device name (NVIDIA's data sheets).
PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0, "L4": 121.0, "A10": 125.0}


def body(stage: Stage) -> None:
    require("transformers", "the model is a transformers Qwen2")
    import torch
    from figures import train_step_mfu

    name = torch.cuda.get_device_name(0) if stage.device.startswith("cuda") else "cpu"
    peak = next((v for k, v in PEAK_TFLOPS.items() if k in name), None)
    stage.figure("mfu_peak_tflops", peak if peak is not None else f"unknown for {name!r}: 989 assumed")
    seq, rows = (1024, 8) if stage.device.startswith("cuda") else (64, 2)
    results: dict[str, object] = {}
    train_step_mfu(results, stage.scratch, peak or 989.0, seq, rows)
    for key, value in results.items():
        stage.figures[key] = value


if __name__ == "__main__":
    sys.exit(main("mfu", body))
