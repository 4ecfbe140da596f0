"""What ``kvtierctl`` shows people: rich renderables built from the daemon's replies.

Pure functions of the dicts the client returns (``Client.stats()``, ``Client.namespaces()``) and,
for ``top``, of the :class:`~kvtierd.cli.ctl_records.Rates` between two samples. Tables are kept
narrow (two per view rather than one wide one) so they fit an 80-column terminal; numbers never
wrap, and a name or identifier (namespace, tenant, model, key) is never split over two lines:
where its column is too narrow it is cut with an ellipsis (``--json`` and a pipe, which is laid
out wide, always show it whole). Its column stays wrappable, so that rich narrows it before
the numbers beside it; the cell itself (:func:`_name`) never wraps.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import humanfriendly
from rich import box
from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from kvtierd.cli.ctl_records import (
    DaemonHealth,
    Rates,
    Stats,
    TierRates,
    TopState,
    checkpoint_record,
    hit_ratio,
    prefetch_accuracy,
)
from kvtierd.printable import printable

__all__ = [
    "doctor_view",
    "format_bytes",
    "format_duration",
    "format_ratio",
    "keys_view",
    "namespace_stats_view",
    "namespaces_view",
    "stats_view",
    "status_view",
    "tenants_view",
    "top_state_line",
    "top_view",
]

_NONE = "–"
_BLANK = Text("")

Tier = Mapping[str, Any]


# -- formatting -------------------------------------------------------------------------------


def format_bytes(n: float) -> str:
    """``n`` bytes in binary units: ``"0 B"``, ``"512 B"``, ``"64.0 MiB"``, at most PiB (the
    units are humanfriendly's; its ``format_size`` would print ``"64 MiB"``, ``"0 bytes"``)."""
    value = float(n)
    units = [u.binary for u in humanfriendly.disk_size_units[:5] if abs(value) >= u.binary.divider]
    if not units:
        return f"{int(value)} B"
    return f"{value / units[-1].divider:.1f} {units[-1].symbol}"


def format_duration(seconds: float) -> str:
    """A duration as people read it: ``"4.2s"``, ``"3m 12s"``, ``"5h 03m"``, ``"2d 04h"``."""
    if seconds < 60:
        return f"{seconds:.1f}s"
    days, rest = divmod(int(seconds), 86400)
    hours, rest = divmod(rest, 3600)
    minutes, secs = divmod(rest, 60)
    if days:
        return f"{days}d {hours:02d}h"
    if hours:
        return f"{hours}h {minutes:02d}m"
    return f"{minutes}m {secs:02d}s"


def format_ratio(ratio: float | None) -> str:
    return _NONE if ratio is None else f"{ratio:.1%}"


def _count(value: Any) -> str:
    return f"{int(value):,}"


def _plural(n: int, word: str) -> str:
    return f"{n:,} {word}" if n == 1 else f"{n:,} {word}s"


def _per_second(value: float | None, *, as_bytes: bool = False) -> str:
    if value is None:
        return _NONE
    return f"{format_bytes(value)}/s" if as_bytes else f"{value:,.1f}/s"


def _share(tier: Tier) -> str:
    used, capacity = int(tier["used_bytes"]), int(tier["capacity_bytes"])
    return format_ratio(used / capacity if capacity else None)


def _capacity(tier: Tier) -> str:
    """A tier's capacity; a shared pool's is the server's business ("–")."""
    capacity = int(tier["capacity_bytes"])
    return format_bytes(capacity) if capacity else _NONE


def _name(value: object) -> Text:
    """A cell holding a name or identifier: on one line, cut with an ellipsis when too long,
    its control characters escaped (a client chose it: no terminal escape reaches the
    operator)."""
    return Text(printable(str(value)), no_wrap=True, overflow="ellipsis")


def _tier_hit_ratio(tier: Tier) -> str:
    return format_ratio(hit_ratio(int(tier["hits"]), int(tier["misses"])))


# -- tier tables ------------------------------------------------------------------------------

#: A column of a tier table: its header and how to fill a cell from the tier's STATFS entry and
#: its rates (``None`` before ``top`` has two samples, and always for ``stats``).
_Column = tuple[str, Callable[[Tier, TierRates | None], str]]

_SPACE: list[_Column] = [
    ("blocks", lambda t, r: _count(t["blocks"])),
    ("used", lambda t, r: format_bytes(int(t["used_bytes"]))),
    ("capacity", lambda t, r: _capacity(t)),
    ("use", lambda t, r: _share(t)),
    ("evictions", lambda t, r: _count(t["evictions"])),
]
_TRAFFIC: list[_Column] = [
    ("hits", lambda t, r: _count(t["hits"])),
    ("misses", lambda t, r: _count(t["misses"])),
    ("hit ratio", lambda t, r: _tier_hit_ratio(t)),
    ("read", lambda t, r: format_bytes(int(t["bytes_read"]))),
    ("written", lambda t, r: format_bytes(int(t["bytes_written"]))),
]
_SPACE_RATES: list[_Column] = [
    *_SPACE[:4],
    ("evictions/s", lambda t, r: _per_second(r.evictions if r else None)),
]
_TRAFFIC_RATES: list[_Column] = [
    ("hit ratio", lambda t, r: format_ratio(r.hit_ratio if r else None)),
    ("hits/s", lambda t, r: _per_second(r.hits if r else None)),
    ("misses/s", lambda t, r: _per_second(r.misses if r else None)),
    ("read/s", lambda t, r: _per_second(r.read_bytes if r else None, as_bytes=True)),
    ("written/s", lambda t, r: _per_second(r.written_bytes if r else None, as_bytes=True)),
]


def _tier_table(
    title: str, stats: Stats, columns: Sequence[_Column], rates: Rates | None = None
) -> Table:
    table = Table(
        title=title, title_justify="left", title_style="bold", box=box.SIMPLE_HEAD, show_edge=False
    )
    table.add_column("tier", no_wrap=True)
    for header, _ in columns:
        table.add_column(header, justify="right", no_wrap=True)
    for tier in stats["tiers"]:
        tier_rates = rates.tiers.get(str(tier["name"])) if rates is not None else None
        table.add_row(str(tier["name"]), *(cell(tier, tier_rates) for _, cell in columns))
    return table


# -- views ------------------------------------------------------------------------------------


def _key_values(rows: Sequence[tuple[str, str]]) -> Table:
    grid = Table.grid(padding=(0, 2))
    grid.add_column(style="bold", no_wrap=True)
    grid.add_column(overflow="ellipsis")  # wraps between words; a longer word is cut
    for key, value in rows:
        grid.add_row(key, value)
    return grid


_CHECK_STYLES = {"ok": "green", "fallback": "yellow", "fail": "bold red", "skipped": "dim"}


def doctor_view(checks: Sequence[Mapping[str, str]]) -> RenderableType:
    """``doctor``: one line per check, its status coloured; details wrap between words,
    subjects do not wrap."""
    table = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False)
    table.add_column("status", no_wrap=True)
    table.add_column("subject", style="bold", no_wrap=True)
    table.add_column("what the host gives the daemon, what it falls back from", overflow="ellipsis")
    for check in checks:
        status = check["status"]
        table.add_row(Text(status, style=_CHECK_STYLES.get(status, "")), check["subject"],
                      check["detail"])  # fmt: skip
    return table


