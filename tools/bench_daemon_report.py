"""Turn ``bench_daemon.py`` results into the ``daemon`` section of docs/benchmarks.md + a plot."""

from __future__ import annotations

from typing import Any

from tools import benchlib

GOALS = {"cold": 0.95, "dram": 0.95, "rtt": 1.2}
#: The LOOKUP rows (key suffix, who measured it): bench_daemon's RTT_VARIANTS.
_RTT_ROWS = (
    ("", "blocking client, daemon on asyncio (uvloop)"),
    ("_sync_trio", "blocking client, daemon on trio"),
    ("_async", "async client on asyncio, daemon on asyncio (uvloop)"),
    ("_async_trio", "async client on trio, daemon on trio"),
)


def _size(nbytes: int) -> str:
    return f"{nbytes >> 20} MiB" if nbytes % (1 << 20) == 0 else f"{nbytes >> 10} KiB"


def _listed(values: list[float]) -> str:
    return ", ".join(f"{x:.2f}" for x in values)


def _cold_label(cold: dict[str, Any]) -> str:
    """``448 KiB random`` (results before issue 32 have no order: random reads)."""
    order = cold.get("order", "random")
    return f"{_size(cold['block_bytes'])} {'in order' if order == 'in_order' else 'random'}"


def _plot(result: dict[str, Any]) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels, values, goals = [], [], []
    for cold in result.get("cold", []):
        labels.append(f"cold\n{_cold_label(cold)}\ncopied")
        values.append(cold["median_ratio"])
        goals.append(GOALS["cold"])
        if "zero_copy" in cold:
            labels.append(f"cold\n{_cold_label(cold)}\nleased")
            values.append(cold["zero_copy"]["median_ratio"])
            goals.append(GOALS["cold"])
    for dram in result.get("dram", []):
        labels.append(f"DRAM copy-out\n{_size(dram['block_bytes'])}\nvs numpy copy")
        values.append(dram["median_ratio"])
        goals.append(GOALS["dram"])
    if "put" in result:
        labels.append("put+FSYNC\nvs fio write")
        values.append(result["put"]["median_ratio"])
        goals.append(float("nan"))
    fig, ax = plt.subplots(figsize=(max(9, 1.1 * len(labels)), 4))
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
        kv = _listed(r["kvtierd_gbps"])
        ref = _listed(r[ref_key])
        ratios = _listed(r["ratios"])
        lines.append(
            f"| {name} | {kv} GB/s | {ref} GB/s | {ratios} | **{r['median_ratio']:.2f}** | {goal} |"
        )

    for cold in result.get("cold", []):
        row(
            f"cold read, {_cold_label(cold)}, qd {cold['queue_depth']}, "
            "copied into client buffers (vs fio io_uring O_DIRECT, same order, the faster of "
            "`--fixedbufs` and not)",
            cold,
            "fio_gbps",
            ">= 0.95",
        )
        if "zero_copy" in cold:
            row(
                f"cold read, {_cold_label(cold)}, qd {cold['queue_depth']}, "
                "leased in the shared arena, no copy (vs the same fio runs)",
                cold["zero_copy"],
                "fio_gbps",
                ">= 0.95",
            )

    for dram in result.get("dram", []):
        row(
            f"DRAM hit copied out by the client, {_size(dram['block_bytes'])} blocks, verified "
            f"({dram['copy_kernel']} copy+hash kernel; vs numpy copy)",
            dram,
            "numpy_gbps",
            ">= 0.95",
        )
    if "put" in result:
        row(
            "put + FSYNC, 2 MiB blocks (vs fio write + fsync)",
            result["put"],
            "fio_gbps",
            "recorded",
        )
    if any("daemon_cpu_s_per_gb" in cold for cold in result.get("cold", [])):
        cpu = "; ".join(
            f"{_cold_label(c)} {benchlib.median(c['daemon_cpu_s_per_gb']):.2f}"
            for c in result["cold"]
        )
        lines += ["", f"Daemon CPU seconds per GB of cold reads copied out (median): {cpu}."]
    if any("fio_fixedbufs_gbps" in cold for cold in result.get("cold", [])):
        fio = "; ".join(
            f"{_cold_label(c)} {benchlib.median(c['fio_plain_gbps']):.2f} / "
            f"{benchlib.median(c['fio_fixedbufs_gbps']):.2f}"
            for c in result["cold"]
        )
        lines += [
            "",
            "fio's two references, without / with `--fixedbufs` (median GB/s; on this virtual "
            "machine io_uring reads into memory its registration faulted in keep the disk's "
            f"queue full, see architecture.md): {fio}.",
        ]
    if "rtt" in result:
        lines += [
            "",
            "| LOOKUP round trip (medians of rounds) | kvtierd p50 / p99 | asyncio echo p50 / p99 "
            "| median of the rounds' ratios p50 / p99 | p50 ratio per round | goal |",
            "|---|---|---|---|---|---|",
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
                    f"**{r['ratio_p50']:.2f} / {r['ratio_p99']:.2f}** | "
                    f"{_listed(r.get('ratio_p50_rounds', [r['ratio_p50']]))} | {goal} |"
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
    lines += [
        "",
        "Reproduce: `python -m tools.bench_daemon --json` (about 10 minutes; the cold reads "
        "alone: `--only cold`).",
    ]
    benchlib.record("daemon", "\n".join(lines), result)
