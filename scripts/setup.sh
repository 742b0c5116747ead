#!/usr/bin/env bash
# Creates .venv when missing and installs hangwatch into it (idempotent, quiet when up to date).
# torch==2.13.0 is installed first when no torch is present: letting pip resolve a bare `torch`
# on a machine without one would fetch gigabytes of CUDA packages.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  echo "setup: creating .venv" >&2
  "$PY" -m venv .venv
fi
VPY=.venv/bin/python
if ! "$VPY" -c "import torch" 2>/dev/null; then
  echo "setup: installing torch==2.13.0" >&2
  "$VPY" -m pip install -q torch==2.13.0
fi
stamp=.venv/.hangwatch-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  echo "setup: installing hangwatch and its dependencies" >&2
  "$VPY" -m pip install -q -e ".[dev,profiling]"
  touch "$stamp"
fi
