"""The 8K half of ``tools/bench_pool.py``: time to first token of a SmolLM2-135M prompt whose
blocks a rank restores from the pool after its daemon restarted on a wiped data directory,
against recomputing the prompt, in the same run.

It reuses ``tools/ttft.py``'s :class:`LengthRun` (recompute, adapter prefill, page-cache drop)
and ``tools/fidelity.py``'s model and prompt helpers; only the daemon (with a pool) and the
restart between runs are its own. Order: one recomputation (its cache is stored, written through
to the pool and made durable), DRAM and cold-NVMe TTFT on that daemon (context), then per run:
the daemon is stopped, its data directory wiped, it is started again (it attaches and indexes its
manifest from the pool) and a new client's adapter prefills the prompt, restoring every cached
block from the pool; the remaining recomputations are interleaved with those runs.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from kvtierd.client import connect
from kvtierd.testing import DaemonProcess
from tools.benchlib import median
from tools.fidelity import DEFAULT_DATA, MODEL_ID, check_inputs, open_model, prompt_for
from tools.poolrig import pool_config, restart_wiped
from tools.ttft import LengthRun

CASES = ("recompute", "pool", "nvme_cold", "dram")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("8K restore vs recompute")
    group.add_argument("--tokens", type=int, default=8192, help="prompt tokens (default 8192)")
    group.add_argument("--data", type=Path, default=DEFAULT_DATA, help="LooGLE-format JSONL")
    group.add_argument("--dtype", default="bfloat16")
    group.add_argument("--block-tokens", type=int, default=64)
    group.add_argument("--threads", type=int, default=None, help="torch threads")
    group.add_argument("--ttft-runs", type=int, default=5, help="pool, DRAM and NVMe runs")
    group.add_argument("--recompute-runs", type=int, default=3)


def bench_ttft(
    workdir: Path, port: int, args: argparse.Namespace, log: Callable[[str], None]
) -> dict[str, Any]:
    reason = check_inputs(args.data)
    if reason is not None:
        log(f"8K restore: cannot run: {reason}")
        return {"skipped": reason}
    log(f"loading SmolLM2-135M ({args.dtype}) ...")
    loaded = open_model(args.dtype, args.threads)
    title, prompt = prompt_for(loaded, args.data, min(args.tokens, loaded.max_positions))
    settings = SimpleNamespace(
        block_tokens=args.block_tokens, runs=args.ttft_runs, recompute_runs=1
    )
    daemon = DaemonProcess(
        workdir / "ttft", dram_size="1G", nvme_size="1G", config_text=pool_config(port, "ttft")
    )
    restarts: list[float] = []
    try:
        restart_wiped(daemon)
        with connect(daemon.socket) as client:
            run = LengthRun(loaded, client, prompt, settings)
            log(f"{len(prompt)} tokens ({title}): recompute, store ...")
            full = run.recompute()
            run.adapter.store(prompt, full)
            client.fsync()
            written = client.pool_status()["written"]
            cached = run.adapter.prefill(prompt, store=False).cached_tokens  # also warms
            blocks = -(-cached // run.adapter.block_tokens)
            if written < blocks:
                raise RuntimeError(f"only {written} of {blocks} blocks reached the pool")
            log("  dram / nvme_cold ...")
            for _ in range(args.ttft_runs):
                run.restore("dram", cold=False)
                run.restore("nvme_cold", cold=True)
        log("  restart on a wiped data dir, restore from the pool ...")
        for n in range(args.ttft_runs):
            if 0 < n < args.recompute_runs:
                run.recompute()
            restarts.append(restart_wiped(daemon))
            with connect(daemon.socket) as client:
                fresh = LengthRun(loaded, client, prompt, settings)
                fresh.times, fresh.parts, fresh.tiers = run.times, run.parts, run.tiers
                restored = fresh.restore("pool", cold=False)
                if restored != cached or run.tiers["pool"] != {"pool": blocks}:
                    raise RuntimeError(f"restored {restored} tokens from {run.tiers['pool']}")
        for _ in range(len(run.times["recompute"]), args.recompute_runs):
            run.recompute()
    finally:
        if daemon.running:
            daemon.stop()
    ttft = {case: median(run.times[case]) for case in CASES}
    return {
        "model": MODEL_ID,
        "dtype": args.dtype,
        "document": title,
        "prompt_tokens": len(prompt),
        "cached_tokens": cached,
        "blocks": blocks,
        "restored_bytes": blocks * run.adapter.namespace.block_bytes,
        "ttft_s": ttft,
        "speedup_vs_recompute": {k: ttft["recompute"] / ttft[k] for k in CASES[1:]},
        "restart_s": median(restarts),
        "restarts_s": restarts,
        # LengthRun keeps every run's parts; the table shows their means
        "parts_mean_s": {
            case: {part: sum(values) / len(values) for part, values in parts.items() if values}
            for case, parts in run.parts.items()
        },
        "blocks_by_tier": run.tiers,
        "page_cache_dropped": run.dropped,
        "runs": dict(run.times),
    }


def markdown_lines(ttft: dict[str, Any]) -> list[str]:
    if "skipped" in ttft:
        return [f"**8K restore vs recompute**: not run ({ttft['skipped']})."]
    t, parts = ttft["ttft_s"], ttft["parts_mean_s"]
    runs = ttft["runs"]
    names = {
        "recompute": "recompute (prefill of every token)",
        "pool": "restored from the pool after restart + wipe",
        "nvme_cold": "restored from cold NVMe (context)",
        "dram": "restored from DRAM (context)",
    }
    lines = [
        f"**8K restore vs recompute.** SmolLM2-135M-Instruct ({ttft['dtype']}) through the HF "
        f"adapter, a {ttft['prompt_tokens']}-token LooGLE prompt, {ttft['blocks']} blocks "
        f"({ttft['restored_bytes'] / 2**20:.0f} MiB) stored through to the pool. Pool runs: the "
        "daemon is stopped, its data directory wiped, it is restarted, and a new client's "
        "prefill restores the prefix from the pool and forwards the last token; recomputations "
        "are interleaved with them (`tools/ttft.py`'s `LengthRun`). TTFT: from the prompt's "
        "token ids to the first token's logits; medians, seconds.",
        "",
        "| case | TTFT s | runs | recompute / case | lookup + read s | forward s |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for case in CASES:
        speedup = ttft["speedup_vs_recompute"].get(case)
        p = parts.get(case)
        io_s = f"{p['lookup_s'] + p['read_s']:.3f}" if p else "-"
        fwd = f"{p['forward_s']:.3f}" if p else "-"
        lines.append(
            f"| {names[case]} | {t[case]:.3f} | {len(runs[case])} | "
            f"{f'{speedup:.0f}x' if speedup else '-'} | {io_s} | {fwd} |"
        )
    lines += [
        "",
        f"Daemon restart on a wiped data directory until it serves (start, pool attach by "
        f"consensus, manifest indexed): {ttft['restart_s']:.2f} s (median of "
        f"{len(ttft['restarts_s'])}); restart + pool TTFT: "
        f"{ttft['restart_s'] + t['pool']:.2f} s against {t['recompute']:.1f} s of recomputation.",
    ]
    return lines
