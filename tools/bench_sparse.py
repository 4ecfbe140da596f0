"""Scaling of sparse block selection: query cost against 1K..1M indexed blocks vs a full scan.

    python tools/bench_sparse.py [--json] [--sizes 1000,10000,100000,1000000] [--record]

Synthetic summaries, one group (one layer, one KV head, head_dim 64, a GQA group of 3 query
heads): the cost of a real model is this times its (layer, KV head) groups, for both sides. A
block's box has a centre drawn from a 64-dimensional Gaussian with a few heavy dimensions (as
real keys have) and half-widths around 0.5; queries are Gaussian. The budget is fixed at 128
blocks (2K tokens of 16-token blocks), because an engine's HBM budget does not grow with the
context: that is what makes sub-linear selection possible at all.

Per size: median wall time of ``SparseIndex.select`` (LSH pool -> sketch shortlist -> box
re-rank) and of the strongest full scan we could write (Quest's bound as two matrix products
over every block, then ``argpartition``), the overlap of the LSH selection with an exact box
scan's, the build time, and the index's memory. Records section ``sparse_scaling`` of
``docs/benchmarks.md`` (table and ``docs/benchmarks/sparse_scaling.png``) with ``--record``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib

from kvtierd.slsap.sparse import SparseConfig, SparseIndex

DIM, Q_HEADS, BUDGET = 64, 3, 128


def synthetic_boxes(n: int, rng: np.random.Generator) -> np.ndarray:
    """``[n, 1, 1, 3, DIM]`` float16 stacked boxes (min, max, mean)."""
    scale = np.ones(DIM, dtype=np.float32)
    scale[:4] = 4.0  # a few heavy dimensions, as post-RoPE keys have
    out = np.empty((n, 1, 1, 3, DIM), dtype=np.float16)
    for lo in range(0, n, 65536):
        m = min(n, lo + 65536) - lo
        centre = rng.standard_normal((m, DIM), dtype=np.float32) * scale
        half = np.abs(rng.normal(0.5, 0.2, (m, DIM))).astype(np.float32)
        out[lo : lo + m, 0, 0, 0] = centre - half
        out[lo : lo + m, 0, 0, 1] = centre + half
        out[lo : lo + m, 0, 0, 2] = centre + rng.uniform(-0.2, 0.2, (m, DIM)) * half
    return out


def full_scan(queries: np.ndarray, lo: np.ndarray, hi: np.ndarray, budget: int) -> np.ndarray:
    """Quest over every block: bound per head, summed softmax shares, top ``budget``."""
    q = queries / np.float32(np.sqrt(DIM))
    bound = np.maximum(q, 0) @ hi.T + np.minimum(q, 0) @ lo.T  # [heads, n]
    bound -= bound.max(axis=1, keepdims=True)
    share = np.exp(bound)
    share /= share.sum(axis=1, keepdims=True)
    return np.argpartition(-share.sum(axis=0), budget)[:budget]


def _median_s(fn: Any, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return float(np.median(times))


def measure(n: int, repeats: int, seed: int = 1) -> dict[str, Any]:
    rng = np.random.default_rng(seed)
    boxes = synthetic_boxes(n, rng)
    config = SparseConfig(layers=(0,), q_heads=Q_HEADS, kv_heads=1, head_dim=DIM)
    index = SparseIndex(config)
    t = time.perf_counter()
    index.insert_many(np.arange(n), np.arange(n), boxes)
    build_s = time.perf_counter() - t
    lo32 = boxes[:, 0, 0, 0].astype(np.float32)
    hi32 = boxes[:, 0, 0, 1].astype(np.float32)
    queries = rng.standard_normal((repeats, 1, Q_HEADS, DIM), dtype=np.float32)
    queries[..., :4] *= 2
    it = iter(range(10**9))
    select_s = _median_s(lambda: index.select(queries[next(it) % repeats], BUDGET), repeats)
    it = iter(range(10**9))
    scan_s = _median_s(
        lambda: full_scan(queries[next(it) % repeats, 0], lo32, hi32, BUDGET), repeats
    )
    overlap = []
    for q in queries[: min(repeats, 5)]:
        got = index.select(q, BUDGET).block_ids[0]
        want = index.select(q, BUDGET, exhaustive=True).block_ids[0]
        overlap.append(np.isin(got, want).mean())
    t = time.perf_counter()
    extra = synthetic_boxes(256, rng)
    for i in range(256):
        index.insert_many([n + i], [n + i], extra[i : i + 1])
    insert_us = (time.perf_counter() - t) / 256 * 1e6
    t = time.perf_counter()
    for i in range(256):
        index.remove(i + 1)
    remove_us = (time.perf_counter() - t) / 256 * 1e6
    return {
        "blocks": n,
        "select_ms": round(select_s * 1e3, 3),
        "full_scan_ms": round(scan_s * 1e3, 3),
        "speedup": round(scan_s / select_s, 2),
        "overlap_with_exact_box_scan": round(float(np.mean(overlap)), 3),
        "build_s": round(build_s, 2),
        "insert_us": round(insert_us, 1),
        "remove_us": round(remove_us, 1),
        "index_mib": round(index.memory_bytes() / 2**20, 1),
    }


def record(result: dict[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["sizes"]
    fig, ax = plt.subplots(figsize=(6, 4))
    xs = [r["blocks"] for r in rows]
    ax.loglog(xs, [r["select_ms"] for r in rows], marker="o", label="SparseIndex.select (LSH)")
    ax.loglog(xs, [r["full_scan_ms"] for r in rows], marker="s", label="full min/max scan")
    ax.set_xlabel("indexed blocks (one layer, one KV head)")
    ax.set_ylabel("median query time (ms)")
    ax.grid(alpha=0.3, which="both")
    ax.legend()
    fig.tight_layout()
    benchlib.ASSETS.mkdir(parents=True, exist_ok=True)
    fig.savefig(benchlib.ASSETS / "sparse_scaling.png", dpi=110)
    lines = [
        "## Sparse selection scaling (SLSAP)",
        "",
        "`python tools/bench_sparse.py --record`: one (layer, KV head) group, head_dim 64, 3 query "
        f"heads, synthetic boxes, budget {BUDGET} blocks; median of {result['repeats']} queries. "
        "The full scan is Quest's bound as two matrix products over every block plus argpartition. "
        "Overlap: share of the LSH selection that an exact box-score scan also selects.",
        "",
        "| blocks | select ms | full scan ms | speedup | growth per 10x | overlap | build s "
        "| insert us | remove us | index MiB |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    prev = None
    for r in rows:
        growth = "" if prev is None else f"{r['select_ms'] / prev['select_ms']:.2f}x"
        lines.append(
            f"| {r['blocks']:,} | {r['select_ms']:.2f} | {r['full_scan_ms']:.2f} "
            f"| {r['speedup']:.1f}x | {growth} | {r['overlap_with_exact_box_scan']:.2f} "
            f"| {r['build_s']:.1f} "
            f"| {r['insert_us']:.0f} | {r['remove_us']:.0f} | {r['index_mib']:.0f} |"
        )
        prev = r
    lines += [
        "",
        "![query cost vs blocks](benchmarks/sparse_scaling.png)",
        "",
        benchlib.machine_line(result["machine"]),
    ]
    benchlib.record("sparse_scaling", "\n".join(lines), result)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="1000,10000,100000,1000000")
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--record", action="store_true", help="write docs/benchmarks.md section")
    parser.add_argument("--json", action="store_true", help="one line of JSON")
    args = parser.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",") if s]
    rows = [measure(n, args.repeats) for n in sizes]
    result = {
        "sizes": rows,
        "budget_blocks": BUDGET,
        "head_dim": DIM,
        "q_heads": Q_HEADS,
        "repeats": args.repeats,
        "machine": benchlib.machine(),
    }
    if args.record:
        record(result)
    benchlib.emit(result, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