def status_view(socket: Path, stats: Stats, health: DaemonHealth) -> RenderableType:
    """``status``: one headline (saying why when degraded) and the few facts an operator checks
    first; the pool's line says its state, and its reason when not attached."""
    running = f"kvtierd {stats['version']} is running on {socket}"
    if problems := health.problems():
        headline = Text.assemble(("▲ ", "bold yellow"), (f"{running}, degraded", "bold yellow"))
        headline.append(f" ({', '.join(problems)})")
    else:
        headline = Text.assemble(("● ", "bold green"), running)
    connections = _plural(int(stats["connections"]), "connection")
    namespaces = _plural(int(stats["namespaces"]), "namespace")
    rows = [
        ("uptime", format_duration(float(stats["uptime_s"]))),
        ("io backend", str(stats["io_backend"])),
        ("clients", f"{connections}, {namespaces}"),
    ]
    tiers = {str(tier["name"]): tier for tier in stats["tiers"]}
    for name, tier in tiers.items():
        blocks = _plural(int(tier["blocks"]), "block")
        used = format_bytes(int(tier["used_bytes"]))
        if name == "pool":
            rows.append((name, _pool_summary(health, f"{blocks}, {used}")))
        else:
            rows.append((name, f"{blocks}, {used} of {_capacity(tier)} ({_share(tier)})"))
        if name == "nvme" and health.disk_failing:
            rows.append(("disk", f"failing: {health.disk_failing}"))
    if "pool" not in tiers and health.pool_state != "none":
        rows.append(("pool", _pool_summary(health, "")))
    dirty = _plural(int(stats["dirty_blocks"]), "dirty block")
    dirty_bytes = format_bytes(int(stats["dirty_bytes"]))
    durable = _count(stats["durable_blocks"])
    rows.append(("write-back", f"{dirty} ({dirty_bytes}), {durable} durable"))
    rows.append(("checkpoints", checkpoint_summary(stats)))
    return Group(headline, _key_values(rows))


