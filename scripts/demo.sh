#!/usr/bin/env bash
# Set up (when needed) and run the demo: the tiny model trains on CPU under the supervisor, an
# injected hang in eval generate() is caught, dumped, killed and the run resumes and finishes.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
config=${1:-configs/demo.yaml}
shift || true
exec .venv/bin/hangwatch run "$config" "$@"
