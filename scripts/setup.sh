#!/usr/bin/env bash
# Creates .venv (once) and installs rlhf-operator with every extra the tests need.
# Re-running is cheap: pip's cache serves the wheels and an up-to-date venv is left alone.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! "$PY" -c 'import sys; sys.exit(sys.version_info < (3, 10))'; then
  echo "error: $PY is $("$PY" -V 2>&1); rlhf-operator needs Python >= 3.10" >&2
  exit 1
fi
if [ ! -x .venv/bin/python ]; then
  echo "==> creating .venv"
  "$PY" -m venv .venv
fi
stamp=.venv/.rlhf-setup-stamp
if [ -f "$stamp" ] && [ "$stamp" -nt pyproject.toml ] && .venv/bin/python -c 'import rlhf_trainer, rlhf_operator, torch, ray, kopf' 2>/dev/null; then
  echo "==> .venv is up to date"
  exit 0
fi
echo "==> installing rlhf-operator[dev] into .venv (torch is a large download the first time)"
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -e '.[dev]'
touch "$stamp"
echo "==> done: .venv/bin/rlhf --help"
