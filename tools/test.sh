#!/usr/bin/env bash
# Set up, then run every check: lint, types, and the whole test suite (real daemons, real
# redis-server, real sockets, in temporary directories).
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/setup.sh
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
echo "== ruff"; ruff check kvtierd tests tools
echo "== mypy"; mypy kvtierd
echo "== pytest"; exec python3 -m pytest "$@"
