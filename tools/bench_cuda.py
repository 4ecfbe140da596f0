"""The last hop: leased blocks out of kvtierd's arena into an engine's K/V planes, layer by layer
(``kvtierd.client.cuda``), against plain copies of the same bytes in the same run.

    python -m tools.bench_cuda [--json] [--record] [--device auto|cpu|cuda] [--blocks 64]

Blocks of a 7B-class layout (32 layers, 8 KV heads of 128, 16 tokens, bf16: 2 MiB each), put
into a real daemon and leased from DRAM. Per round, in turn:

* **kvtierd**: ``deliver`` of the lease into ``[2L, H, T, D]`` planes on the device (one copy per
  block and layer into a staging buffer, one scatter per layer, an event per layer), until the
  last layer's event; on CUDA the arena mapping is registered as pinned memory once, before;
* **pinned**: one copy of the same number of bytes from a contiguous pinned host tensor (on
  CPU: a numpy copy between two buffers, the memcpy reference);
* **pageable** (CUDA only): the same from ordinary host memory;
* **first layer** (CUDA only): how long after ``deliver`` is called layer 0 is in place (its
  event), against the whole delivery: what an engine that waits layer by layer gains.

Median GB/s over ``--rounds``. ``--record`` writes section ``cuda`` of ``docs/benchmarks.md``
and ``docs/benchmarks/cuda.png``; ``tools/device_check.sh`` runs this on a GPU host.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvtierd.client import connect
from kvtierd.client.cuda import KvGeometry, PinnedRegion, block_tensors, deliver
from kvtierd.protocol.messages import Layout
from kvtierd.testing import DaemonProcess
from tools import benchlib

LAYOUT = Layout(
    "bench/7b-like", layers=32, kv_heads=8, head_dim=128, dtype="bfloat16", block_tokens=16
)
GEOMETRY = KvGeometry.of(LAYOUT)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(device: torch.device, blocks: int, rounds: int, root: Path) -> dict[str, Any]:
    nbytes = blocks * GEOMETRY.block_bytes
    dram = f"{max(256, 2 * nbytes >> 20)}M"
    shape = (
        2 * GEOMETRY.layers,
        GEOMETRY.kv_heads,
        blocks * GEOMETRY.block_tokens,
        GEOMETRY.head_dim,
    )
    planes = torch.zeros(shape, dtype=GEOMETRY.dtype, device=device)
    source = torch.randn(shape, generator=torch.Generator().manual_seed(0)).to(GEOMETRY.dtype)
    bt = GEOMETRY.block_tokens
    packed = [source[:, :, b * bt : (b + 1) * bt].contiguous() for b in range(blocks)]
    cuda = device.type == "cuda"
    pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=cuda)
    pageable = torch.empty(nbytes, dtype=torch.uint8)
    target = torch.empty(nbytes, dtype=torch.uint8, device=device)
    out: dict[str, list[float]] = {"kvtierd": [], "pinned": [], "pageable": [], "first_layer": []}
    with DaemonProcess(root / "kvtierd", dram_size=dram, nvme_size=None) as daemon:
        client = connect(daemon.socket, client_name="bench-cuda")
        ns = client.namespace("bench", layout=LAYOUT)
        keys = [b.to_bytes(16, "big") for b in range(blocks)]
        ns.put(keys, [p.view(torch.uint8).numpy() for p in packed])
        with warnings.catch_warnings():  # the mapping is only read through this tensor
            warnings.filterwarnings("ignore", message=".*not writable.*")
            arena = torch.frombuffer(ns.arena_buffer(), dtype=torch.uint8)
        with PinnedRegion(arena, device):
            for _ in range(rounds + 1):  # the first round warms up (CUDA context, allocator)
                planes.zero_()
                with ns.lease(keys) as lease:
                    views = block_tensors(lease, GEOMETRY)
                    _sync(device)
                    start = time.perf_counter()
                    delivery = deliver(views, planes, 0)
                    if cuda:
                        delivery.events[0].synchronize()
                        first = time.perf_counter() - start
                    delivery.finish()
                    whole = time.perf_counter() - start
                out["kvtierd"].append(whole)
                if cuda:
                    out["first_layer"].append(first / whole)
                out["pinned"].append(_copy_s(pinned, target, device))
                if cuda:
                    out["pageable"].append(_copy_s(pageable, target, device))
            if not torch.equal(planes.cpu().view(torch.int16), source.view(torch.int16)):
                raise RuntimeError("the delivered planes differ from the blocks stored")
        client.close()
    for name in out:
        out[name] = out[name][1:]
    gbps = {
        n: round(nbytes / statistics.median(v) / 1e9, 2)
        for n, v in out.items()
        if v and n != "first_layer"
    }
    result: dict[str, Any] = {
        "device": torch.cuda.get_device_name(device) if cuda else "cpu",
        "blocks": blocks,
        "block_bytes": GEOMETRY.block_bytes,
        "rounds": rounds,
        "gb_per_s": gbps,
        "kvtierd_vs_pinned": round(gbps["kvtierd"] / gbps["pinned"], 2),
    }
    if cuda:
        result["kvtierd_vs_pageable"] = round(gbps["kvtierd"] / gbps["pageable"], 2)
        result["first_layer_share"] = round(statistics.median(out["first_layer"]), 3)
    return result


def _copy_s(host: torch.Tensor, target: torch.Tensor, device: torch.device) -> float:
    if device.type == "cuda":
        _sync(device)
        start = time.perf_counter()
        target.copy_(host, non_blocking=True)
        _sync(device)
        return time.perf_counter() - start
    a, b = host.numpy(), target.numpy()
    start = time.perf_counter()
    np.copyto(b, a)
    return time.perf_counter() - start


def record(result: dict[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(result["gb_per_s"])
    fig, ax = plt.subplots(figsize=(6, 3.2))
    ax.bar(names, [result["gb_per_s"][n] for n in names], color=["C0", "C1", "C2"][: len(names)])
    ax.set_ylabel("GB/s")
    ax.set_title(f"arena -> {result['device']}, {result['blocks']} blocks of 2 MiB", fontsize=9)
    ax.grid(alpha=0.3, axis="y")
    benchlib.save_figure(fig, "cuda.png")
    benchlib.record("cuda", "\n".join(_section(result)), result)


def _section(result: dict[str, Any]) -> list[str]:
    g = result["gb_per_s"]
    cells = ", ".join(f"{name} {value} GB/s" for name, value in g.items())
    lines = [
        "## Into engine memory (layer-wise delivery)",
        "",
        f"`python -m tools.bench_cuda --record` on {result['device']}: {result['blocks']} "
        f"leased blocks of {result['block_bytes']:,} bytes (32 layers, 8 KV heads of 128, 16 "
        "tokens, bf16) delivered by `kvtierd.client.cuda.deliver` into `[2L, H, T, D]` planes, "
        "layer by layer, against one copy of as many bytes from a pinned host tensor (on CPU: "
        "a numpy copy) and, on CUDA, from pageable memory; medians of "
        f"{result['rounds']} rounds after a warm-up.",
        "",
        f"{cells}; kvtierd / pinned **{result['kvtierd_vs_pinned']}x**"
        + (
            f", kvtierd / pageable {result['kvtierd_vs_pageable']}x; layer 0 is in place after "
            f"{result['first_layer_share']:.1%} of the whole delivery."
            if "kvtierd_vs_pageable" in result
            else ". No GPU was lent to the session that recorded this: the CUDA figures come "
            "from `tools/device_check.sh` on a GPU host."
        ),
        "",
        "![GB/s](benchmarks/cuda.png)",
        "",
        benchlib.machine_line(result["machine"]),
    ]
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    parser.add_argument("--blocks", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--record", action="store_true", help="write docs/benchmarks.md section")
    parser.add_argument("--json", action="store_true", help="one line of JSON")
    args = parser.parse_args(argv)
    if args.blocks < 1 or args.rounds < 1:
        parser.error("--blocks and --rounds must be at least 1")
    name = "cuda" if args.device == "auto" and torch.cuda.is_available() else args.device
    if name == "auto":
        name = "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no CUDA device")
    with tempfile.TemporaryDirectory() as tmp:
        result = measure(torch.device(name), args.blocks, args.rounds, Path(tmp))
    result["machine"] = benchlib.machine()
    if args.record:
        record(result)
    benchlib.emit(result, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
