"""Two runs of ``tools/bench_daemon.py`` side by side: did a change cost anything?

Each run's figures are already ratios against a reference measured in that run (fio on the same
file, a numpy copy, a bare echo), so two runs on the same machine compare by their ratios even
when the disk's speed drifts between them. This tool reads the two JSON objects
``bench_daemon.py --json --no-record`` printed (the code before and after a change, run back to
back), prints one JSON object with each figure before and after and their quotient, and with
``--record`` writes the ``daemon_before_after`` section of ``docs/benchmarks.md`` with a plot.

A quotient below 1 is worse after the change for "higher is better" figures (throughput
ratios) and better for the others (round trips, restart seconds, overheads); the table says
which. Noise: the same scenario's rounds within one run (``rounds`` in each file) spread as
much as the table's ``spread`` columns show; a change is "beyond noise" only past that.

``python -m tools.bench_compare BEFORE.json AFTER.json --json --record --title "issue 18"``
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tools import benchlib

MiB = 1 << 20

#: (label, higher is better, how to read it from a bench_daemon result, its per-round values)
Figure = tuple[
    str, bool, Callable[[dict[str, Any]], float], Callable[[dict[str, Any]], list[float]]
]


def _by_size(
    key: str, size: int, order: str | None = None
) -> Callable[[dict[str, Any]], dict[str, Any]]:
    """The entry of ``result[key]`` for block size ``size`` (and read ``order``, where the
    entries have one: ``in_order``, ``random``)."""

    def pick(result: dict[str, Any]) -> dict[str, Any]:
        return next(
            entry
            for entry in result[key]
            if entry["block_bytes"] == size and order in (None, entry.get("order"))
        )

    return pick


Section = Callable[[dict[str, Any]], dict[str, Any]]


def _rounds(label: str, higher: bool, section: Section, median: str, rounds: str) -> Figure:
    """A figure with a median and its per-round values in one section of a result."""
    return (label, higher, lambda r: section(r)[median], lambda r: section(r)[rounds])


def _single(label: str, read: Callable[[dict[str, Any]], float]) -> Figure:
    """A figure of one value (lower is better), with no rounds to show its spread."""
    return (label, False, read, _none)


def _key(key: str) -> Section:
    return lambda result: result[key]


def _figures() -> list[Figure]:
    figures: list[Figure] = []
    for size in (2 * MiB, 32 * MiB):
        for order in ("in_order", "random"):
            cold = _by_size("cold", size, order)
            label = f"{size // MiB} MiB, {order.replace('_', ' ')}"
            figures.append(
                _rounds(f"cold read vs fio, {label}", True, cold, "median_ratio", "ratios")
            )
            figures.append(
                _rounds(
                    f"cold read zero-copy vs fio, {label}",
                    True,
                    lambda r, c=cold: c(r)["zero_copy"],
                    "median_ratio",
                    "ratios",
                )
            )
    for size in (448 << 10, 8 * MiB):
        label = f"{size >> 10} KiB" if size < MiB else f"{size // MiB} MiB"
        dram = _by_size("dram", size)
        figures.append(
            _rounds(f"DRAM copy-out vs numpy, {label}", True, dram, "median_ratio", "ratios")
        )
    for variant, client in (("", "blocking"), ("_async", "async"), ("_async_trio", "async, trio")):
        for keys in (1, 64):
            figures.append(
                _single(
                    f"LOOKUP p50 vs echo, {keys} key{'s' if keys > 1 else ''}, {client} client",
                    lambda r, k=f"keys_{keys}{variant}": r["rtt"][k]["ratio_p50"],
                )
            )
    figures += [
        _rounds("put + FSYNC vs fio", True, _key("put"), "median_ratio", "ratios"),
        _single("restart, snapshot (s)", lambda r: r["restart"]["snapshot_s"]),
        _single("restart, scan after kill -9 (s)", lambda r: r["restart"]["scan_s"]),
    ]
    for size in (256 << 10, 2 * MiB):
        label = f"{size >> 10} KiB" if size < MiB else f"{size // MiB} MiB"
        figures.append(
            _rounds(
                f"put + FSYNC with private copy vs without, {label}",
                True,
                _by_size("staging", size),
                "median_throughput_ratio",
                "throughput_ratio",
            )
        )
        figures.append(
            _rounds(
                f"read_into verify overhead, {label}",
                False,
                _by_size("verify", size),
                "median_verify_overhead",
                "verify_overhead",
            )
        )
    return figures


def _none(result: dict[str, Any]) -> list[float]:
    return []


def compare(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    rows = []
    for label, higher_better, read, rounds in _figures():
        try:
            b, a = read(before), read(after)
        except (KeyError, StopIteration):
            continue  # a scenario one of the runs left out (--only)
        spread = [*rounds(before), *rounds(after)]
        rows.append(
            {
                "figure": label,
                "higher_is_better": higher_better,
                "before": b,
                "after": a,
                "after_over_before": a / b if b else float("nan"),
                "round_min": min(spread) if spread else None,
                "round_max": max(spread) if spread else None,
            }
        )
    return {
        "before": {"machine": before["machine"], "load_average": before.get("load_average")},
        "after": {"machine": after["machine"], "load_average": after.get("load_average")},
        "figures": rows,
    }


def _plot(result: dict[str, Any], title: str, name: str) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["figures"]
    fig, ax = plt.subplots(figsize=(8, 0.42 * len(rows) + 1.2))
    labels = [r["figure"] for r in rows]
    # "better after" to the right for every figure, whichever way it reads
    gains = [
        (r["after_over_before"] if r["higher_is_better"] else 1 / r["after_over_before"])
        for r in rows
    ]
    colours = ["tab:green" if g >= 1 else "tab:red" for g in gains]
    ax.barh(range(len(rows)), [g - 1 for g in gains], left=1, color=colours)
    ax.axvline(1, color="black", linewidth=0.8)
    ax.set_yticks(range(len(rows)), labels, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("after / before, oriented so that right is better")
    ax.set_title(title, fontsize=10)
    return benchlib.save_figure(fig, f"{name}.png")


def record(result: dict[str, Any], title: str, name: str = "daemon_before_after") -> None:
    before, after = result["before"], result["after"]
    lines = [
        f"## Before and after: {title}",
        "",
        "`tools/bench_daemon.py` run twice back to back on the same machine, on the code before "
        "and after the change; every figure is that run's ratio against its own reference "
        "(fio, numpy, an echo), so the two compare even though the disk drifts. `spread` is "
        "the range of the per-round ratios over both runs: the noise a difference must exceed.",
        "",
        f"Before: commit {before['machine']['commit']}, {before['machine']['date']}, load "
        f"{_load(before)}. After: commit {after['machine']['commit']}, "
        f"{after['machine']['date']}, load {_load(after)}.",
        "",
        "| figure | better | before | after | after / before | spread of rounds |",
        "|---|---|---|---|---|---|",
    ]
    for row in result["figures"]:
        spread = (
            f"{row['round_min']:.2f}-{row['round_max']:.2f}" if row["round_min"] is not None else ""
        )
        lines.append(
            f"| {row['figure']} | {'higher' if row['higher_is_better'] else 'lower'} "
            f"| {row['before']:.3f} | {row['after']:.3f} | {row['after_over_before']:.2f} "
            f"| {spread} |"
        )
    lines += [
        "",
        f"![after over before]({_plot(result, title, name)})",
        "",
        "Reproduce: run `python -m tools.bench_daemon --json --no-record` on each commit "
        "(a worktree per commit, `PYTHONPATH` at it), then "
        "`python -m tools.bench_compare BEFORE.json AFTER.json --record --title ...`.",
    ]
    benchlib.record(name, "\n".join(lines), result)


def _load(side: dict[str, Any]) -> str:
    load = side.get("load_average") or {}
    return f"{load.get('start', 0):.1f}-{load.get('end', 0):.1f}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("before", type=Path)
    parser.add_argument("after", type=Path)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--record", action="store_true")
    parser.add_argument("--title", default="a change")
    parser.add_argument(
        "--name", default="daemon_before_after", help="the docs/benchmarks.md section to write"
    )
    args = parser.parse_args()
    try:
        before = json.loads(args.before.read_text())
        after = json.loads(args.after.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        parser.error(f"cannot read a bench_daemon result: {exc}")
    result = compare(before, after)
    benchlib.emit(result, args.json)
    if args.record:
        record(result, args.title, args.name)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
