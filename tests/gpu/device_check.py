"""The driver of tests/gpu/device_check.sh: every stage in its own process with its own timeout,
most valuable first, within one budget (8 minutes on one H200 by default), then three small files
in OUTDIR:

    device_check.log    everything each stage printed, in order
    device_check.xml    JUnit XML: one test case per stage (passed / failed / skipped, with reason)
    figures.json        per stage: status, reason, seconds, figures, named checks

Scratch data (models, checkpoints) goes to --scratch, never to OUTDIR. The machine stage runs
first on any machine; where it finds no CUDA device every GPU stage is reported "needs a GPU" and
skipped without being started. A stage that lacks a package (Ray, vLLM, peft, pytest...) skips
itself, naming it. Exit 0 unless a stage failed or timed out.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from xml.sax.saxutils import escape, quoteattr

HERE = Path(__file__).resolve().parent
STAGES_DIR = HERE / "stages"


@dataclass(frozen=True)
class StageDef:
    name: str
    timeout_s: int
    what: str
    needs_gpu: bool = True


#: Most valuable first: when the budget runs out, what is left is what matters least.
STAGES = [
    StageDef("machine", 60, "driver, CUDA, NCCL, compiler, packages", needs_gpu=False),
    StageDef("gpu_tests", 150, "the project's GPU tests that need neither Ray nor vLLM (pytest -m gpu)"),
    StageDef(
        "grpo",
        120,
        "Ray-free GRPO on one GPU, bf16 over fp32 masters: reward rises; save, load, same next step",
    ),
    StageDef(
        "fsdp",
        60,
        "FSDP2 on a one-rank NCCL group: mixed precision, activation checkpointing, checkpoint round trip",
    ),
    StageDef("ipc", 60, "CUDA IPC of pickled tensor handles into a second process: fp32, bf16, tied, 1 GiB"),
    StageDef("sync", 60, "NCCL bucketed broadcast; a sync group whose receiver never connects is dropped"),
    StageDef("layouts", 60, "packed vs padded log-probs; activation checkpointing on vs off"),
    StageDef("critic_lora", 60, "the critic and LoRA on a GPU"),
    StageDef("mfu", 90, "train-step MFU of a 0.5B Qwen2-shaped model"),
]


def _log(log: Any, text: str) -> None:
    print(text, flush=True)
    log.write(text + "\n")
    log.flush()


def run_stage(st: StageDef, python: str, scratch: Path, limit: float, log: Any) -> dict[str, Any]:
    """Run one stage's script in a process group of its own; kill the group at `limit` seconds."""
    result_file = scratch / f"{st.name}.result.json"
    cmd = [
        python,
        str(STAGES_DIR / f"{st.name}.py"),
        "--scratch",
        str(scratch / st.name),
        "--result",
        str(result_file),
    ]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        rc = proc.wait(timeout=limit)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        return {
            "status": "failed",
            "reason": f"timed out after {limit:.0f} s (killed)",
            "seconds": round(time.perf_counter() - t0, 2),
            "figures": {},
            "checks": [],
        }
    seconds = round(time.perf_counter() - t0, 2)
    if not result_file.is_file():
        return {
            "status": "failed",
            "reason": f"exited {rc} without a result (see the log)",
            "seconds": seconds,
            "figures": {},
            "checks": [],
        }
    result: dict[str, Any] = json.loads(result_file.read_text())
    result["seconds"] = seconds
    if rc != 0 and result.get("status") != "failed":
        result.update(status="failed", reason=f"exited {rc} after reporting {result.get('status')}")
    return result


def junit(results: dict[str, dict[str, Any]], seconds: float) -> str:
    """One JUnit testsuite, one testcase per stage (skip and failure messages are the reasons)."""
    fails = sum(r["status"] == "failed" for r in results.values())
    skips = sum(r["status"] == "skipped" for r in results.values())
    lines = [
        '<?xml version="1.0" encoding="utf-8"?>',
        f'<testsuites><testsuite name="device_check" tests="{len(results)}" failures="{fails}" '
        f'errors="0" skipped="{skips}" time="{seconds:.2f}">',
    ]
    for name, r in results.items():
        case = f'<testcase classname="device_check" name={quoteattr(name)} time="{r.get("seconds", 0):.2f}"'
        reason = quoteattr(r.get("reason", ""))
        if r["status"] == "skipped":
            lines.append(f"{case}><skipped message={reason}/></testcase>")
        elif r["status"] == "failed":
            lines.append(
                f"{case}><failure message={reason}>{escape(r.get('reason', ''))}</failure></testcase>"
            )
        else:
            lines.append(f"{case}/>")
    lines.append("</testsuite></testsuites>")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="where the log, JUnit XML and figures go")
    ap.add_argument("--scratch", type=Path, required=True, help="where models and checkpoints go")
    ap.add_argument(
        "--budget",
        type=float,
        default=float(os.environ.get("DEVICE_CHECK_BUDGET_S", 470)),
        help="seconds for all stages together (default 470: under 8 minutes)",
    )
    ap.add_argument("--only", nargs="+", choices=[s.name for s in STAGES], help="run these stages only")
    a = ap.parse_args(argv)
    a.out.mkdir(parents=True, exist_ok=True)
    a.scratch.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    results: dict[str, dict[str, Any]] = {}
    cuda, why = None, ""  # unknown until the machine stage says
    with open(a.out / "device_check.log", "w") as log:
        _log(log, f"# device check: {sys.executable}; scratch {a.scratch}; budget {a.budget:.0f} s")
        for st in STAGES:
            if a.only and st.name not in a.only and st.name != "machine":
                continue
            left = a.budget - (time.perf_counter() - t_start)
            if st.needs_gpu and cuda is False:
                res = {
                    "status": "skipped",
                    "reason": f"needs a GPU ({why or 'no CUDA device'})",
                    "seconds": 0.0,
                    "figures": {},
                    "checks": [],
                }
            elif left < 10:
                res = {
                    "status": "skipped",
                    "reason": f"out of time ({a.budget:.0f} s budget spent)",
                    "seconds": 0.0,
                    "figures": {},
                    "checks": [],
                }
            else:
                _log(log, f"\n## stage {st.name}: {st.what} (timeout {min(st.timeout_s, left):.0f} s)")
                res = run_stage(st, sys.executable, a.scratch, min(st.timeout_s, left), log)
            if st.name == "machine":
                cuda = bool(res.get("figures", {}).get("cuda_available", False))
                why = str(res.get("figures", {}).get("cuda_reason", "the machine stage did not finish"))
            results[st.name] = res
            reason = f": {res['reason']}" if res.get("reason") else ""
            _log(log, f"== {st.name}: {res['status'].upper()}{reason} ({res.get('seconds', 0):.1f} s)")
        total = time.perf_counter() - t_start
        counts = {s: sum(r["status"] == s for r in results.values()) for s in ("passed", "failed", "skipped")}
        _log(
            log,
            f"\ndevice check: {counts['passed']} passed, {counts['failed']} failed, "
            f"{counts['skipped']} skipped in {total:.0f} s; files in {a.out}",
        )
    (a.out / "device_check.xml").write_text(junit(results, total))
    (a.out / "figures.json").write_text(
        json.dumps({"seconds": round(total, 1), "stages": results}, indent=1, default=str)
    )
    return 1 if counts["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
