"""``python -m tools.replay --workloads``: every policy at the sweep capacities on the three
workload-model traces of :mod:`kvtierd.replay.workloads`, the check that SLSAP's defaults are not
fitted to the one real trace. Records the ``slsap_workloads`` section of docs/benchmarks.md."""

from __future__ import annotations

from typing import Any

from kvtierd.replay import PolicyName, capacity_in_blocks, simulate
from kvtierd.replay.workloads import KINDS, workload_trace
from tools import benchlib
from tools.replay_plot import draw_hit_ratios

REQUESTS, SEEDS = 4000, (1, 2, 3)
"""Three draws of each mix, so that a margin one draw's randomness decides shows as such."""


def workloads_mode(capacities: tuple[float, ...], block_bytes: int) -> dict[str, Any]:
    policies = tuple(PolicyName)
    traces: list[dict[str, Any]] = []
    for kind, seed in ((kind, seed) for seed in SEEDS for kind in KINDS):
        requests = workload_trace(kind, REQUESTS, seed)
        rows = []
        for capacity in capacities:
            blocks = capacity_in_blocks(capacity, requests)
            hit = {
                p.value: simulate(requests, p, blocks, block_bytes=block_bytes).hit_ratio
                for p in policies
            }
            online = [p.value for p in policies if not p.offline and p.value != "slsap"]
            best = max(online, key=lambda name: hit[name])
            rows.append(
                {
                    "capacity": capacity,
                    "capacity_blocks": blocks,
                    "hit_ratio": hit,
                    "best_other_online": best,
                    "slsap_margin": hit["slsap"] - hit[best],
                }
            )
        traces.append(
            {
                "kind": kind,
                "requests": REQUESTS,
                "seed": seed,
                "references": sum(len(r.hash_ids) for r in requests),
                "capacities": rows,
            }
        )
    margins = [row["slsap_margin"] for t in traces for row in t["capacities"]]
    return {
        "traces": traces,
        "cells": len(margins),
        "slsap_best_online": sum(m > 0 for m in margins),
        "slsap_ties": sum(m == 0 for m in margins),
        "worst_margin": min(margins),
        "machine": benchlib.machine(),
    }


def _plot(result: dict[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    traces = result["traces"]
    rows = len({trace["seed"] for trace in traces})
    cols = len(traces) // rows
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.6 * rows), squeeze=False)
    for ax, trace in zip(axes.flat, traces, strict=True):
        draw_hit_ratios(ax, trace["capacities"], markersize=3)
        ax.set_title(
            f"{trace['kind']}, seed {trace['seed']} ({trace['references']:,} references)",
            fontsize=10,
        )
    for row in axes:
        row[0].set_ylabel("block hit ratio")
    axes[0][-1].legend(fontsize=7)
    benchlib.save_figure(fig, "slsap_workloads.png", dpi=100)


def record_workloads_mode(result: dict[str, Any]) -> None:
    _plot(result)
    names = [p.value for p in PolicyName]
    lines = [
        "## SLSAP reuse policy on workload-model traces (simulation)",
        "",
        "`python -m tools.replay --workloads --record`: the same policies and defaults on three "
        "draws "
        f"(seeds {', '.join(map(str, SEEDS))}) of three traces with other structure than the "
        "Mooncake one (conversation sessions, agent loops, RAG documents; the model is "
        "`kvtierd/replay/workloads.py`), so that a default fitted to one trace would show. They "
        "are not evidence about production workloads.",
        f"SLSAP is the best online policy in {result['slsap_best_online']} of {result['cells']} "
        f"cells, ties in {result['slsap_ties']}; its worst margin to the best other online "
        f"policy is {result['worst_margin']:+.4f}.",
        "",
        "| trace | seed | capacity | " + " | ".join(names) + " | SLSAP - best other online |",
        "|---|---|---|" + "---:|" * (len(names) + 1),
    ]
    for trace in result["traces"]:
        for row in trace["capacities"]:
            cells = " | ".join(f"{row['hit_ratio'][n]:.4f}" for n in names)
            lines.append(
                f"| {trace['kind']} | {trace['seed']} "
                f"| {100 * row['capacity']:g} % ({row['capacity_blocks']}) "
                f"| {cells} | {row['slsap_margin']:+.4f} ({row['best_other_online']}) |"
            )
    lines += ["", "![hit ratio vs capacity](benchmarks/slsap_workloads.png)"]
    benchlib.record("slsap_workloads", "\n".join(lines), result)
