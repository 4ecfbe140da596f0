"""Verifying in the copy against hashing and then copying, for each engine's destination.

    python -m tools.bench_engine_copies [--json] [--pairs 15] [--threads 1] [--record]

Each case copies leased-block-shaped bytes (random, with their xxh3-64) out of one buffer into
an engine's host memory, two ways, alternated pair by pair in one process (this machine's
memory bandwidth swings 2-3x within seconds, so only a pair's ratio compares):

* **hash, then copy**: ``xxh3`` of the block, then the engine's own torch copy (what the
  engines did, and what the HF restore and every GPU path still do);
* **one pass**: :func:`kvtierd.client.arena.copy_verified` into the destination's contiguous
  runs (:mod:`kvtierd.engines.host_runs`), as the engines now do where the copy is kvtierd's.

Cases: ``vllm`` (the connector's host loads: 30 layers' K and V planes per block, block 0's
runs shifted by tiles, as ``KvtierdConnector._host_runs_of``); ``hf`` (the HF restore's slab:
hash then one strided ``copy_`` per run of blocks, against 180 runs per block); ``sglang``
(``batch_get_v1``'s ``page_first`` host pages, 2 runs each). Shapes are SmolLM2's (30 layers,
3 KV heads of 64) for vLLM and HF, bench_sglang's 448 KiB pages for SGLang. ``--threads``
sets torch's threads (its copies use them; the one-pass copy is one thread). Ratios > 1: the
one pass is faster. ``--record`` writes section ``engine_copies`` of ``docs/benchmarks.md``.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import xxhash

from kvtierd.client.arena import ByteRuns, checksum, copy_verified
from kvtierd.engines.hf_cache import BlockRun, copy_run
from kvtierd.engines.host_runs import HostRuns
from kvtierd.store.copyhash import default_hasher
from tools import benchlib

LAYERS, HEADS, DIM = 30, 3, 64


class Blocks:
    """``count`` blocks of ``block_bytes`` random bytes in one buffer, and their checksums."""

    def __init__(self, count: int, block_bytes: int) -> None:
        g = torch.Generator().manual_seed(32)
        self.raw = torch.randint(0, 256, (count * block_bytes,), dtype=torch.uint8, generator=g)
        self.view = memoryview(self.raw.numpy().data)
        self.count, self.size = count, block_bytes
        self.sums = [xxhash.xxh3_64_intdigest(self.block(i)) for i in range(count)]

    def block(self, i: int) -> memoryview:
        return self.view[i * self.size : (i + 1) * self.size]

    def verify(self, i: int) -> None:
        if checksum(self.block(i)) != self.sums[i]:
            raise AssertionError(f"block {i} failed its checksum")

    def copy_verified(self, i: int, runs: list[memoryview] | ByteRuns) -> None:
        if not copy_verified(self.block(i), runs, self.sums[i]):
            raise AssertionError(f"block {i} failed its checksum")


def vllm_case(dtype: torch.dtype, blocks: int = 16, tokens: int = 128) -> tuple[Any, Any, int]:
    """vLLM's CPU cache: one ``[blocks, heads, 2 * tokens, dim]`` tensor per layer."""
    kv = [torch.zeros((blocks, HEADS, tokens, 2 * DIM), dtype=dtype) for _ in range(LAYERS)]
    src = Blocks(blocks, 2 * LAYERS * HEADS * tokens * DIM * dtype.itemsize)

    def planes(tensor: torch.Tensor, b: int) -> torch.Tensor:
        return tensor[b].view(HEADS, 2, tokens, DIM).permute(1, 0, 2, 3)

    runs = HostRuns()
    spans = [(*runs.spans(planes(t, 0)), t.stride(0) * t.element_size()) for t in kv]

    def hash_then_copy() -> None:
        for b in range(blocks):
            src.verify(b)
            block = src.raw[b * src.size : (b + 1) * src.size].view(dtype)
            block = block.view(2 * LAYERS, HEADS, tokens, DIM)
            for layer, tensor in enumerate(kv):
                planes(tensor, b).copy_(block[2 * layer : 2 * layer + 2])

    def one_pass() -> None:
        for b in range(blocks):
            targets: list[memoryview] = []
            for storage, layer_spans, tile in spans:
                targets += [storage[a + b * tile : z + b * tile] for a, z in layer_spans]
            src.copy_verified(b, targets)

    return hash_then_copy, one_pass, blocks * src.size


def hf_case(dtype: torch.dtype, blocks: int = 64, tokens: int = 64) -> tuple[Any, Any, int]:
    """The HF restore's slab ``[2L, heads, capacity, dim]``, blocks ``[2L, heads, bt, dim]``."""
    slab = torch.zeros((2 * LAYERS, HEADS, blocks * tokens + 128, DIM), dtype=dtype)
    src = Blocks(blocks, 2 * LAYERS * HEADS * tokens * DIM * dtype.itemsize)
    storage, spans = HostRuns().spans(slab[:, :, :tokens, :])
    step = tokens * DIM * dtype.itemsize

    def hash_then_copy() -> None:
        for b in range(blocks):
            src.verify(b)
        view = src.raw.view(dtype).view(blocks, 2 * LAYERS, HEADS, tokens, DIM)
        copy_run(slab, BlockRun(0, blocks * tokens, view), tokens)

    starts = [a for a, _ in spans]
    length = spans[0][1] - spans[0][0]

    def one_pass() -> None:
        for b in range(blocks):
            src.copy_verified(b, ByteRuns(storage, [a + b * step for a in starts], length))

    return hash_then_copy, one_pass, blocks * src.size


