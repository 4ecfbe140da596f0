"""Time to first token on the real SmolLM2-135M through kvtierd, against recomputation and
against the limit the hardware sets, per context length.

For a prompt of N tokens (a real LooGLE document cut to fit, then its first question), the time
until the logits of the first generated token exist, in four cases:

* ``recompute``: the model prefills all N tokens (no kvtierd);
* ``dram``: every block is in the DRAM tier; the adapter looks up, leases and restores N - 1
  tokens, and forwards the last one;
* ``nvme_cold``: the same with the DRAM tier emptied (``Client.evict``) and the page cache
  dropped (then one tiny forward, so that the interpreter's and torch's code pages, dropped
  too, are not counted): the blocks come from the NVMe tier through O_DIRECT reads;
* ``partial``: 90 % of the prompt's blocks are stored, cold on NVMe; the rest is forwarded.

Beside each, ``limit_s``: what no cache can beat on this machine, measured in the same run: the
forward over the uncached tokens (on a prefix kept in memory, in the same pre-faulted in-place
cache the adapter restores into, so neither side allocates or concatenates) plus, for the NVMe
cases, fio reading the same number of bytes with io_uring, O_DIRECT, the same block size and queue
depth 32 (the daemon's promotion concurrency); for ``recompute`` the recomputation itself.
Measured and reference runs alternate (A B A B) because the virtual disk and the shared CPUs
drift; figures are medians.

A run of the default lengths (1K, 2K, 4K, 8K) rewrites the "ttft" section of
``docs/benchmarks.md`` and its plot; ``--tokens`` runs one length and records nothing.

Run: ``python -m tools.ttft --json [--tokens N] [--data FILE]``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

# Before torch is loaded (it reads this once): OpenMP worker threads sleep instead of spinning
# between parallel regions. On a shared 2-vCPU machine a spinning worker that another process
# has preempted stalls every small operator: a one-token forward ran 3-5x slower, a prefill 2x.
# It applies to every case alike (recomputation included); the JSON records it.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


from kvtierd.client import Client
from kvtierd.testing.smollm2 import LoadedModel
from tools.benchlib import emit, log, machine, machine_line, median, record, save_figure
from tools.fidelity import (
    MODEL_ID,
    bench_daemon,
    check_inputs,
    common_arguments,
    lengths_for,
    open_model,
    prompt_for,
)
from tools.references import fio_json

PARTIAL_SHARE = 0.9
FIO_QUEUE_DEPTH = 32
KEYS = ("recompute", "dram", "nvme_cold", "partial")


def drop_page_cache() -> bool:
    """Drop clean page-cache pages (root only); whether it was done."""
    try:
        with open("/proc/sys/vm/drop_caches", "w") as handle:
            handle.write("1\n")
    except OSError:
        return False
    return True


def fio_read_s(path: Path, nbytes: int, block_bytes: int) -> float:
    """Seconds fio needs to read ``nbytes`` of ``path`` in ``block_bytes`` requests (O_DIRECT,
    io_uring, queue depth 32)."""
    bs = -(-block_bytes // 4096) * 4096
    size = -(-nbytes // bs) * bs
    report = fio_json(
        [
            f"--filename={path}",
            f"--size={size}",
            f"--bs={bs}",
            "--rw=read",
            f"--iodepth={FIO_QUEUE_DEPTH}",
        ]
    )
    runtime_ms: float = report["jobs"][0]["read"]["runtime"]
    return runtime_ms / 1000


def make_fio_file(path: Path, nbytes: int) -> None:
    fio_json([f"--filename={path}", f"--size={nbytes}", "--bs=1M", "--rw=write", "--iodepth=8"])


class LengthRun:
    """The measurements of one context length."""

    def __init__(self, loaded: LoadedModel, client: Client, prompt: list[int], args: Any) -> None:
        from kvtierd.engines.hf import HfKvAdapter

        self.loaded = loaded
        self.client = client
        self.prompt = prompt
        self.args = args
        self.adapter = HfKvAdapter.open(
            client,
            loaded.model,
            model_id=MODEL_ID,
            block_tokens=args.block_tokens,
            packed_decode_attention=not getattr(args, "stock_attention", False),
        )
        self.keys = self.adapter.keys(prompt)
        self.times: dict[str, list[float]] = {}
        self.parts: dict[str, dict[str, list[float]]] = {}
        self.tiers: dict[str, dict[str, int]] = {}
        self.dropped = True
        # The engine's KV memory is prepared once, as an engine does at start-up; every timed
        # prefill hands its cache back (recycle) so the next one finds it pre-faulted too.
        self.adapter.reserve(len(prompt))
        self.resident_slab: Any = None

    def add(self, name: str, seconds: float) -> None:
        self.times.setdefault(name, []).append(seconds)

    def recompute(self) -> Any:
        """Prefill everything with no cache; returns the full cache of the last run."""
        import torch
        from transformers import DynamicCache

        model, ids = self.loaded.model, torch.tensor([self.prompt])
        cache = None
        for _ in range(self.args.recompute_runs):
            cache = DynamicCache(config=model.config)
            started = time.perf_counter()
            with torch.no_grad():
                model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
            self.add("recompute", time.perf_counter() - started)
        return cache

    def forward_only(self, full: Any, cached: int, *, stock: bool = False) -> float:
        """The forward over the tokens after ``cached`` on a prefix kept in memory, in the same
        kind of cache a restore builds (the adapter's pre-faulted slab): only the restore's
        LOOKUP, READ and copy differ between the two. ``stock``: with transformers' own
        ``sdpa`` one-token attention instead of the adapter's packed one (for the record)."""
        from kvtierd.engines.hf_cache import KvSlab, resident_cache

        if self.resident_slab is None:
            a = self.adapter
            lay, capacity = a.layout, len(self.prompt) + a.headroom_tokens
            self.resident_slab = KvSlab(lay.layers, lay.kv_heads, lay.head_dim, capacity, a.dtype)
        model = self.loaded.model
        cache = resident_cache(model.config, full, cached, self.resident_slab)
        attention = model.config._attn_implementation
        if stock:
            model.set_attn_implementation("sdpa")
        try:
            started = time.perf_counter()
            self.adapter.forward(self.prompt[cached:], cache)
            return time.perf_counter() - started
        finally:
            model.set_attn_implementation(attention)

    def restore(self, name: str, *, cold: bool) -> int:
        """One adapter prefill (nothing stored); returns the tokens it restored."""
        from transformers import DynamicCache

        if cold:
            self.dropped = drop_page_cache() and self.dropped
            # Dropping the page cache also drops the code pages of Python and torch; fault them
            # back in so the run measures the blocks' way from disk, not the interpreter's.
            self.adapter.forward(self.prompt[:1], DynamicCache(config=self.loaded.model.config))
            self.client.evict()
        started = time.perf_counter()
        result = self.adapter.prefill(self.prompt, store=False)
        self.add(name, time.perf_counter() - started)
        self.adapter.recycle(result.cache)
        self.tiers[name] = result.blocks_by_tier
        for part in ("lookup_s", "read_s", "forward_s"):
            self.parts.setdefault(name, {}).setdefault(part, []).append(getattr(result, part))
        return result.cached_tokens

    def run(self, fio_file: Path) -> dict[str, Any]:
        args, ns, bt = self.args, self.adapter.namespace, self.adapter.block_tokens
        ns.forget(self.keys)
        log("  recompute ...")
        full = self.recompute()
        self.adapter.store(self.prompt, full)
        self.client.fsync()
        warm = self.adapter.prefill(self.prompt, store=False)  # also warms
        cached = warm.cached_tokens
        self.adapter.recycle(warm.cache)
        blocks = -(-cached // bt)
        make_fio_file(fio_file, blocks * ns.block_bytes)
        log("  dram / nvme_cold ...")
        for _ in range(args.runs):
            self.add("forward_full", self.forward_only(full, cached))
            self.add("forward_full_stock_attention", self.forward_only(full, cached, stock=True))
            self.restore("dram", cold=False)
            self.restore("nvme_cold", cold=True)
            self.add("fio_full", fio_read_s(fio_file, blocks * ns.block_bytes, ns.block_bytes))
        kept = int(len(self.prompt) * PARTIAL_SHARE) // bt
        ns.forget(self.keys[kept:])
        log("  partial ...")
        for _ in range(args.partial_runs):
            self.add("forward_partial", self.forward_only(full, kept * bt))
            partial_cached = self.restore("partial", cold=True)
            self.add("fio_partial", fio_read_s(fio_file, kept * ns.block_bytes, ns.block_bytes))
        ns.forget(self.keys)
        return self.summary(cached, partial_cached, blocks * ns.block_bytes)

    def summary(self, cached: int, partial_cached: int, nbytes: int) -> dict[str, Any]:
        m = {name: median(values) for name, values in self.times.items()}
        ttft = {key: m[key] for key in KEYS}
        limit = {
            "recompute": m["recompute"],
            "dram": m["forward_full"],
            "nvme_cold": m["fio_full"] + m["forward_full"],
            "partial": m["fio_partial"] + m["forward_partial"],
        }
        pairs = [
            t / (f + m["forward_full"])
            for t, f in zip(self.times["nvme_cold"], self.times["fio_full"], strict=True)
        ]
        return {
            "prompt_tokens": len(self.prompt),
            "cached_tokens": {"dram": cached, "nvme_cold": cached, "partial": partial_cached},
            "restored_bytes": nbytes,
            "ttft_s": ttft,
            "limit_s": limit,
            "speedup_vs_recompute": {k: m["recompute"] / ttft[k] for k in KEYS[1:]},
            "ratio_to_limit": {k: ttft[k] / limit[k] for k in KEYS},
            "nvme_cold_ratio_to_limit_pairwise_median": median(pairs),
            "fio_read_s": {"full": m["fio_full"], "partial": m["fio_partial"]},
            "forward_only_s": {
                "full": m["forward_full"],
                "partial": m["forward_partial"],
                "full_stock_attention": m["forward_full_stock_attention"],
            },
            "parts_mean_s": {
                name: {part: sum(v) / len(v) for part, v in parts.items()}
                for name, parts in self.parts.items()
            },
            "blocks_by_tier": self.tiers,
            "page_cache_dropped": self.dropped,
            "runs": dict(self.times),
        }


def plot(results: dict[str, dict[str, Any]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lengths = [int(k) for k in results]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    styles = {
        "recompute": ("recompute (prefill)", "tab:red"),
        "partial": ("90 % cached, cold NVMe", "tab:orange"),
        "nvme_cold": ("kvtierd, cold NVMe", "tab:blue"),
        "dram": ("kvtierd, DRAM", "tab:green"),
    }
    for key, (label, colour) in styles.items():
        ax.plot(
            lengths, [r["ttft_s"][key] for r in results.values()], "o-", color=colour, label=label
        )
        if key != "recompute":
            limits = [r["limit_s"][key] for r in results.values()]
            ax.plot(lengths, limits, "--", color=colour, alpha=0.5, label=f"limit ({label})")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(lengths, [f"{n // 1024}K" for n in lengths])
    ax.set_xlabel("context (tokens)")
    ax.set_ylabel("time to first token (s)")
    ax.set_title("TTFT vs context: SmolLM2-135M on 2 vCPUs")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    save_figure(fig, "ttft.png")


def markdown(result: dict[str, Any]) -> str:
    lines = [
        "## Time to first token on a real model (`tools/ttft.py`)",
        "",
        f"SmolLM2-135M-Instruct ({result['dtype']}, blocks of {result['block_tokens']} tokens) "
        "on a LooGLE document plus its first question. TTFT: from the prompt's token ids to the "
        "first generated token's logits. Limit: the forward over the uncached tokens on a prefix "
        "kept in memory in the same kind of cache the restore fills (a pre-faulted in-place KV "
        "slab, so the limit's forward copies nothing), plus fio reading the same bytes "
        "(io_uring, O_DIRECT, qd 32) for the NVMe cases, measured alternately in the same run. "
        f"Torch threads {result['torch_threads']}, OMP_WAIT_POLICY={result['omp_wait_policy']}, "
        f"attention `{result['attn_implementation']}` (one-token steps packed onto the KV heads; "
        "prompts and recomputation run transformers' `sdpa` unchanged). Medians; seconds.",
        "",
        "| context | recompute | DRAM | limit | ×limit | cold NVMe | limit | ×limit | speed-up "
        "| 90 % cached | limit | ×limit |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for n, row in result["results"].items():
        t, lim, r = row["ttft_s"], row["limit_s"], row["ratio_to_limit"]
        lines.append(
            f"| {n} | {t['recompute']:.2f} | {t['dram']:.3f} | {lim['dram']:.3f} | "
            f"{r['dram']:.2f} | {t['nvme_cold']:.3f} | {lim['nvme_cold']:.3f} | "
            f"{r['nvme_cold']:.2f} | {row['speedup_vs_recompute']['nvme_cold']:.0f}× | "
            f"{t['partial']:.2f} | {lim['partial']:.2f} | {r['partial']:.2f} |"
        )
    lines += [
        "",
        "![TTFT vs context](benchmarks/ttft.png)",
        "",
        "Speed-up: recompute / cold NVMe. ×limit: TTFT / limit (1.00 is the hardware's best). "
        "The DRAM limit is the forward alone: the restore's one copy out of the arena "
        "(~14 GB/s) is the whole difference.",
        "",
        machine_line(result["machine"]),
    ]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    common_arguments(parser)
    parser.add_argument("--runs", type=int, default=5, help="runs of the DRAM and NVMe cases")
    parser.add_argument("--partial-runs", type=int, default=3)
    parser.add_argument("--recompute-runs", type=int, default=3)
    parser.add_argument(
        "--stock-attention",
        action="store_true",
        help="keep transformers' sdpa for one-token steps (default: the adapter's packed "
        "decode attention, opted into here as an engine would use its fastest decode kernel)",
    )
    args = parser.parse_args()
    reason = check_inputs(args.data)
    if reason is not None:
        log(f"ttft: cannot run: {reason}")
        return 2
    log(f"loading SmolLM2-135M ({args.dtype}) ...")
    load_start = os.getloadavg()
    loaded = open_model(args.dtype, args.threads)
    import torch

    results: dict[str, dict[str, Any]] = {}
    with bench_daemon() as (daemon, client):
        for tokens in lengths_for(args):
            title, prompt = prompt_for(loaded, args.data, min(tokens, loaded.max_positions))
            log(f"{tokens} tokens ({title}):")
            started = time.perf_counter()
            row = LengthRun(loaded, client, prompt, args).run(daemon.directory / "fio.ref")
            row["document"] = title
            results[str(tokens)] = row
            t = row["ttft_s"]
            log(
                f"  recompute {t['recompute']:.2f} s, dram {t['dram']:.3f} s, nvme_cold "
                f"{t['nvme_cold']:.3f} s, partial {t['partial']:.2f} s "
                f"({time.perf_counter() - started:.0f} s)"
            )
    result: dict[str, Any] = {
        "benchmark": "ttft",
        "model": MODEL_ID,
        "dtype": args.dtype,
        "block_tokens": args.block_tokens,
        "torch_threads": torch.get_num_threads(),
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
        "attn_implementation": loaded.model.config._attn_implementation,
        "load_average": {"start": load_start, "end": os.getloadavg()},
        "results": results,
        "machine": machine(),
    }
    if not args.tokens and not args.no_record:
        plot(results)
        record("ttft", markdown(result), result)
    emit(result, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
