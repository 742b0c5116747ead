#!/usr/bin/env bash
# Creates .venv when missing and installs hangwatch into it (idempotent, quiet when up to date).
# torch==2.13.0 is installed first when no torch is present: letting pip resolve a bare `torch`
# on a machine without one would fetch gigabytes of CUDA packages.
#
#   scripts/setup.sh               the Python environment: all the demo and hangwatch itself need
#   scripts/setup.sh --with-slurm  the same, and the system packages the Slurm tests run a cluster with (slurm-wlm,
#                                  munge); scripts/test.sh asks for them, nothing else does
set -euo pipefail
cd "$(dirname "$0")/.."
with_slurm=0
for arg in "$@"; do
  case "$arg" in
    --with-slurm) with_slurm=1 ;;
    *) echo "setup: unknown argument $arg (usage: scripts/setup.sh [--with-slurm])" >&2; exit 64 ;;
  esac
done
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

# Slurm and munge for the tests on a real one-host cluster (tests/slurm, scripts/slurm-cluster.sh): installed from
# the distribution's packages when missing, only as root with apt-get; never a reason to fail (those tests then skip
# and say why).
if [ "$with_slurm" = 1 ] && { ! command -v slurmctld >/dev/null 2>&1 || ! command -v munged >/dev/null 2>&1; }; then
  if [ "$(id -u)" -eq 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "setup: installing slurm-wlm and munge for the Slurm tests (apt-get)" >&2
    aptlog=$(mktemp)
    if ! { DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends slurm-wlm munge >"$aptlog" 2>&1 ||
      { apt-get update -q >>"$aptlog" 2>&1 &&
        DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends slurm-wlm munge >>"$aptlog" 2>&1; }; }; then
      echo "setup: slurm-wlm and munge could not be installed (the Slurm tests will skip): $(tail -n 1 "$aptlog")" >&2
    fi
    rm -f "$aptlog"
  fi
fi

if ! "$VPY" -c "import torch" 2>/dev/null; then
  echo "setup: installing torch==2.13.0" >&2
  pip_install torch==2.13.0
fi
stamp=.venv/.hangwatch-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || [ setup.py -nt "$stamp" ]; then
  echo "setup: installing hangwatch and its dependencies" >&2
  pip_install -e ".[dev,profiling,lightning,trl,trackers]"
  touch "$stamp"
fi
