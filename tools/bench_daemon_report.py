"""Turn ``bench_daemon.py`` results into the ``daemon`` section of docs/benchmarks.md + a plot."""

from __future__ import annotations

from typing import Any

import benchlib

GOALS = {"cold": 0.90, "dram": 0.93, "rtt": 1.2}
#: The LOOKUP rows (key suffix, who measured it): bench_daemon's RTT_VARIANTS.
_RTT_ROWS = (
    ("", "blocking client, daemon on asyncio (uvloop)"),
    ("_sync_trio", "blocking client, daemon on trio"),
    ("_async", "async client on asyncio, daemon on asyncio (uvloop)"),
    ("_async_trio", "async client on trio, daemon on trio"),
)


def _plot(result: dict[str, Any]) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels, values, goals = [], [], []
    for cold in result.get("cold", []):
        labels.append(f"cold {cold['block_bytes'] >> 20} MiB\ncopied\nvs fio")
        values.append(cold["median_ratio"])
        goals.append(GOALS["cold"])
        if "zero_copy" in cold:
            labels.append(f"cold {cold['block_bytes'] >> 20} MiB\nleased\nvs fio")
            values.append(cold["zero_copy"]["median_ratio"])
            goals.append(GOALS["cold"])
    if "dram" in result:
        labels.append("DRAM copy-out\nvs numpy copy")
        values.append(result["dram"]["median_ratio"])
        goals.append(GOALS["dram"])
    if "put" in result:
        labels.append("put+FSYNC\nvs fio write")
        values.append(result["put"]["median_ratio"])
        goals.append(float("nan"))
    fig, ax = plt.subplots(figsize=(9, 4))
    bars = ax.bar(labels, values, color="#3b7dd8")
    ax.scatter(labels, goals, marker="_", s=2000, color="#d84b3b", label="goal", zorder=3)
    ax.bar_label(bars, fmt="%.2f")
    ax.set_ylabel("kvtierd / reference (median of rounds)")
    ax.set_title("kvtierd against references measured in the same run")
    ax.legend()
    return benchlib.save_figure(fig, "daemon.png")


def record_daemon(result: dict[str, Any]) -> None:
    lines = ["## Foundation: data path against fio, memcpy and a bare socket", ""]
    lines.append(benchlib.machine_line(result["machine"]))
    lines.append("")
    lines.append("| benchmark | kvtierd | reference | ratio per round | median | goal |")
    lines.append("|---|---|---|---|---|---|")

    def row(name: str, r: dict[str, Any], ref_key: str, goal: str) -> None:
        kv = ", ".join(f"{x:.2f}" for x in r["kvtierd_gbps"])
        ref = ", ".join(f"{x:.2f}" for x in r[ref_key])
        ratios = ", ".join(f"{x:.2f}" for x in r["ratios"])
        lines.append(
            f"| {name} | {kv} GB/s | {ref} GB/s | {ratios} | **{r['median_ratio']:.2f}** | {goal} |"
        )

    for cold in result.get("cold", []):
        row(
            f"cold read, {cold['block_bytes'] >> 20} MiB blocks, qd {cold['queue_depth']}, "
            "copied into client buffers (vs fio io_uring O_DIRECT)",
            cold,
            "fio_gbps",
            ">= 0.90",
        )
        if "zero_copy" in cold:
            row(
                f"cold read, {cold['block_bytes'] >> 20} MiB blocks, qd {cold['queue_depth']}, "
                "leased in the shared arena, no copy (vs the same fio runs)",
                cold["zero_copy"],
                "fio_gbps",
                ">= 0.90",
            )
    if "dram" in result:
        row(
            "DRAM hit copied out by the client (vs numpy copy)",
            result["dram"],
            "numpy_gbps",
            ">= 0.93",
        )
    if "put" in result:
        row(
            "put + FSYNC, 2 MiB blocks (vs fio write + fsync)",
            result["put"],
            "fio_gbps",
            "recorded",
        )
    if "rtt" in result:
        lines += [
            "",
            "| LOOKUP round trip | kvtierd p50 / p99 | asyncio echo p50 / p99 "
            "| ratio p50 / p99 | goal |",
            "|---|---|---|---|---|",
        ]
        for suffix, who in _RTT_ROWS:
            for n in (1, 64):
                r = result["rtt"].get(f"keys_{n}{suffix}")
                if r is None:
                    continue
                goal = f"p50 <= {GOALS['rtt']}" if not suffix else "recorded"
                lines.append(
                    f"| {n} key{'s' if n > 1 else ''}, {who} "
                    f"| {r['kvtierd_p50_us']:.0f} / {r['kvtierd_p99_us']:.0f} us | "
                    f"{r['echo_p50_us']:.0f} / {r['echo_p99_us']:.0f} us | "
                    f"**{r['ratio_p50']:.2f} / {r['ratio_p99']:.2f}** | {goal} |"
                )
    if "restart" in result:
        r = result["restart"]
        lines += [
            "",
            f"Restart with {r['blocks']:,} indexed blocks: **{r['snapshot_s']:.2f} s** after a "
            f"clean stop (index snapshot, {r['snapshot_found']:,} found), "
            f"**{r['scan_s']:.2f} s** after kill -9 (header scan, {r['scan_found']:,} found); "
            "both include process start-up and arena pre-fault.",
        ]
    if "cold" in result or "dram" in result:
        lines += ["", f"![ratios]({_plot(result)})"]
    lines += ["", "Reproduce: `python tools/bench_daemon.py --json` (about 5 minutes)."]
    benchlib.record("daemon", "\n".join(lines), result)
