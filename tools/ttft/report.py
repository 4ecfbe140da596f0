"""The TTFT benchmark's records: the "ttft" section of ``docs/benchmarks.md`` (engine ``hf``),
the "vllm_ttft" section (engine ``vllm``), their plots, and the pool case's lines of the "pool"
section (``tools/bench_pool.py``), all from the JSON the benchmark prints: no engine, no daemon,
so ``--from-json`` re-renders a saved run.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from tools import benchlib
from tools.benchlib import machine_line, record, save_figure
from tools.ttft.cases import POOL_CASES, TV_GOAL

__all__ = ["markdown_hf", "markdown_vllm", "pool_markdown_lines", "write_docs"]


def write_docs(result: dict[str, Any], docs: Path | None = None) -> Path:
    """The section of ``result``'s engine, its plot and the raw JSON into ``docs`` (default
    ``docs/benchmarks.md``; another file gets its assets in a ``benchmarks/`` folder beside it);
    the file written.

    Raises:
        ValueError: ``result`` is not the TTFT benchmark's.
    """
    section = result.get("benchmark")
    if section not in ("ttft", "vllm_ttft"):
        raise ValueError(f"not a TTFT result: benchmark {section!r}")
    saved = benchlib.DOC, benchlib.ASSETS
    if docs is not None:
        benchlib.DOC = docs.resolve()
        benchlib.ASSETS = benchlib.DOC.parent / "benchmarks"
    try:
        if section == "ttft":
            plot_hf(result["results"])
            return record(section, markdown_hf(result), result)
        plot_vllm(result["results"], section)
        return record(section, markdown_vllm(result, section), result)
    finally:
        benchlib.DOC, benchlib.ASSETS = saved


# -- engine hf -----------------------------------------------------------------------------------


def plot_hf(results: dict[str, dict[str, Any]]) -> None:
    """TTFT against context for every case, each beside its limit (dashed)."""
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
    _ttft_axes(ax, lengths, "TTFT vs context: SmolLM2-135M on 2 vCPUs", legend_size=8)
    save_figure(fig, "ttft.png")


def markdown_hf(result: dict[str, Any]) -> str:
    """The "ttft" section."""
    lines = [
        "## Time to first token on a real model (`python -m tools.ttft --engine hf`)",
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


# -- engine vllm -----------------------------------------------------------------------------------

#: (JSON name, label, colour, line style) of every TTFT the section shows.
SERIES = (
    ("recompute", "recompute (vLLM prefill)", "tab:red", "o-"),
    ("vllm_prefix", "vLLM prefix cache hit", "black", "o-"),
    ("kvtierd_dram", "kvtierd, DRAM", "tab:green", "o-"),
    ("kvtierd_nvme_cold", "kvtierd, cold NVMe", "tab:blue", "o-"),
    ("kvtierd_whole_dram", "kvtierd whole_prompt, DRAM", "tab:olive", "v--"),
    ("kvtierd_whole_nvme_cold", "kvtierd whole_prompt, cold NVMe", "tab:olive", "v-"),
    ("vllm_fs_warm", "vLLM fs tier, warm", "tab:purple", "s--"),
    ("vllm_fs", "vLLM fs tier, cold", "tab:purple", "s-"),
    ("kvtierd_tier_warm", "kvtierd as vLLM tier, warm", "tab:cyan", "^--"),
    ("kvtierd_tier", "kvtierd as vLLM tier, cold", "tab:cyan", "^-"),
)
#: (ratio name, target as text, test) of the ratios the targets are stated in.
TARGETS: tuple[tuple[str, str, Callable[[float], bool]], ...] = (
    ("dram_vs_prefix", "<= 1.2", lambda r: r <= 1.2),
    ("nvme_cold_vs_prefix_fio", "<= 1.2", lambda r: r <= 1.2),
    ("recompute_vs_nvme_cold", ">= 30 at 8K", lambda r: r >= 30),
)


def plot_vllm(results: dict[str, dict[str, Any]], name: str) -> str:
    """TTFT against context for every case measured, and ``vllm_prefix + fio`` dashed; the path
    ``docs/benchmarks.md`` links the PNG by."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lengths = [int(n) for n in results]
    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    for key, label, colour, style in SERIES:
        shown = [(n, r["ttft_s"].get(key)) for n, r in zip(lengths, results.values(), strict=True)]
        shown = [(n, t) for n, t in shown if t is not None]
        if shown:
            ax.plot(*zip(*shown, strict=True), style, color=colour, label=label)
    limit = [
        (n, r["ttft_s"]["vllm_prefix"] + r["fio_read_s"])
        for n, r in zip(lengths, results.values(), strict=True)
        if r.get("fio_read_s") is not None and "vllm_prefix" in r["ttft_s"]
    ]
    if limit:
        ax.plot(*zip(*limit, strict=True), ":", color="tab:blue", label="vLLM prefix + fio")
    _ttft_axes(ax, lengths, "TTFT under vLLM (CPU): SmolLM2-135M", legend_size=7)
    return save_figure(fig, f"{name}.png")


