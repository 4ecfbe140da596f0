#!/usr/bin/env bash
# Set up everything the tests and benchmarks need, then run every check: lint, types, and the
# whole test suite (real daemons, real redis-server, real sockets, in temporary directories).
# PYTHON names the interpreter (default python3), as in tools/setup.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/setup.sh test
PYTHON=${PYTHON:-python3}
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
echo "== ruff"; "$PYTHON" -m ruff check kvtierd tests tools
echo "== mypy"; "$PYTHON" -m mypy kvtierd
echo "== pytest"; exec "$PYTHON" -m pytest "$@"
