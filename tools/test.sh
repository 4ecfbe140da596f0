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
echo "== unasync"; "$PYTHON" -m tools.unasync_client --check
# The daemons the tests start preallocate their data files: a nearly full disk fails dozens of
# tests with ENOSPC far from the cause, so say so first.
tmp=${TMPDIR:-/tmp}
need_gib=${KVTIERD_TEST_FREE_GIB:-4}
free_gib=$(( $(df --output=avail -k "$tmp" | tail -1) / 1048576 ))
if (( free_gib < need_gib )); then
    echo "test.sh: $tmp has $free_gib GiB free; the tests need about $need_gib GiB" \
        "(set KVTIERD_TEST_FREE_GIB to change the floor, or TMPDIR to use another disk)" >&2
    exit 1
fi
# What the suite leaves in /dev/shm (engines' message queues, semaphores, offloading regions)
# stays until a reboot: such an entry of this uid, new and held by no process, fails the run
# as a failed test would (kvtierd/testing/shm.py says which names).
shm_before=$(mktemp)
trap 'rm -f "$shm_before"' EXIT
ls -1 /dev/shm > "$shm_before" 2>/dev/null || true
echo "== pytest"
status=0
"$PYTHON" -m pytest "$@" || status=$?
echo "== /dev/shm"
if ! "$PYTHON" -m kvtierd.testing.shm "$shm_before"; then
    echo "test.sh: the tests left shared memory in /dev/shm (listed above)" >&2
    (( status != 0 )) || status=1
fi
exit "$status"