def _ttft_axes(ax: Any, lengths: list[int], title: str, *, legend_size: int) -> None:
    """Both plots' axes: TTFT (log) against the context length (log 2, in K tokens)."""
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(lengths, [f"{n / 1024:g}K" for n in lengths])
    ax.set_xlabel("context (tokens)")
    ax.set_ylabel("time to first token (s)")
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=legend_size)


def _s(value: float | None, digits: int = 3) -> str:
    return "–" if value is None else f"{value:.{digits}f}"


def _ttft_table(results: dict[str, dict[str, Any]]) -> list[str]:
    lines = [
        "| context | recompute | vLLM prefix | kvtierd DRAM | kvtierd cold NVMe | fio | "
        "whole_prompt DRAM | whole_prompt cold | vLLM fs warm | vLLM fs cold | "
        "kvtierd tier warm | kvtierd tier cold | compute/token | cached |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for n, row in results.items():
        t = row["ttft_s"]
        per_token = row.get("per_token_compute_s")
        cells = [_s(t.get(key)) for key, *_ in SERIES]
        cells.insert(4, _s(row.get("fio_read_s")))
        compute = "–" if per_token is None else f"{per_token * 1e3:.2f} ms"
        cached = row.get("cached_tokens") or {}
        hits = " / ".join(
            str(cached.get(k, "–"))
            for k in ("vllm_prefix", "kvtierd_dram", "kvtierd_whole_dram", "vllm_fs_warm")
        )
        lines.append(
            f"| {n} ({row['prompt_tokens']}) | " + " | ".join(cells) + f" | {compute} | {hits} |"
        )
    return lines


def _ratio_table(results: dict[str, dict[str, Any]]) -> list[str]:
    keys = (
        "dram_vs_prefix",
        "nvme_cold_vs_prefix_fio",
        "recompute_vs_nvme_cold",
        "dram_vs_whole",
        "nvme_cold_vs_whole",
        "dram_vs_fs_warm",
        "nvme_cold_vs_fs_cold",
        "tier_warm_vs_fs_warm",
        "tier_cold_vs_fs_cold",
    )
    lines = [
        "| context | DRAM / prefix | cold / (prefix + fio) | recompute / cold | "
        "DRAM / whole_prompt DRAM | cold / whole_prompt cold | DRAM / fs warm | "
        "cold / fs cold | tier warm / fs warm | tier cold / fs cold | tokens equal | TV max | "
        "TV whole_prompt | TV fs tier |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|:-:|---:|---:|---:|",
    ]
    for n, row in results.items():
        r = row["ratios"]
        cells = [_s(r.get(k), 2) for k in keys]
        others = [_tv(row, ("kvtierd_whole_dram", "kvtierd_whole_nvme_cold"))]
        others.append(_tv(row, ("vllm_fs_warm", "vllm_fs")))
        lines.append(
            f"| {n} | "
            + " | ".join(cells)
            + f" | {row['tokens_equal']} | {row['tv_max']:.2e} | "
            + " | ".join(others)
            + " |"
        )
    return lines


def _tv(row: dict[str, Any], cases: tuple[str, ...]) -> str:
    """The largest TV of ``cases`` against vLLM's prefix hit, ``–`` where none ran."""
    fidelity = row.get("fidelity") or {}
    values = [fidelity[c]["tv_max"] for c in cases if c in fidelity]
    return f"{max(values):.2e}" if values else "–"


def _targets(results: dict[str, dict[str, Any]]) -> list[str]:
    lines = []
    for key, goal, met in TARGETS:
        if key == "recompute_vs_nvme_cold":
            rows = {n: r for n, r in results.items() if int(n) >= 8192}
            if not rows:
                longest = max(results, key=int)
                value = results[longest]["ratios"].get(key)
                shown = "–" if value is None else f"{value:.1f}"
                lines.append(f"* `{key}` {goal}: 8K not measured ({shown} at {longest})")
                continue
        else:
            rows = results
        values = {n: row["ratios"].get(key) for n, row in rows.items()}
        measured = [f"{v:.2f} at {n}" for n, v in values.items() if v is not None]
        verdict = bool(measured) and all(met(v) for v in values.values() if v is not None)
        lines.append(
            f"* `{key}` {goal}: {', '.join(measured) or 'not measured'} "
            f"({'met' if verdict else 'not met'})"
        )
    lines.append(_fidelity_target(results))
    return lines


def _fidelity_target(results: dict[str, dict[str, Any]]) -> str:
    """The target line of the default restores' fidelity ("not measured" without them)."""
    rows = [r for r in results.values() if "kvtierd_dram" in (r.get("fidelity") or {})]
    equal = bool(rows) and all(row["tokens_equal"] for row in rows)
    tv = max((float(row["tv_max"]) for row in rows), default=float("nan"))
    verdict = "met" if equal and tv <= TV_GOAL else "not met" if rows else "not measured"
    return (
        "* kvtierd's restores on its default settings give vLLM's prefix hit: tokens equal "
        f"{equal}, TV max {tv:.2e} (<= {TV_GOAL:g}: {verdict})"
    )


def _env(result: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v}" for k, v in (result.get("engine_env") or {}).items()) or "default"


def markdown_vllm(result: dict[str, Any], name: str) -> str:
    """The "vllm_ttft" section."""
    results = result["results"]
    skipped = result.get("skipped") or {}
    lines = [
        "## Time to first token under vLLM (`python -m tools.ttft --engine vllm`)",
        "",
        f"SmolLM2-135M-Instruct in {result['engine']}, blocks of {result['block_tokens']} "
        "tokens, one engine per configuration serving every length. A LooGLE document plus its "
        "first question per length (context: asked for, and the prompt's tokens, which leave "
        f"{result['steps']} for the continuation). TTFT: the wall time of one `generate` with "
        "`max_tokens=1`, token ids in, first token out. vLLM prefix: the same prompt a second "
        "time in the same engine. Cached: the prompt tokens vLLM did not compute (its own "
        "count) for vLLM prefix / kvtierd DRAM / whole_prompt DRAM / fs tier: vLLM's own hit of "
        "whole blocks ending before the last token leaves the last block, up to 128 tokens, to "
        "compute, and so does kvtierd's connector on its default settings (the same tokens "
        "cached and computed: bitwise vLLM's hit); with `whole_prompt: true` it, like the "
        "native offloading tiers, loads every block of these whole-block prompts before the "
        "forward, and vLLM then computes the last token only (faster, but its TV against the "
        "prefix hit is that of another split of cached and computed tokens). Warm (offloading "
        "tiers): from "
        "vLLM's CPU tier. Cold: the daemon "
        "restarted on its data (kvtierd), the page cache dropped, the engine's unrelated "
        "warm-up prompt run once more so that its code pages are back, then vLLM's prefix "
        "cache and CPU tier emptied (secondary tiers keep their blocks). fio: reading the same "
        "bytes as kvtierd's connector restores (io_uring, O_DIRECT, one block per request, "
        f"qd 32), alternated with its cold restores. Medians of {result['repeats']} run(s); "
        "seconds. Every engine binds its OpenMP threads alike "
        f"({_env(result)}), OMP_WAIT_POLICY={result['omp_wait_policy']}.",
        "",
        *_ttft_table(results),
        "",
        f"![TTFT under vLLM](benchmarks/{name}.png)",
        "",
        "Ratios of TTFTs (below 1: the first is faster); recompute / cold is the speed-up of a "
        "cold restore over recomputing; DRAM / whole_prompt DRAM and cold / whole_prompt cold: "
        "what the default's fidelity costs. Tokens equal, TV max: 16 greedy tokens of kvtierd's "
        "default restores (DRAM and cold) against the prefix hit (total variation between "
        "top-20 distributions); TV whole_prompt and TV fs tier: the same of the other "
        "configurations.",
        "",
        *_ratio_table(results),
        "",
        "Targets:",
        "",
        *_targets(results),
    ]
    if skipped:
        lines += ["", "Not measured: " + "; ".join(f"{k}: {v}" for k, v in skipped.items()) + "."]
    lines += ["", machine_line(result["machine"])]
    return "\n".join(lines)


# -- the pool case (tools/bench_pool.py's section) ------------------------------------------------


def pool_markdown_lines(ttft: dict[str, Any]) -> list[str]:
    """The pool case's lines of ``tools/bench_pool.py``'s "pool" section."""
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
        "are interleaved with them (`tools/ttft/hf.py`'s `LengthRun`). TTFT: from the prompt's "
        "token ids to the first token's logits; medians, seconds.",
        "",
        "| case | TTFT s | runs | recompute / case | lookup + read s | forward s |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for case in POOL_CASES:
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
