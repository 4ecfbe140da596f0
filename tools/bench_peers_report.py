"""Turn ``bench_peers.py`` results into the ``peers`` section of docs/benchmarks.md + a plot."""

from __future__ import annotations

from typing import Any

from tools import benchlib

NAME = "peers"
KVTIERD, KVTIERD_READ, ADAPTER, LMC_CPU, LMC_TCP = (
    "kvtierd",
    "kvtierd, READ per chunk",
    "LMCache on kvtierd",
    "LMCache CPU",
    "LMCache TCP server",
)
#: The systems whose ratios to the references are reported (LMCache CPU's only to memcpy).
SYSTEMS_WITH_TARGETS = (KVTIERD, KVTIERD_READ, ADAPTER, LMC_CPU)
MODE_TITLES = {
    "cold": "cold, 1 chunk/request",
    "warm": "warm, 1 chunk/request",
    "cold_batch": "cold, {b} chunks/request",
    "warm_batch": "warm, {b} chunks/request",
}
#: (ratio name, goal): the issue's targets, per mode family.
GOALS = {
    "vs fio": 0.90,
    "vs best LMCache disk": 1.0,
    "vs LMCache CPU": 1.0,
    "vs LMCache TCP server": 4.0,
}


def _fmt(x: float | None, digits: int = 2) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def _plot(result: dict[str, Any]) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shapes = result["shapes"]
    fig, axes = plt.subplots(len(shapes), 1, figsize=(11, 4.2 * len(shapes)), squeeze=False)
    modes = ["cold", "warm", "cold_batch", "warm_batch"]
    colors = ["#3b7dd8", "#d8843b", "#7fb0ee", "#eeb67f"]
    for ax, shape in zip(axes[:, 0], shapes, strict=True):
        medians = shape["median_gbps"]
        names = [n for n in _order(medians) if n != "fio"]
        width = 0.2
        for j, (mode, color) in enumerate(zip(modes, colors, strict=True)):
            xs = [i + (j - 1.5) * width for i in range(len(names))]
            ys = [medians[n].get(mode, 0.0) for n in names]
            label = MODE_TITLES[mode].format(b=shape["batch"])
            ax.bar(xs, ys, width, color=color, label=label)
        fio = medians.get("fio", {}).get("cold")
        if fio:
            ax.axhline(fio, color="#d84b3b", linestyle="--", label=f"fio (disk limit) {fio:.2f}")
        ax.set_xticks(range(len(names)))
        ax.set_xticklabels([n.replace(" ", "\n", 1) for n in names], fontsize=8)
        ax.set_ylabel("GB/s (median of rounds)")
        s = shape["shape"]
        ax.set_title(
            f"{s['name']}: {s['chunk_bytes'] / 2**20:.1f} MiB chunks "
            f"({s['layers']} layers, {s['kv_heads']} KV heads, head dim {s['head_dim']}, "
            f"{s['dtype']}, {s['tokens']} tokens) x {shape['chunks']}"
        )
        ax.set_ylim(0, ax.get_ylim()[1] * 1.25)  # room for the legend above the bars
        ax.legend(fontsize=7, ncol=3, loc="upper right")
    return benchlib.save_figure(fig, f"{NAME}.png", dpi=100)


def _order(medians: dict[str, Any]) -> list[str]:
    first = [KVTIERD, KVTIERD_READ, ADAPTER, LMC_CPU, "LMCache disk", "LMCache disk O_DIRECT"]
    first += ["LMCache fs_native", LMC_TCP, "memcpy", "fio"]
    return [n for n in first if n in medians] + sorted(set(medians) - set(first))


