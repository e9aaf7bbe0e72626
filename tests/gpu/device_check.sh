#!/usr/bin/env bash
# The one-command GPU check for a short lease (at most 8 minutes on one H200): run it first on a
# lent GPU machine. It needs only the machine's own Python and torch (transformers for the model
# stages): no network, no Ray, no vLLM, no cel-python; whatever is missing is reported and that
# stage skipped. Every stage runs in its own process with its own timeout (tests/gpu/stages/).
#
#   bash tests/gpu/device_check.sh OUTDIR                # the machine's python3
#   PYTHON=/path/to/python bash tests/gpu/device_check.sh OUTDIR
#   bash tests/gpu/device_check.sh OUTDIR --only grpo fsdp   # a rerun of some stages (machine always runs)
#
# Writes OUTDIR/device_check.log, OUTDIR/device_check.xml (JUnit), OUTDIR/figures.json, and
# OUTDIR/gpu-tests.xml (the GPU tests' own JUnit, when they ran); scratch data (checkpoints, the
# MFU model) goes to a mktemp directory, removed at the end; the tiny model is made once in the
# project's model cache (~/.cache/rlhf-operator/models, as the GPU tests do). Without a GPU every GPU stage is
# reported "needs a GPU" and skipped, and the check exits 0. The full check for a machine with
# Ray and vLLM is tests/gpu/run.sh.
set -euo pipefail
[ $# -ge 1 ] || { echo "usage: $0 OUTDIR [--only STAGE...]" >&2; exit 2; }
OUTDIR=$1
shift
mkdir -p "$OUTDIR"
OUTDIR=$(cd "$OUTDIR" && pwd)
cd "$(dirname "$0")/../.."
PYTHON=${PYTHON:-python3}
command -v "$PYTHON" >/dev/null || { echo "error: no $PYTHON on PATH (set PYTHON)" >&2; exit 2; }
export PYTHONPATH="$PWD/api:$PWD/trainer:$PWD/operator${PYTHONPATH:+:$PYTHONPATH}"
export DEVICE_CHECK_OUT="$OUTDIR"
SCRATCH=$(mktemp -d "${TMPDIR:-/tmp}/rlhf-device-check.XXXXXX")
trap 'rm -rf "$SCRATCH"' EXIT
# The whole check is bounded too (the driver's own budget is 470 s; this is the backstop).
timeout --kill-after=10 "${DEVICE_CHECK_TIMEOUT_S:-490}" \
  "$PYTHON" tests/gpu/device_check.py --out "$OUTDIR" --scratch "$SCRATCH" "$@"