def _pool_summary(health: DaemonHealth, figures: str) -> str:
    """The pool's line: ``attached, 240 blocks, 21.0 MiB``, or ``local, ... (why)``."""
    line = ", ".join(part for part in (health.pool_state, figures) if part)
    if health.pool_state != "attached" and health.pool_reason:
        line += f" ({health.pool_reason})"
    return line


def checkpoint_summary(stats: Stats) -> str:
    """The NVMe tier's index checkpoints in a line: how recent the last one is and how much
    has been written since (what a crash restart would scan beyond it)."""
    if stats.get("scope") == "tenant":
        return "the host's (not shown to a tenant)"
    record = checkpoint_record(stats)
    state = str(record["state"])
    if state == "off":
        return "off"
    if state != "on":
        return f"{state} (a crash restart scans every header)"
    written = int(record["written"])
    since = format_bytes(int(record["bytes_since"]))
    if not written:
        return f"on, none written yet in this run ({since} written since start)"
    age = format_duration(float(record["age_s"]))
    return f"on, {written:,} written, the last {age} ago; {since} written since"


def _facts(stats: Stats) -> Table:
    """The daemon's counters, and its write-back and prefetch state, side by side."""
    leases = f"{_count(stats['leases'])} ({_plural(int(stats['leased_blocks']), 'block')})"
    daemon = _key_values(
        [
            ("daemon", f"kvtierd {stats['version']}"),
            ("uptime", format_duration(float(stats["uptime_s"]))),
            ("io backend", str(stats["io_backend"])),
            ("requests", _count(stats["requests"])),
            ("connections", _count(stats["connections"])),
            ("namespaces", _count(stats["namespaces"])),
            ("leases", leases),
            ("pending writes", _count(stats["pending_writes"])),
        ]
    )
    backlog = _key_values(
        [
            ("dirty backlog", _plural(int(stats["dirty_blocks"]), "block")),
            ("dirty bytes", format_bytes(int(stats["dirty_bytes"]))),
            ("durable", _plural(int(stats["durable_blocks"]), "block")),
            ("promotions", _count(stats["promotions"])),
            ("prefetch promoted", _count(stats["prefetch_promoted"])),
            ("prefetch used", _count(stats["prefetch_used"])),
            ("prefetch accuracy", format_ratio(prefetch_accuracy(stats))),
            ("prefetch wasted", format_bytes(int(stats["prefetch_wasted_bytes"]))),
        ]
    )
    side_by_side = Table.grid(padding=(0, 6))
    side_by_side.add_row(daemon, backlog)
    return side_by_side


def stats_view(stats: Stats) -> RenderableType:
    """``stats``: the tiers' space and traffic, then the daemon's counters."""
    return Group(
        _tier_table("space", stats, _SPACE),
        _BLANK,
        _tier_table("traffic", stats, _TRAFFIC),
        _BLANK,
        _facts(stats),
    )


def tenants_view(record: Mapping[str, Any]) -> RenderableType:
    """``stats --tenants``: one row per DRAM region's tenant (its namespaces, blocks and
    traffic are in ``--json``)."""
    tenants = record["tenants"]
    if not tenants:
        return Text("no tenants reported")
    table = Table(box=box.SIMPLE_HEAD, show_edge=False)
    table.add_column("tenant")
    for column in ("dram", "fill", "nvme", "hit%", "misses", "evicted"):
        table.add_column(column, justify="right", no_wrap=True)
    for t in tenants:
        table.add_row(
            _name(t["tenant"]),
            f"{format_bytes(int(t['dram_used_bytes']))} of "
            f"{format_bytes(int(t['dram_capacity_bytes']))}",
            format_ratio(t["dram_fill"]),
            format_bytes(int(t["nvme_used_bytes"])),
            format_ratio(t["hit_ratio"]),
            _count(t["misses"]),
            _count(t["dram_evictions"]),
        )
    return table


def top_state_line(state: TopState, socket: Path, reason: str | None) -> Text:
    """What ``top`` says while the daemon is away (``reason``: why, as the client said it)."""
    if state is TopState.STARTING:
        return Text(f"kvtierd {reason}", style="bold yellow")
    why = f" ({reason})" if reason else ""
    return Text(f"kvtierd restarting: waiting for {socket}{why}", style="bold yellow")


