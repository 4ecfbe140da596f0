"""The ``vllm_ttft`` section of ``docs/benchmarks.md`` and its plot, from the result
``tools/vllm_ttft.py`` prints (no engine, no daemon: ``--from-json`` re-renders a saved run)."""

from __future__ import annotations

from typing import Any

from tools.benchlib import machine_line, save_figure

#: (JSON name, label, colour, line style) of every TTFT the section shows.
SERIES = (
    ("recompute", "recompute (vLLM prefill)", "tab:red", "o-"),
    ("vllm_prefix", "vLLM prefix cache hit", "black", "o-"),
    ("kvtierd_dram", "kvtierd, DRAM", "tab:green", "o-"),
    ("kvtierd_nvme_cold", "kvtierd, cold NVMe", "tab:blue", "o-"),
    ("vllm_fs_warm", "vLLM fs tier, warm", "tab:purple", "s--"),
    ("vllm_fs", "vLLM fs tier, cold", "tab:purple", "s-"),
    ("kvtierd_tier_warm", "kvtierd as vLLM tier, warm", "tab:cyan", "^--"),
    ("kvtierd_tier", "kvtierd as vLLM tier, cold", "tab:cyan", "^-"),
)
#: (ratio name, target as text, test) of the ratios the targets are stated in.
TARGETS = (
    ("dram_vs_prefix", "<= 1.2", lambda r: r <= 1.2),
    ("nvme_cold_vs_prefix_fio", "<= 1.2", lambda r: r <= 1.2),
    ("recompute_vs_nvme_cold", ">= 30 at 8K", lambda r: r >= 30),
)


def plot(results: dict[str, dict[str, Any]], name: str) -> str:
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
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(lengths, [f"{n / 1024:g}K" for n in lengths])
    ax.set_xlabel("context (tokens)")
    ax.set_ylabel("time to first token (s)")
    ax.set_title("TTFT under vLLM (CPU): SmolLM2-135M")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    return save_figure(fig, f"{name}.png")


def _s(value: float | None, digits: int = 3) -> str:
    return "–" if value is None else f"{value:.{digits}f}"


def _ttft_table(results: dict[str, dict[str, Any]]) -> list[str]:
    lines = [
        "| context | recompute | vLLM prefix | kvtierd DRAM | kvtierd cold NVMe | fio | "
        "vLLM fs warm | vLLM fs cold | kvtierd tier warm | kvtierd tier cold | compute/token "
        "| cached |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for n, row in results.items():
        t = row["ttft_s"]
        per_token = row.get("per_token_compute_s")
        cells = [_s(t.get(key)) for key, *_ in SERIES]
        cells.insert(4, _s(row.get("fio_read_s")))
        compute = "–" if per_token is None else f"{per_token * 1e3:.2f} ms"
        cached = row.get("cached_tokens") or {}
        hits = " / ".join(
            str(cached.get(k, "–")) for k in ("vllm_prefix", "kvtierd_dram", "vllm_fs_warm")
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
        "dram_vs_fs_warm",
        "nvme_cold_vs_fs_cold",
        "tier_warm_vs_fs_warm",
        "tier_cold_vs_fs_cold",
    )
    lines = [
        "| context | DRAM / prefix | cold / (prefix + fio) | recompute / cold | "
        "DRAM / fs warm | cold / fs cold | tier warm / fs warm | tier cold / fs cold | "
        "tokens equal | TV max |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|:-:|---:|",
    ]
    for n, row in results.items():
        r = row["ratios"]
        cells = [_s(r.get(k), 2) for k in keys]
        lines.append(
            f"| {n} | " + " | ".join(cells) + f" | {row['tokens_equal']} | {row['tv_max']:.2e} |"
        )
    return lines


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
    equal = all(row["tokens_equal"] for row in results.values())
    tv = max(row["tv_max"] for row in results.values())
    lines.append(f"* restored continuations equal to vLLM's prefix hit: {equal}, TV max {tv:.2e}")
    return lines


def _env(result: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v}" for k, v in (result.get("engine_env") or {}).items()) or "default"


def markdown(result: dict[str, Any], name: str) -> str:
    results = result["results"]
    skipped = result.get("skipped") or {}
    lines = [
        "## Time to first token under vLLM (`tools/vllm_ttft.py`)",
        "",
        f"SmolLM2-135M-Instruct in {result['engine']}, blocks of {result['block_tokens']} "
        "tokens, one engine per configuration serving every length. A LooGLE document plus its "
        "first question per length (context: asked for, and the prompt's tokens, which leave "
        f"{result['steps']} for the continuation). TTFT: the wall time of one `generate` with "
        "`max_tokens=1`, token ids in, first token out. vLLM prefix: the same prompt a second "
        "time in the same engine. Cached: the prompt tokens vLLM did not compute (its own "
        "count) for vLLM prefix / kvtierd DRAM / fs tier: vLLM's own hit of whole blocks ending "
        "before the last token leaves the last block, up to 128 tokens, to compute; kvtierd's "
        "connector (holding every block of these whole-block prompts, `whole_prompt`) and the "
        "native offloading tiers load before the forward, hit every block, and vLLM then "
        "computes the last token only (so their TV against the prefix hit is that of another "
        "split of cached and computed tokens, not of the bytes). Warm (offloading tiers): from "
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
        "cold restore over recomputing. Tokens equal, TV max: 16 greedy tokens of every restored "
        "case against the prefix hit (total variation between top-20 distributions).",
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