def _shape_tables(shape: dict[str, Any]) -> list[str]:
    s, batch = shape["shape"], shape["batch"]
    lines = [
        f"### {s['name']}: {s['chunk_bytes'] / 2**20:.1f} MiB chunks x {shape['chunks']}",
        "",
        f"{s['layers']} layers, {s['kv_heads']} KV heads, head dim {s['head_dim']}, {s['dtype']}, "
        f"{s['tokens']} tokens per chunk. GB/s: median of {len(shape['rounds'])} rounds; "
        "latency: p50 / p99 in ms over every round's requests (per chunk in the 1-chunk modes, "
        f"per request of {batch} chunks in the batched ones; fio: per 2 MiB read).",
        "",
        "| system | cold GB/s | cold p50 / p99 | warm GB/s | warm p50 / p99 "
        f"| cold, {batch}/req GB/s | warm, {batch}/req GB/s | write GB/s |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    medians, lat = shape["median_gbps"], shape.get("latency_ms", {})
    for name in _order(medians):
        m, lt = medians[name], lat.get(name, {})

        def p(mode: str, lt: dict[str, Any] = lt, name: str = name) -> str:
            if name == "fio" and mode == "cold":
                pcts = [r["fio"]["cold"] for r in shape["rounds"]]
                return f"{_fmt(benchlib.median([x['p50_ms'] for x in pcts]))} / " + _fmt(
                    benchlib.median([x["p99_ms"] for x in pcts])
                )
            if mode not in lt:
                return "-"
            return f"{lt[mode]['p50']:.2f} / {lt[mode]['p99']:.2f}"

        bold = "**" if name == KVTIERD else ""
        lines.append(
            f"| {bold}{name}{bold} | {_fmt(m.get('cold'))} | {p('cold')} | {_fmt(m.get('warm'))} "
            f"| {p('warm')} | {_fmt(m.get('cold_batch'))} | {_fmt(m.get('warm_batch'))} "
            f"| {_fmt(shape['write_gbps'].get(name))} |"
        )
    lines += ["", "| ratio | per round | median | goal |", "|---|---|---:|---:|"]
    for system in SYSTEMS_WITH_TARGETS:
        for key, r in shape["ratios"].get(system, {}).items():
            goal = next((g for suffix, g in GOALS.items() if key.endswith(suffix)), None)
            goal_text = f">= {goal:g}" if goal is not None and system != LMC_CPU else "-"
            rounds = ", ".join(f"{x:.2f}" for x in r["per_round"])
            lines.append(f"| {system}: {key} | {rounds} | **{r['median']:.2f}** | {goal_text} |")
    return lines


def _load_line(result: dict[str, Any]) -> str:
    load = result.get("load_average")
    if not load:
        return ""
    start, end = (", ".join(f"{x:.1f}" for x in load[k]) for k in ("start", "end"))
    return (
        f"Load average (1, 5, 15 min) at the start: {start}; at the end: {end}, on 2 vCPUs shared "
        "with other work: every figure here is under that contention, which costs a system "
        "that serves from another process (a scheduler wake-up per request) more than an "
        "in-process one."
    )


def record_peers(result: dict[str, Any]) -> None:
    lines = [
        f"## Peers: kvtierd beside LMCache {result['lmcache']} (`tools/bench_peers.py`)",
        "",
        benchlib.machine_line(result["machine"]),
        "",
        _load_line(result),
        "",
        "Same workload through every system, same run: N chunks written once; then per round a "
        "lookup over all keys and every chunk copied into a caller buffer (`numpy.copyto` from "
        "whatever the system hands back), one chunk per request and several per request. "
        "*Cold*: one system at a time, order rotating each round (kvtierd: DRAM evicted, reads "
        "from NVMe; LMCache disk paths: page cache of their files dropped; fio: the same bytes "
        "from kvtierd's data file). *Warm*: after one untimed read through every system, all "
        "systems' requests interleaved request by request, so they share the machine's moments. "
        "Byte-exact check after every request, outside the timed window; each destination is "
        "zeroed after its check, and every request copies into the next buffers of a ring "
        "that no copy writes again before 512 MiB of other copies (an engine loads into pages "
        "it last wrote long ago; a buffer zeroed just before the copy sits dirty in the "
        "300 MiB L3 and favours cached stores over the non-temporal ones of kvtierd's copy "
        "kernel by 10-30 %; before 2026-12-06 13:50 the bench did that). kvtierd: its client "
        "as docs/client.md tells engines to use it (LOOKUP, then READ_RESIDENT holding the "
        "chunks already in DRAM, each then loaded with a copy and no round trip; the others, "
        "the cold reads, by leased READs); kvtierd, READ per chunk: LOOKUP, then one leased "
        "READ per request; LMCache on kvtierd: LMCache's StorageManager with "
        "`kvtierd.engines.lmcache` as its storage plug-in; LMCache CPU / disk / disk O_DIRECT: "
        "its StorageManager with LocalCPUBackend / LocalDiskBackend; fs_native: its MP-mode L2 "
        "adapter loading into L1 buffers; TCP server: `python -m lmcache.v1.server` through "
        "RemoteBackend (`lm://`); memcpy: numpy copy from process memory; fio: io_uring "
        f"O_DIRECT 2 MiB random reads at queue depth {result['fio_qd']}.",
        "",
    ]
    for shape in result["shapes"]:
        lines += [*_shape_tables(shape), ""]
    lines += [f"![GB/s per system and mode]({_plot(result)})", ""]
    lines += [
        "Reproduce: `python -m tools.bench_peers --json` (needs `pip install -e .[peers]`; "
        "about 3 minutes, under 3 GB of temporary files in `$BENCH_DIR`, default `/var/tmp`)."
    ]
    benchlib.record(NAME, "\n".join(lines), result)
