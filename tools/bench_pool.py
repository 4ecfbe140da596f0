"""Benchmarks of the shared pool tier (issue 6): restore throughput against raw GETs of the same
values, and the time to first token of an 8K-token SmolLM2 prompt restored from the pool after a
rank restart against recomputing it. One run, one real ``redis-server``, real daemons.

*Restore vs raw GETs* (per value size). A daemon with a pool (write-through, plaintext on
loopback) stores N blocks of one size; then, for every round, it is stopped, its data directory
is wiped and it is started again: it attaches and indexes the blocks from its manifest in the
pool. A client then READs (leases) every block, ``--concurrency`` blocks in flight, ``--batch``
keys per READ. GB/s counts block bytes over the whole read; the latency of a block is the READ
round trip that leased it. The reference, measured in the same run and alternating with it
(A B, B A, ...): GETs of the very same pool keys (the stored values, header included) with
redis-py's asyncio client and its hiredis parser, ``--concurrency`` GETs in flight; and, when
``redis-benchmark`` is installed, ``redis-benchmark -t set,get -d <size> -c <concurrency>``
(C, one value re-read: what the server and loopback give a client that costs nothing). The
ratio of a round is restore GB/s over raw-GET GB/s; figures are medians of rounds.

*8K restore vs recompute*: the ``pool`` case of the TTFT benchmark's ``hf`` engine
(:mod:`tools.ttft.pool`, ``python -m tools.ttft --engine hf --cases pool`` at any length):
SmolLM2-135M through the HF adapter (``kvtierd.engines.hf``): the prompt's blocks are stored by
a daemon with the pool and an NVMe tier; TTFT from DRAM and cold NVMe first, then, per run, the
daemon is restarted on a wiped data directory and the engine's prefill restores the prefix from
the pool; recomputation runs are interleaved with those runs.

The redis-server runs without persistence (``save ""``, ``appendonly no``): the benchmark
measures reads, and the data only has to outlive the daemons, not the server.

A full run rewrites the "pool" section of ``docs/benchmarks.md`` with its plot and stores the
JSON in ``docs/benchmarks/pool.json``; ``--no-record`` leaves docs/ alone, and so does any
``--skip-*``. Everything is written under a temporary directory on a real disk
(``benchlib.bench_workdir``: ``$BENCH_DIR``, default /var/tmp), removed at the end.

Run: ``python -m tools.bench_pool --json`` (about 5 minutes; ``--skip-ttft``: about 1).
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import anyio
import numpy as np

from kvtierd.client import chain_keys, connect
from kvtierd.testing import DaemonProcess
from tools import benchlib
from tools.benchlib import log, parse_size, size_name
from tools.fidelity import DEFAULT_DATA
from tools.poolrig import daemon_read, pool_config, redis_server, restart_wiped

KiB, MiB = 1 << 10, 1 << 20
GOAL_RATIO = 0.8


# -- restore vs raw GETs -----------------------------------------------------------------------


async def _raw_get(
    port: int, locations: list[bytes], block_bytes: int, concurrency: int
) -> tuple[float, list[float]]:
    """(GB/s of block bytes, per-GET latencies) of GETting every location with redis-py asyncio
    (hiredis), ``concurrency`` GETs in flight."""
    import redis.asyncio as aioredis

    latencies: list[float] = []
    client = aioredis.Redis(port=port, max_connections=concurrency)
    try:
        await client.ping()
        next_key = iter(locations)

        async def worker() -> None:
            for key in next_key:
                t0 = time.perf_counter()
                value = await client.get(key)
                latencies.append(time.perf_counter() - t0)
                if value is None or len(value) < block_bytes:
                    raise RuntimeError("a pool value is missing")

        started = time.perf_counter()
        async with anyio.create_task_group() as tg:
            for _ in range(concurrency):
                tg.start_soon(worker)
        elapsed = time.perf_counter() - started
    finally:
        await client.aclose()
    return len(locations) * block_bytes / elapsed / 1e9, latencies


def redis_benchmark(port: int, block_bytes: int, requests: int, concurrency: int) -> dict[str, Any]:
    """``redis-benchmark -t set,get -d <size>``: the GET line (GB/s, p50/p99 ms)."""
    command = ["redis-benchmark", "-h", "127.0.0.1", "-p", str(port), "-t", "set,get"]
    command += ["-d", str(block_bytes), "-n", str(requests), "-c", str(concurrency), "--csv"]
    out = subprocess.run(command, check=True, capture_output=True, text=True, timeout=300).stdout
    rows = {row["test"]: row for row in csv.DictReader(io.StringIO(out))}
    get = rows["GET"]
    subprocess.run(
        ["redis-cli", "-p", str(port), "del", "key:__rand_int__"], check=True, capture_output=True
    )
    return {
        "gbps": float(get["rps"]) * block_bytes / 1e9,
        "p50_ms": float(get["p50_latency_ms"]),
        "p99_ms": float(get["p99_latency_ms"]),
    }


def _latency(values: list[float]) -> dict[str, float]:
    return {
        "p50_ms": benchlib.percentile(values, 50) * 1e3,
        "p99_ms": benchlib.percentile(values, 99) * 1e3,
    }


def bench_restore(
    workdir: Path,
    port: int,
    block_bytes: int,
    total_bytes: int,
    batch: int,
    args: argparse.Namespace,
) -> dict[str, Any]:
    import redis

    count = max(1, total_bytes // block_bytes)
    prefix = f"bench{block_bytes // KiB}k{batch}"
    daemon = DaemonProcess(
        workdir / prefix,
        dram_size=f"{(count * block_bytes + 64 * MiB) >> 20}M",
        nvme_size="0",  # pool -> DRAM only: no disk on either side of the comparison
        config_text=pool_config(port, prefix),
    )
    try:
        restart_wiped(daemon)
        block = np.random.default_rng(7).integers(0, 256, block_bytes, dtype=np.uint8)
        with connect(daemon.socket) as client:
            ns = client.namespace("bench", block_bytes=block_bytes)
            keys = chain_keys(range(count), 1, ns.key_salt)
            step = max(1, min(64, (64 * MiB) // block_bytes))
            started = time.perf_counter()
            for i in range(0, count, step):
                ns.put(keys[i : i + step], [block] * len(keys[i : i + step]))
            store_s = time.perf_counter() - started
            written = client.pool_status()["written"]
        if written != count:
            raise RuntimeError(f"only {written} of {count} blocks reached the pool")
        with redis.Redis(port=port) as raw:
            locations = sorted(raw.scan_iter(match=f"{prefix}:b:*".encode(), count=1000))
            value_bytes = raw.strlen(locations[0])
        if len(locations) != count:
            raise RuntimeError(f"{len(locations)} values in the pool for {count} blocks")
        log(
            f"{size_name(block_bytes)}, {batch} key(s) per READ: {count} blocks written through "
            f"in {store_s:.1f} s; {args.rounds} rounds"
        )
        rounds: list[dict[str, Any]] = []
        for n in range(args.rounds):
            row: dict[str, Any] = {"order": "restore, get" if n % 2 == 0 else "get, restore"}
            for side in ("restore", "get") if n % 2 == 0 else ("get", "restore"):
                if side == "restore":
                    row["restart_s"] = restart_wiped(daemon)
                    with connect(daemon.socket) as client:
                        status = client.pool_status()
                    if status["state"] != "attached" or status["restored"] != count:
                        raise RuntimeError(f"the restarted daemon did not restore: {status}")
                    gbps, lat = anyio.run(
                        daemon_read, daemon.socket, block_bytes, keys, args.concurrency, batch
                    )
                    with connect(daemon.socket) as client:
                        hits = client.pool_status()["pool_hits"]
                    row["restore"] = {"gbps": gbps, **_latency(lat), "pool_hits": hits}
                else:
                    gbps, lat = anyio.run(_raw_get, port, locations, block_bytes, args.concurrency)
                    row["get"] = {"gbps": gbps, **_latency(lat)}
            if shutil.which("redis-benchmark") is not None:
                requests = max(count, 200)
                row["redis_benchmark"] = redis_benchmark(
                    port, block_bytes, requests, args.concurrency
                )
            row["ratio"] = row["restore"]["gbps"] / row["get"]["gbps"]
            rounds.append(row)
            log(
                f"  round {n + 1}: restore {row['restore']['gbps']:.2f} GB/s, "
                f"get {row['get']['gbps']:.2f} GB/s, ratio {row['ratio']:.2f}"
                + (
                    f", redis-benchmark {row['redis_benchmark']['gbps']:.2f} GB/s"
                    if "redis_benchmark" in row
                    else ""
                )
            )
    finally:
        if daemon.running:
            daemon.stop()
    with redis.Redis(port=port) as raw:  # values, manifest, consensus: leave nothing behind
        leftovers = list(raw.scan_iter(match=f"{prefix}:*".encode(), count=1000))
        for i in range(0, len(leftovers), 256):
            raw.delete(*leftovers[i : i + 256])
    return {
        "block_bytes": block_bytes,
        "batch": batch,
        "value_bytes": value_bytes,
        "blocks": count,
        "total_bytes": count * block_bytes,
        "store_write_through_gbps": count * block_bytes / store_s / 1e9,
        "rounds": rounds,
        "median": _medians(rounds),
    }


def _medians(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    med = benchlib.median
    out: dict[str, Any] = {
        "ratio": med([r["ratio"] for r in rounds]),
        "restart_s": med([r["restart_s"] for r in rounds]),
    }
    for side in ("restore", "get", "redis_benchmark"):
        if all(side in r for r in rounds):
            out[side] = {k: med([r[side][k] for r in rounds]) for k in ("gbps", "p50_ms", "p99_ms")}
    if "redis_benchmark" in out:
        out["ratio_vs_redis_benchmark"] = med(
            [r["restore"]["gbps"] / r["redis_benchmark"]["gbps"] for r in rounds]
        )
    return out


# -- report ------------------------------------------------------------------------------------


def plot(result: dict[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = 2 if result.get("ttft") else 1
    fig, axes = plt.subplots(1, panels, figsize=(5.5 * panels, 4.2), squeeze=False)
    ax = axes[0][0]
    sizes = [size_name(r["block_bytes"]) for r in result["restore"]]
    series = [
        ("restore", "kvtierd restore (READ)", "tab:blue"),
        ("get", "redis-py asyncio GET", "tab:orange"),
        ("redis_benchmark", "redis-benchmark GET", "tab:gray"),
    ]
    width = 0.8 / len(series)
    for n, (key, label, colour) in enumerate(series):
        values = [r["median"].get(key, {}).get("gbps", float("nan")) for r in result["restore"]]
        xs = [i + (n - 1) * width for i in range(len(sizes))]
        bars = ax.bar(xs, values, width, label=label, color=colour)
        ax.bar_label(bars, fmt="%.2f", fontsize=8)
    ax.set_xticks(range(len(sizes)), [f"{s} values" for s in sizes])
    ax.set_ylabel("GB/s (median of rounds)")
    ax.set_title(f"Restore from the pool vs raw GETs (qd {result['concurrency']})")
    ax.legend(fontsize=8)
    if panels == 2:
        ax = axes[0][1]
        ttft = result["ttft"]["ttft_s"]
        labels = [k for k in ("recompute", "pool", "nvme_cold", "dram") if k in ttft]
        names = {
            "recompute": "recompute",
            "pool": "pool, after\nrestart + wipe",
            "nvme_cold": "cold NVMe",
            "dram": "DRAM",
        }
        colours = {"recompute": "tab:red", "pool": "tab:purple", "nvme_cold": "tab:blue"}
        bars = ax.bar(
            [names[k] for k in labels],
            [ttft[k] for k in labels],
            color=[colours.get(k, "tab:green") for k in labels],
        )
        ax.bar_label(bars, fmt="%.2f s", fontsize=8)
        ax.set_yscale("log")
        ax.set_ylabel("time to first token (s, median)")
        ax.set_title(f"SmolLM2-135M, {result['ttft']['prompt_tokens']}-token prompt")
    benchlib.save_figure(fig, "pool.png")


def markdown(result: dict[str, Any]) -> str:
    c = result["concurrency"]
    lines = [
        "## Shared pool: restore vs raw GETs, and 8K restore vs recompute",
        "",
        f"`python -m tools.bench_pool --json`: one `redis-server` {result['redis_version']} on "
        'loopback, persistence off (`save ""`, `appendonly no`), real daemons (write-through, '
        "`allow_plaintext`), all on the same 2 shared cores.",
        "",
        f"**Restore vs raw GETs.** A daemon stores the blocks through to the pool; each round it "
        f"is stopped, its data directory wiped and it is restarted (it indexes its manifest from "
        f"the pool), then a client leases every block, {c} blocks in flight (DRAM only, no NVMe "
        f"tier): READs of 1 key ({c} READs in flight), or of {c} keys (one READ in flight, as an "
        f"engine restoring a prefix). Reference, alternating with it (A B, B A): GETs of the same "
        f"pool keys (same values, header included) by redis-py's asyncio client with hiredis, "
        f"{c} in flight; and `redis-benchmark -t set,get -d <size> -c {c}` (C client, one value "
        f"re-read). Latency: per block (the READ that leased it; the GET). Medians of "
        f"{result['rounds']} rounds.",
        "",
        "| value size | keys per READ | blocks | restore GB/s | raw GET GB/s | "
        "redis-benchmark GB/s | ratio per round | **restore / GET** | "
        "restore p50 / p99 ms | GET p50 / p99 ms | restart s |",
        "|---|---:|---:|---:|---:|---:|---|---:|---|---|---:|",
    ]
    for r in result["restore"]:
        m = r["median"]
        rb = f"{m['redis_benchmark']['gbps']:.2f}" if "redis_benchmark" in m else "-"
        per_round = ", ".join(f"{x['ratio']:.2f}" for x in r["rounds"])
        lines.append(
            f"| {size_name(r['block_bytes'])} | {r['batch']} | {r['blocks']:,} | "
            f"{m['restore']['gbps']:.2f} | {m['get']['gbps']:.2f} | {rb} | {per_round} | "
            f"**{m['ratio']:.2f}** | "
            f"{m['restore']['p50_ms']:.2f} / {m['restore']['p99_ms']:.2f} | "
            f"{m['get']['p50_ms']:.2f} / {m['get']['p99_ms']:.2f} | {m['restart_s']:.2f} |"
        )
    lines += ["", f"Goal: restore >= {GOAL_RATIO} of raw GETs."]
    ttft = result.get("ttft")
    if ttft:
        lines += ["", *_ttft_markdown(ttft)]
    load = result.get("load_average")
    if load:
        lines += [
            "",
            f"One-minute load average {load['start'][0]:.1f} at the start and "
            f"{load['end'][0]:.1f} at the end, on 2 cores: other jobs shared the machine, so "
            "absolute figures (recompute and forward times included) are far below this "
            "machine's quiet ones (`ttft` section); compare within the run.",
        ]
    lines += [
        "",
        "![pool restore](benchmarks/pool.png)",
        "",
        benchlib.machine_line(result["machine"]),
    ]
    return "\n".join(lines)


def _ttft_markdown(ttft: dict[str, Any]) -> list[str]:
    from tools.ttft.report import pool_markdown_lines

    return pool_markdown_lines(ttft)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument(
        "--sizes", default="2M,64K", help="block (value) sizes, comma-separated (default 2M,64K)"
    )
    parser.add_argument("--total", default="320M", help="bytes of blocks per size (default 320M)")
    parser.add_argument("--blocks", type=int, help="blocks per size (overrides --total)")
    parser.add_argument("--concurrency", type=int, default=16, help="blocks in flight")
    parser.add_argument(
        "--batches",
        default="1,16",
        help="keys per READ, comma-separated: one row per value size and batch (default 1,16)",
    )
    parser.add_argument("--rounds", type=int, default=4, help="alternating rounds per size")
    parser.add_argument("--skip-restore", action="store_true")
    parser.add_argument("--skip-ttft", action="store_true")
    parser.add_argument("--no-record", action="store_true", help="leave docs/ untouched")
    parser.add_argument(
        "--report", type=Path, help="record the JSON of an earlier run (plot, section) and exit"
    )
    from tools.ttft.hf import add_model_arguments
    from tools.ttft.pool import run_for_bench_pool

    ttft = parser.add_argument_group("8K restore vs recompute (tools/ttft/pool.py)")
    ttft.add_argument("--tokens", type=int, default=8192, help="prompt tokens (default 8192)")
    ttft.add_argument("--data", type=Path, default=DEFAULT_DATA, help="LooGLE-format JSONL")
    ttft.add_argument("--ttft-runs", type=int, default=5, help="pool, DRAM and NVMe runs")
    add_model_arguments(ttft)
    args = parser.parse_args()
    if args.report:
        result = json.loads(args.report.read_text())
        plot(result)
        benchlib.record("pool", markdown(result), result)
        return 0
    batches = [int(b) for b in args.batches.split(",")]
    if any(args.concurrency % b for b in batches):
        parser.error("--concurrency must be a multiple of every --batches value")
    load_start = os.getloadavg()
    result: dict[str, Any] = {
        "benchmark": "pool",
        "concurrency": args.concurrency,
        "batches": batches,
        "rounds": args.rounds,
        "redis_version": _redis_version(),
        "persistence": False,
    }
    with benchlib.bench_workdir("pool-bench") as workdir, redis_server(workdir / "redis") as port:
        if not args.skip_restore:
            result["restore"] = [
                bench_restore(
                    workdir,
                    port,
                    size,
                    args.blocks * size if args.blocks else parse_size(args.total),
                    batch,
                    args,
                )
                for size in map(parse_size, args.sizes.split(","))
                for batch in batches
            ]
        if not args.skip_ttft:
            result["ttft"] = run_for_bench_pool(workdir, port, args)
    result["load_average"] = {"start": load_start, "end": os.getloadavg()}
    result["machine"] = benchlib.machine()
    complete = not (args.skip_restore or args.skip_ttft or args.blocks)
    if complete and not args.no_record and result["ttft"]:
        plot(result)
        benchlib.record("pool", markdown(result), result)
    benchlib.emit(result, args.json)
    return 0


def _redis_version() -> str:
    out = subprocess.run(["redis-server", "--version"], capture_output=True, text=True).stdout
    for part in out.split():
        if part.startswith("v="):
            return part[2:]
    return "unknown"


if __name__ == "__main__":
    sys.exit(main())
