#!/usr/bin/env bash
# The prepared check for a GPU host (issue 19, the CUDA delivery path), in two halves:
#
#   bash tools/device_check.sh prepare   here, where pip reaches a registry: the wheels the GPU
#                                        host's Python (3.12) lacks, into .whl/ (git-ignored),
#                                        and this machine's liburing.so.2 beside them
#   bash tools/device_check.sh           on the GPU host (no network, its own torch with CUDA):
#                                        installs .whl/ into /tmp/site (seconds), runs the CUDA
#                                        tests and the H2D benchmark, and writes JSON and logs
#                                        into $OUT (default ./device-out)
#
# Through the session's device tool: run with carry [".whl", "kvtierd/io/_liburing.abi3.so"] and
# the command `bash tools/device_check.sh`, timeout_s 420 (the check takes about 2 minutes on an
# H200; the rest is room for the machine's start). The benchmark's --record run there rewrites
# its section of docs/benchmarks.md; it comes back as $OUT/benchmarks.md with $OUT/cuda.png:
# copy that section and the plot into the checkout.
set -euo pipefail
cd "$(dirname "$0")/.."

# Pinned to what the test set-up installs here, so both machines run the same versions.
WHEELS=(msgspec==0.23.0 zstandard==0.25.0 trio==0.35.0 outcome==1.3.0.post0 cffi==2.0.0
        pycparser==3.0 humanfriendly==10.0 redis==8.1.0 hiredis==3.5.0)

if [[ ${1:-} == prepare ]]; then
    rm -rf .whl && mkdir -p .whl/lib
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 -d .whl "${WHEELS[@]}"
    cp -L /lib/x86_64-linux-gnu/liburing.so.2 .whl/lib/
    ls kvtierd/io/_liburing*.so >/dev/null  # the io_uring binding travels too (carry it)
    du -sh .whl
    exit 0
fi

OUT=${OUT:-$PWD/device-out}
mkdir -p "$OUT"
exec > >(tee "$OUT/device_check.log") 2>&1
start=$(date +%s)
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD LD_LIBRARY_PATH=$PWD/.whl/lib:${LD_LIBRARY_PATH:-}
python3 -c 'import torch, kvtierd.client.cuda as c; print("torch", torch.__version__, "cuda", torch.cuda.is_available())'
echo "installed in $(($(date +%s) - start)) s"

status=0
python3 -m pytest -q -p no:cacheprovider tests/integration/test_cuda_delivery.py \
    --junitxml="$OUT/cuda_tests.xml" || status=$?
python3 -m tools.bench_cuda --json --record | tee "$OUT/bench_cuda.json" || status=$?
cp docs/benchmarks.md "$OUT/benchmarks.md"
cp docs/benchmarks/cuda.png "$OUT/cuda.png" 2>/dev/null || true
echo "device check done in $(($(date +%s) - start)) s, status $status"
exit $status
