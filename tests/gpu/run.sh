#!/usr/bin/env bash
# One command for a lent GPU machine (an H200, or any CUDA machine): the GPU tests, then the
# figures (train-step MFU; weight-sync GB/s vs a raw NCCL broadcast when there are 2+ GPUs; a
# GRPO job whose reward rises). Elsewhere it prints "skipped: needs a GPU" and exits 0.
#
#   tests/gpu/run.sh                 # from the repository root, in the project's environment
#   PYTHON=/path/to/python tests/gpu/run.sh   # default: .venv/bin/python, else python3
#
# Budget: under 8 minutes on one H200 (the tests ~2 min, MFU ~1 min, GRPO ~3 min). For a short
# lease on a machine without Ray or vLLM, run tests/gpu/device_check.sh OUTDIR instead (first).
# $OUT gets the small files (JUnit XML, figures.json); models and run directories go to a mktemp
# scratch directory, removed at the end.
set -euo pipefail
cd "$(dirname "$0")/../.."
if [ -z "${PYTHON:-}" ]; then
  if [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
export PYTHONPATH="$PWD/api:$PWD/trainer:$PWD/operator${PYTHONPATH:+:$PYTHONPATH}"
OUT="${OUT:-/tmp/rlhf-gpu-figures}"
mkdir -p "$OUT"

if ! "$PYTHON" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
  echo "skipped: needs a GPU (no CUDA device on this machine)"
  exit 0
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true

SCRATCH=$(mktemp -d "${TMPDIR:-/tmp}/rlhf-gpu-run.XXXXXX")
trap 'rm -rf "$SCRATCH"' EXIT
status=0
# The GPU tests: this directory, and every test marked `gpu` elsewhere in the suite.
timeout 300 "$PYTHON" -m pytest -q -m gpu tests/gpu tests/trainer -p no:cacheprovider \
  --junitxml="$OUT/gpu-tests.xml" || status=$?
# The figures (each printed as `figure: name = value`).
timeout 360 "$PYTHON" tests/gpu/figures.py --work "$SCRATCH" --json "$OUT/figures.json" || status=$?
echo "gpu run: exit $status; figures in $OUT/figures.json"
exit $status