def top_view(stats: Stats, rates: Rates | None) -> RenderableType:
    """``top``: ``stats`` with the last interval's rates and hit ratios (``–`` until there are
    two samples of one daemon run)."""
    summary = Text(
        f"requests {_per_second(rates.requests if rates else None)}   "
        f"promotions {_per_second(rates.promotions if rates else None)}   "
        f"prefetch {_per_second(rates.prefetch_promoted if rates else None)}",
        style="bold",
    )
    return Group(
        summary,
        _BLANK,
        _tier_table("space", stats, _SPACE_RATES, rates),
        _BLANK,
        _tier_table("traffic", stats, _TRAFFIC_RATES, rates),
        _BLANK,
        _facts(stats),
    )


def namespaces_view(namespaces: Sequence[Mapping[str, Any]]) -> RenderableType:
    """``ls``: one row per namespace."""
    if not namespaces:
        return Text("no namespaces")
    table = Table(box=box.SIMPLE_HEAD, show_edge=False)
    table.add_column("id", justify="right", no_wrap=True)
    table.add_column("name")
    table.add_column("tenant")
    table.add_column("rank", no_wrap=True)
    for column in ("block size", "dram", "nvme"):
        table.add_column(column, justify="right", no_wrap=True)
    table.add_column("model")
    for ns in namespaces:
        layout = ns.get("layout")
        table.add_row(
            str(ns["ns"]),
            _name(ns["name"]),
            _name(ns["tenant"]),
            f"{ns['rank']}/{ns['world_size']}",
            format_bytes(int(ns["block_bytes"])),
            _count(ns["dram_blocks"]),
            _count(ns["nvme_blocks"]),
            _name(layout["model_id"]) if layout else _NONE,
        )
    return table


def keys_view(record: Mapping[str, Any]) -> RenderableType:
    """``ls --keys``: one page of keys (hex, as ``forget`` takes them), their tiers, size and
    write-back state, then how to ask for the next page."""
    ns = record["namespace"]
    title = (
        f"namespace {ns['ns']} {printable(ns['tenant'])}/{printable(ns['name'])} "
        f"(rank {ns['rank']}/{ns['world_size']})"
    )
    shown = len(record["keys"])
    head = Text(
        f"{title}: {_plural(int(record['blocks']), 'block')}, {shown:,} shown", overflow="ellipsis"
    )
    if not record["keys"]:
        return head
    table = Table(box=box.SIMPLE_HEAD, show_edge=False)
    table.add_column("key")
    for column in ("dram", "nvme", "pool"):
        table.add_column(column, justify="center", no_wrap=True)
    table.add_column("size", justify="right", no_wrap=True)
    table.add_column("state", no_wrap=True)
    for key in record["keys"]:
        tiers = key["tiers"]
        marks = ("●" if tier in tiers else "" for tier in ("dram", "nvme", "pool"))
        state = "dirty" if key["dirty"] else ("durable" if "nvme" in tiers else "clean")
        table.add_row(_name(key["key"]), *marks, format_bytes(int(key["raw_bytes"])), state)
    parts: list[RenderableType] = [head, table]
    if record["next_after"] is not None:
        # whole even past the edge (the terminal wraps it): it is there to be copied
        more = f"more: --after {record['next_after']}"
        parts.append(Text(more, style="dim", no_wrap=True, overflow="ignore"))
    return Group(*parts)


def namespace_stats_view(record: Mapping[str, Any]) -> RenderableType:
    """``stats --namespace``: one namespace's blocks per tier and its counters since start."""
    layout = record.get("layout")

    def blocks(field: str) -> str:
        text = _count(record[f"{field}_blocks"])
        tokens = record.get(f"{field}_tokens")
        return f"{text} ({int(tokens):,} tokens)" if tokens is not None else text

    rows = [
        ("namespace", f"{record['ns']}  {printable(record['tenant'])}/{printable(record['name'])}"),
        ("rank", f"{record['rank']}/{record['world_size']}"),
        ("block size", format_bytes(int(record["block_bytes"]))),
        ("model", printable(str(layout["model_id"])) if layout else _NONE),
        (
            "blocks",
            f"{_count(record['blocks'])} (dram {_count(record['dram_blocks'])}, "
            f"nvme {_count(record['nvme_blocks'])})",
        ),
        ("looked up", blocks("lookup")),
        ("hits", blocks("hit")),
        ("hit ratio", format_ratio(record["hit_ratio"])),
        ("read", f"{blocks('read')}, {format_bytes(int(record['read_bytes']))}"),
        ("committed", f"{blocks('committed')}, {format_bytes(int(record['committed_bytes']))}"),
    ]
    return _key_values(rows)
