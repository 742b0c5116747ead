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

pip_install() {
  # pip's output is shown only when it fails (or for warnings other than unreachable index folders).
  local log
  log=$(mktemp)
  if ! "$VPY" -m pip install -q --disable-pip-version-check "$@" >"$log" 2>&1; then
    cat "$log" >&2
    rm -f "$log"
    exit 1
  fi
  grep -v -e "is ignored: it is neither a file nor a directory" -e "^\s*$" "$log" >&2 || true
  rm -f "$log"
}

if ! "$VPY" -c "import torch" 2>/dev/null; then
  echo "setup: installing torch==2.13.0" >&2
  pip_install torch==2.13.0
fi
stamp=.venv/.hangwatch-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || [ setup.py -nt "$stamp" ]; then
  echo "setup: installing hangwatch and its dependencies" >&2
  pip_install -e ".[dev,profiling,lightning,trl]"
  touch "$stamp"
fi
