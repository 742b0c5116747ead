#!/usr/bin/env bash
# Set up (when needed), check the style (ruff) and run the whole test suite. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
# Style first (seconds): the linter and the formatter, as configured in pyproject.toml.
.venv/bin/ruff check --quiet .
.venv/bin/ruff format --check --quiet .
exec .venv/bin/python -m pytest -q -ra --durations=10 "$@"