def sglang_case(
    layout: str, pages: int = 192, tokens: int = 16, layers: int = 28
) -> tuple[Any, Any, int]:
    """SGLang's host pool, bf16, 448 KiB pages: ``page_first`` ``[2, slots, layers, 2 heads,
    128]`` (2 runs a page) or ``layer_first`` ``[layers, 2, slots, 2 heads, 128]`` (56)."""
    if layout == "page_first":
        pool = torch.zeros((2, pages * tokens, layers, 2, 128), dtype=torch.bfloat16)
    else:
        pool = torch.zeros((layers, 2, pages * tokens, 2, 128), dtype=torch.bfloat16)
    src = Blocks(pages, 2 * tokens * layers * 2 * 128 * 2)
    runs = HostRuns()

    def page(p: int) -> torch.Tensor:
        if layout == "page_first":
            return pool[:, p * tokens : (p + 1) * tokens]
        return pool[:, :, p * tokens : (p + 1) * tokens]

    def hash_then_copy() -> None:
        for p in range(pages):
            src.verify(p)
            target = page(p)
            block = src.raw[p * src.size : (p + 1) * src.size].view(torch.bfloat16)
            target.copy_(block.view(target.shape))

    def one_pass() -> None:  # as KvtierdHiCacheStorage._load_pages: one native call a page
        for p in range(pages):
            src.copy_verified(p, runs.byte_runs(page(p)))

    return hash_then_copy, one_pass, pages * src.size


def pairs(old: Callable[[], None], new: Callable[[], None], nbytes: int, n: int) -> dict[str, Any]:
    old()
    new()  # first touch of the destinations, and the probe's verdict
    times: dict[str, list[float]] = {"hash_then_copy": [], "one_pass": []}
    for _ in range(n):
        for name, run in (("hash_then_copy", old), ("one_pass", new)):
            start = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - start)
    ratios = [a / b for a, b in zip(times["hash_then_copy"], times["one_pass"], strict=True)]
    return {
        **{f"{k}_gb_per_s": round(nbytes / benchlib.median(v) / 1e9, 3) for k, v in times.items()},
        "speed_ratio": round(benchlib.median(ratios), 2),
        "ratio_range": [round(min(ratios), 2), round(max(ratios), 2)],
        "mib": round(nbytes / 2**20, 1),
    }


def record(result: dict[str, Any]) -> None:
    lines = [
        "## Engine copies: verified in the copy, or hashed then copied",
        "",
        "`tools/bench_engine_copies.py`: each engine's destination filled from leased-block-"
        "shaped bytes two ways, alternated pair by pair in one process: the xxh3 of the block "
        "then the engine's torch copy, against one pass that hashes what it copies "
        f"(`copy_verified` into the destination's runs). {result['pairs']} pairs, torch "
        f"threads {result['threads']}, copy kernel {result['kernel']}. Ratio: the median of "
        "each pair's time of hash-then-copy over one pass (> 1: the one pass is faster).",
        "",
        "| case | MiB | hash then copy GB/s | one pass GB/s | ratio (range) |",
        "|---|---|---|---|---|",
    ]
    for name, c in result["cases"].items():
        low, high = c["ratio_range"]
        lines.append(
            f"| {name} | {c['mib']} | {c['hash_then_copy_gb_per_s']:.2f} | "
            f"{c['one_pass_gb_per_s']:.2f} | {c['speed_ratio']}x ({low}-{high}) |"
        )
    lines += ["", benchlib.machine_line(result["machine"])]
    benchlib.record("engine_copies", "\n".join(lines), result)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pairs", type=int, default=15)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's)")
    parser.add_argument("--record", action="store_true", help="write docs/benchmarks.md section")
    parser.add_argument("--json", action="store_true", help="one line of JSON")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    verdict = default_hasher().verdict(wait=True)
    cases = {
        "vllm bf16": vllm_case(torch.bfloat16),
        "vllm fp32": vllm_case(torch.float32),
        "hf bf16": hf_case(torch.bfloat16),
        "hf fp32": hf_case(torch.float32),
        "sglang page_first": sglang_case("page_first"),
        "sglang layer_first": sglang_case("layer_first"),
    }
    result: dict[str, Any] = {
        "cases": {name: pairs(*case, args.pairs) for name, case in cases.items()},
        "pairs": args.pairs,
        "threads": torch.get_num_threads(),
        "kernel": verdict.kernel if verdict is not None and verdict.ok else "python",
        "machine": benchlib.machine(),
    }
    if args.record:
        record(result)
    benchlib.emit(result, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
