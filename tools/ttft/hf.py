"""Time to first token on the real SmolLM2-135M through kvtierd's Hugging Face adapter
(``kvtierd.engines.hf``), against recomputation and against the limit the hardware sets, per
context length: the ``hf`` engine of :mod:`tools.ttft`.

For a prompt of N tokens (a real LooGLE document cut to fit, then its first question), the time
until the logits of the first generated token exist, in four cases (the "daemon" group):

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

The ``pool`` case (the "pool" group, :mod:`tools.ttft.pool`) restores from the shared pool after
the daemon restarted on a wiped data directory; this module starts the ``redis-server`` it needs.

Run: ``python -m tools.ttft --engine hf --json [--tokens N ...] [--cases ...] [--data FILE]``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvtierd.client import Client
from kvtierd.testing.smollm2 import LoadedModel, ModelDType
from tools.benchlib import bench_workdir, drop_page_cache, log, machine, median
from tools.fidelity import (
    DEFAULT_LENGTHS,
    MODEL_ID,
    bench_daemon,
    check_inputs,
    open_model,
    prompt_for,
)
from tools.references import fio_read_s, make_fio_file
from tools.ttft.cases import HF_CASES, Timings, alternate

__all__ = [
    "PARTIAL_SHARE",
    "HfSettings",
    "LengthRun",
    "add_arguments",
    "add_model_arguments",
    "run",
    "unavailable",
]

PARTIAL_SHARE = 0.9
DEFAULT_REPEATS = 5


def add_arguments(group: argparse._ArgumentGroup) -> None:
    """The options of the ``hf`` engine."""
    add_model_arguments(group)
    group.add_argument("--partial-runs", type=int, default=3, help="runs of the partial case")


def add_model_arguments(group: argparse._ArgumentGroup) -> None:
    """The model's and the adapter's options (``tools/bench_pool.py`` takes them too)."""
    group.add_argument("--dtype", default="bfloat16", choices=[d.value for d in ModelDType])
    group.add_argument("--block-tokens", type=int, default=64)
    group.add_argument("--threads", type=int, default=None, help="torch threads")
    group.add_argument("--recompute-runs", type=int, default=3)
    group.add_argument(
        "--stock-attention",
        action="store_true",
        help="keep transformers' sdpa for one-token steps (default: the adapter's packed "
        "decode attention, opted into here as an engine would use its fastest decode kernel)",
    )


@dataclass(frozen=True)
class HfSettings:
    """How many runs of what: ``repeats`` of the DRAM, NVMe and pool cases."""

    block_tokens: int
    repeats: int
    partial_runs: int
    recompute_runs: int
    stock_attention: bool = False

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> HfSettings:
        return cls(
            block_tokens=args.block_tokens,
            repeats=args.repeats,
            partial_runs=args.partial_runs,
            recompute_runs=args.recompute_runs,
            stock_attention=args.stock_attention,
        )


class LengthRun:
    """The measurements of one context length: every run's seconds (``timings``), the restores'
    parts, tiers and restored tokens, by case."""

    def __init__(
        self, loaded: LoadedModel, client: Client, prompt: list[int], settings: HfSettings
    ) -> None:
        self.loaded = loaded
        self.prompt = prompt
        self.settings = settings
        self.timings = Timings()
        self.parts: dict[str, dict[str, list[float]]] = {}
        self.tiers: dict[str, dict[str, int]] = {}
        self.cached: dict[str, int] = {}
        self.dropped = True
        self.resident_slab: Any = None
        self.attach(client)
        self.keys = self.adapter.keys(prompt)

    def attach(self, client: Client) -> None:
        """Open the adapter on ``client`` (a restarted daemon's, say), keeping what was measured.
        The engine's KV memory is prepared here, as an engine does at start-up; every timed
        prefill hands its cache back (recycle) so the next one finds it pre-faulted too."""
        from kvtierd.engines.hf import HfKvAdapter

        self.client = client
        self.adapter = HfKvAdapter.open(
            client,
            self.loaded.model,
            model_id=MODEL_ID,
            block_tokens=self.settings.block_tokens,
            packed_decode_attention=not self.settings.stock_attention,
        )
        self.adapter.reserve(len(self.prompt))

    def recompute(self, runs: int) -> Any:
        """Prefill everything with no cache ``runs`` times; returns the full cache of the last."""
        import torch
        from transformers import DynamicCache

        model, ids = self.loaded.model, torch.tensor([self.prompt])
        cache = None
        for _ in range(runs):
            cache = DynamicCache(config=model.config)
            started = time.perf_counter()
            with torch.no_grad():
                model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
            self.timings.add("recompute", time.perf_counter() - started)
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

    def restore(self, name: str, *, cold: bool) -> float:
        """One adapter prefill (nothing stored); its seconds. ``cold``: the page cache dropped
        and the DRAM tier emptied first."""
        from transformers import DynamicCache

        if cold:
            self.dropped = drop_page_cache() and self.dropped
            # Dropping the page cache also drops the code pages of Python and torch; fault them
            # back in so the run measures the blocks' way from disk, not the interpreter's.
            self.adapter.forward(self.prompt[:1], DynamicCache(config=self.loaded.model.config))
            self.client.evict()
        started = time.perf_counter()
        result = self.adapter.prefill(self.prompt, store=False)
        seconds = time.perf_counter() - started
        self.adapter.recycle(result.cache)
        self.tiers[name] = result.blocks_by_tier
        self.cached[name] = result.cached_tokens
        for part in ("lookup_s", "read_s", "forward_s"):
            self.parts.setdefault(name, {}).setdefault(part, []).append(getattr(result, part))
        return seconds

    def store(self, full: Any) -> int:
        """Store the prompt's blocks from ``full``, make them durable and restore once (which
        also warms); the tokens a restore finds."""
        self.adapter.store(self.prompt, full)
        self.client.fsync()
        warm = self.adapter.prefill(self.prompt, store=False)
        self.adapter.recycle(warm.cache)
        return warm.cached_tokens

    def run(self, fio_file: Path) -> dict[str, Any]:
        """Every case of the "daemon" group, each alternated with its reference."""
        s, ns, bt = self.settings, self.adapter.namespace, self.adapter.block_tokens
        ns.forget(self.keys)
        log("  recompute ...")
        full = self.recompute(s.recompute_runs)
        cached = self.store(full)
        blocks = -(-cached // bt)
        make_fio_file(fio_file, blocks * ns.block_bytes)
        log("  dram / nvme_cold ...")
        alternate(
            self.timings,
            s.repeats,
            {
                "forward_full": lambda: self.forward_only(full, cached),
                "forward_full_stock_attention": lambda: self.forward_only(full, cached, stock=True),
                "dram": lambda: self.restore("dram", cold=False),
                "nvme_cold": lambda: self.restore("nvme_cold", cold=True),
                "fio_full": lambda: fio_read_s(fio_file, blocks * ns.block_bytes, ns.block_bytes),
            },
        )
        kept = int(len(self.prompt) * PARTIAL_SHARE) // bt
        ns.forget(self.keys[kept:])
        log("  partial ...")
        alternate(
            self.timings,
            s.partial_runs,
            {
                "forward_partial": lambda: self.forward_only(full, kept * bt),
                "partial": lambda: self.restore("partial", cold=True),
                "fio_partial": lambda: fio_read_s(fio_file, kept * ns.block_bytes, ns.block_bytes),
            },
        )
        ns.forget(self.keys)
        return self.summary(cached, blocks * ns.block_bytes)

    def parts_mean_s(self) -> dict[str, dict[str, float]]:
        return {
            name: {part: sum(v) / len(v) for part, v in parts.items() if v}
            for name, parts in self.parts.items()
        }

    def summary(self, cached: int, nbytes: int) -> dict[str, Any]:
        runs = self.timings
        m = runs.medians()
        ttft = {key: m[key] for key in HF_CASES}
        limit = {
            "recompute": m["recompute"],
            "dram": m["forward_full"],
            "nvme_cold": m["fio_full"] + m["forward_full"],
            "partial": m["fio_partial"] + m["forward_partial"],
        }
        pairs = [
            t / (f + m["forward_full"])
            for t, f in zip(runs["nvme_cold"], runs["fio_full"], strict=True)
        ]
        return {
            "prompt_tokens": len(self.prompt),
            "cached_tokens": {
                "dram": cached,
                "nvme_cold": cached,
                "partial": self.cached["partial"],
            },
            "restored_bytes": nbytes,
            "ttft_s": ttft,
            "limit_s": limit,
            "speedup_vs_recompute": {k: m["recompute"] / ttft[k] for k in HF_CASES[1:]},
            "ratio_to_limit": {k: ttft[k] / limit[k] for k in HF_CASES},
            "nvme_cold_ratio_to_limit_pairwise_median": median(pairs),
            "fio_read_s": {"full": m["fio_full"], "partial": m["fio_partial"]},
            "forward_only_s": {
                "full": m["forward_full"],
                "partial": m["forward_partial"],
                "full_stock_attention": m["forward_full_stock_attention"],
            },
            "parts_mean_s": self.parts_mean_s(),
            "blocks_by_tier": self.tiers,
            "page_cache_dropped": self.dropped,
            "runs": dict(runs.runs),
        }


def unavailable(args: argparse.Namespace, groups: tuple[str, ...]) -> str | None:
    """Why the groups asked for cannot run here (no model, no data, no redis-server), or
    ``None``."""
    reason = check_inputs(args.data)
    if reason is None and "pool" in groups and shutil.which("redis-server") is None:
        reason = "the pool case needs redis-server (apt-get install redis-server)"
    return reason


def run(
    args: argparse.Namespace, cases: tuple[str, ...], groups: tuple[str, ...]
) -> dict[str, Any]:
    """Measure ``groups`` at every length of ``args.tokens``; the result as JSON."""
    settings = HfSettings.from_args(args)
    lengths = args.tokens or list(DEFAULT_LENGTHS)
    log(f"loading SmolLM2-135M ({args.dtype}) ...")
    load_start = os.getloadavg()
    loaded = open_model(args.dtype, args.threads)
    import torch

    results: dict[str, dict[str, Any]] = {}
    if "daemon" in groups:
        with bench_daemon() as (daemon, client):
            for tokens in lengths:
                title, prompt = prompt_for(loaded, args.data, min(tokens, loaded.max_positions))
                log(f"{tokens} tokens ({title}):")
                started = time.perf_counter()
                row = LengthRun(loaded, client, prompt, settings).run(daemon.directory / "fio.ref")
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
        "cases": list(cases),
        "model": MODEL_ID,
        "dtype": args.dtype,
        "block_tokens": args.block_tokens,
        "torch_threads": torch.get_num_threads(),
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
        "attn_implementation": loaded.model.config._attn_implementation,
        "results": results,
    }
    if "pool" in groups:
        result["pool"] = _measure_pool(loaded, args, settings, lengths)
    result["load_average"] = {"start": load_start, "end": os.getloadavg()}
    result["machine"] = machine()
    return result


def _measure_pool(
    loaded: LoadedModel, args: argparse.Namespace, settings: HfSettings, lengths: list[int]
) -> dict[str, dict[str, Any]]:
    """The pool case at every length, beside a ``redis-server`` of its own."""
    from tools.poolrig import redis_server
    from tools.ttft.pool import measure_pool

    rows: dict[str, dict[str, Any]] = {}
    with bench_workdir("ttft-pool") as workdir, redis_server(workdir / "redis") as port:
        for tokens in lengths:
            rows[str(tokens)] = measure_pool(
                loaded, workdir, port, args.data, tokens, settings, dtype=args.dtype
            )
    return rows
