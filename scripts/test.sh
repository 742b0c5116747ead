#!/usr/bin/env bash
# Set up (when needed), check the style (ruff) and run the whole test suite. Extra arguments go to pytest.
# The set-up is the demo's plus the system packages of the Slurm tests (slurm-wlm, munge: installed as root with
# apt-get when missing, said on stderr; elsewhere those tests skip and say why).
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh --with-slurm
# Style first (seconds): the linter and the formatter, as configured in pyproject.toml.
.venv/bin/ruff check --quiet .
.venv/bin/ruff format --check --quiet .
exec .venv/bin/python -m pytest -q -ra --durations=10 "$@"
