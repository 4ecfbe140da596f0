"""The ``pool`` case of the ``hf`` engine: time to first token of a SmolLM2-135M prompt whose
blocks a rank restores from the shared pool after its daemon restarted on a wiped data
directory, against recomputing the prompt, in the same run. ``tools/bench_pool.py`` runs it at
8K for its "pool" section (:func:`run_for_bench_pool`); ``python -m tools.ttft --engine hf
--cases pool`` at any length.

It reuses :class:`tools.ttft.hf.LengthRun` (recompute, adapter prefill, page-cache drop) and
``tools/fidelity.py``'s model and prompt helpers; only the daemon (with a pool) and the restart
between runs are its own. Order: one recomputation (its cache is stored, written through to the
pool and made durable), DRAM and cold-NVMe TTFT on that daemon (context), then per run: the
daemon is stopped, its data directory wiped, it is started again (it attaches and indexes its
manifest from the pool) and a new client's adapter prefills the prompt, restoring every cached
block from the pool; the remaining recomputations are interleaved with those runs.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from kvtierd.client import connect
from kvtierd.testing import DaemonProcess
from kvtierd.testing.smollm2 import LoadedModel
from tools.benchlib import log, median
from tools.fidelity import MODEL_ID, check_inputs, open_model, prompt_for
from tools.poolrig import pool_config, restart_wiped
from tools.ttft.cases import POOL_CASES, alternate
from tools.ttft.hf import HfSettings, LengthRun

__all__ = ["measure_pool", "run_for_bench_pool"]


def measure_pool(
    loaded: LoadedModel,
    workdir: Path,
    port: int,
    data: Path,
    tokens: int,
    settings: HfSettings,
    *,
    dtype: str,
) -> dict[str, Any]:
    """The pool case at ``tokens`` (``settings.repeats`` pool, DRAM and NVMe runs), on a daemon
    under ``workdir`` attached to the ``redis-server`` on ``port``; its record as JSON.

    Raises:
        RuntimeError: the blocks did not all reach the pool, or a restart did not restore them.
    """
    title, prompt = prompt_for(loaded, data, min(tokens, loaded.max_positions))
    name = f"ttft{tokens}"
    config = pool_config(port, name, key_secret_file=workdir / f"{name}.secret")
    daemon = DaemonProcess(workdir / name, dram_size="1G", nvme_size="1G", config_text=config)
    restarts: list[float] = []
    try:
        restart_wiped(daemon)
        with connect(daemon.socket) as client:
            run = LengthRun(loaded, client, prompt, settings)
            log(f"{len(prompt)} tokens ({title}): recompute, store ...")
            cached = run.store(run.recompute(1))
            written = client.pool_status()["written"]
            blocks = -(-cached // run.adapter.block_tokens)
            if written < blocks:
                raise RuntimeError(f"only {written} of {blocks} blocks reached the pool")
            log("  dram / nvme_cold ...")
            alternate(
                run.timings,
                settings.repeats,
                {
                    "dram": lambda: run.restore("dram", cold=False),
                    "nvme_cold": lambda: run.restore("nvme_cold", cold=True),
                },
            )
        log("  restart on a wiped data dir, restore from the pool ...")
        for n in range(settings.repeats):
            if 0 < n < settings.recompute_runs:
                run.recompute(1)
            restarts.append(restart_wiped(daemon))
            with connect(daemon.socket) as client:
                run.attach(client)
                run.timings.add("pool", run.restore("pool", cold=False))
                if run.cached["pool"] != cached or run.tiers["pool"] != {"pool": blocks}:
                    raise RuntimeError(
                        f"restored {run.cached['pool']} tokens from {run.tiers['pool']}"
                    )
        run.recompute(max(0, settings.recompute_runs - len(run.timings["recompute"])))
    finally:
        if daemon.running:
            daemon.stop()
    ttft = {case: median(run.timings[case]) for case in POOL_CASES}
    return {
        "model": MODEL_ID,
        "dtype": dtype,
        "document": title,
        "prompt_tokens": len(prompt),
        "cached_tokens": cached,
        "blocks": blocks,
        "restored_bytes": blocks * run.adapter.namespace.block_bytes,
        "ttft_s": ttft,
        "speedup_vs_recompute": {k: ttft["recompute"] / ttft[k] for k in POOL_CASES[1:]},
        "restart_s": median(restarts),
        "restarts_s": restarts,
        "parts_mean_s": run.parts_mean_s(),
        "blocks_by_tier": run.tiers,
        "page_cache_dropped": run.dropped,
        "runs": dict(run.timings.runs),
    }


def run_for_bench_pool(workdir: Path, port: int, args: argparse.Namespace) -> dict[str, Any]:
    """``tools/bench_pool.py``'s 8K half: the pool case at ``args.tokens`` with
    ``args.ttft_runs`` runs, or ``{"skipped": why}`` where the model or the data is missing."""
    reason = check_inputs(args.data)
    if reason is not None:
        log(f"8K restore: cannot run: {reason}")
        return {"skipped": reason}
    log(f"loading SmolLM2-135M ({args.dtype}) ...")
    loaded = open_model(args.dtype, args.threads)
    settings = HfSettings(
        block_tokens=args.block_tokens,
        repeats=args.ttft_runs,
        partial_runs=0,
        recompute_runs=args.recompute_runs,
        stock_attention=args.stock_attention,
    )
    return measure_pool(loaded, workdir, port, args.data, args.tokens, settings, dtype=args.dtype)
