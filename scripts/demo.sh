#!/usr/bin/env bash
# Set up (when needed) and run the demo: the tiny model trains on CPU under the supervisor, an
# injected hang in eval generate() is caught, dumped, killed and the run resumes and finishes.
# The set-up is the Python environment only: the demo needs no system package.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
config=${1:-configs/demo.yaml}
shift || true
# The demo is for watching: a finished demo in runs/demo is set aside so that it runs again (`hangwatch run` itself
# starts nothing for a run that finished, and exits 79).
if [ "$config" = configs/demo.yaml ] && .venv/bin/python -c \
    "import json, sys; sys.exit(json.load(open('runs/demo/state.json')).get('state') != 'finished')" 2>/dev/null; then
  echo "demo: runs/demo holds the last demo, finished; starting afresh" >&2
  rm -rf runs/demo
fi
exec .venv/bin/hangwatch run "$config" "$@"
