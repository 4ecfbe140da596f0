"""The hit-ratio-vs-capacity axes that ``tools/replay.py``'s benchmarks draw."""

from __future__ import annotations

from typing import Any

from kvtierd.replay import PolicyName


def draw_hit_ratios(ax: Any, rows: list[dict[str, Any]], markersize: float = 6.0) -> None:
    """One line per policy (the offline one dashed and labelled so, SLSAP thicker) over the
    capacities of ``rows`` (each with ``capacity`` and ``hit_ratio``), on a log axis."""
    xs = [100 * row["capacity"] for row in rows]
    for policy in PolicyName:
        ys = [row["hit_ratio"][policy.value] for row in rows]
        label = f"{policy.value} (offline, sees the future)" if policy.offline else policy.value
        ax.plot(
            xs,
            ys,
            "--" if policy.offline else "-",
            marker="o",
            markersize=markersize,
            label=label,
            linewidth=2.2 if policy.value == "slsap" else 1.2,
        )
    ax.set_xscale("log")
    ax.set_xticks(xs, [f"{x:g}%" for x in xs])
    ax.set_xlabel("capacity (share of distinct blocks)")
    ax.grid(True, alpha=0.3)
