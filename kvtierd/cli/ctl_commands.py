"""The ``kvtierctl`` commands: each connects to the daemon, asks, prints and returns a status.

Commands take the parsed command line (:class:`CommandOptions` fields) and raise
:class:`~kvtierd.errors.KvtierError` for anything the daemon refused or could not do;
:mod:`kvtierd.cli.ctl` turns it into one line on stderr (with ``--json``, a JSON document on
stdout) and an exit status. ``top`` is :mod:`kvtierd.cli.ctl_top`; the per-namespace commands
are :mod:`kvtierd.cli.ctl_namespaces`.

Results go to stdout, progress and live views to the terminal; ``--json`` prints exactly one
JSON document on stdout. Whether stdout is a terminal is decided once, by
:func:`stdout_console`: a terminal gets rich's colours and its width, a pipe or a file plain
lines as wide as they need, without colour, escape codes or trailing blanks.

``flush`` uses the async client because it must ask two things at once on one connection:
FSYNC, which returns only when the backlog is durable, and STATFS every ``interval_s`` to drive
its progress bar; the client pipelines both.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, TextIO, cast

import anyio
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    SpinnerColumn,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
)
from rich.text import Text

from kvtierd import __version__
from kvtierd.cli.ctl_records import (
    DaemonHealth,
    config_record,
    config_text,
    namespaces_record,
    not_ready_record,
    stats_record,
    status_record,
    tenants_record,
)
from kvtierd.cli.ctl_views import (
    doctor_view,
    format_bytes,
    namespaces_view,
    stats_view,
    status_view,
    tenants_view,
)
from kvtierd.client import AsyncClient, Client, KvtierError, connect, connect_async
from kvtierd.client.ops import TENANTS_MINOR, require_minor
from kvtierd.errors import (
    AccessDeniedError,
    BrokenConnectionError,
    StartingError,
)

__all__ = [
    "CommandOptions",
    "configuration",
    "connect_daemon",
    "doctor",
    "evict",
    "flush",
    "flush_progress",
    "ls",
    "print_json",
    "show",
    "stats",
    "status",
    "stdout_console",
    "tenant_stats",
]


@dataclass(frozen=True, slots=True)
class CommandOptions:
    """What every command shares: where the daemon is and how to print."""

    socket: Path
    timeout_s: float | None
    json: bool
    console: Console
    error_console: Console


#: How wide kvtierctl lays out what it prints when stdout is not a terminal: wider than any line
#: it prints, so that a row is always one line for grep, cut and awk.
PIPE_WIDTH = 4096


def stdout_console(stream: TextIO) -> Console:
    """The console results are printed on, for ``stream`` (stdout).

    On a terminal, rich decides as usual (colour, the terminal's width, ``FORCE_COLOR``).
    Anywhere else: no colour or escape codes whatever the environment says, a layout
    :data:`PIPE_WIDTH` wide that neither wraps nor pads to ``$COLUMNS``, and no blanks at the
    end of a line (rich pads each table row to the table's width)."""
    # Never markup, emoji codes or highlighting in what is printed: names come from clients,
    # and "[/x]" or ":smile:" in one must print as it is (the views style with Text, not markup).
    plain = {"markup": False, "emoji": False, "highlight": False}
    if stream.isatty():
        return Console(file=stream, **plain)  # type: ignore[arg-type]
    trimmed = cast(IO[str], _TrimmedLines(stream))  # rich only writes, flushes and asks isatty
    return Console(
        file=trimmed,
        width=PIPE_WIDTH,
        color_system=None,
        force_terminal=False,
        soft_wrap=True,
        **plain,  # type: ignore[arg-type]
    )


class _TrimmedLines:
    """A text stream that passes on what is written, less the blanks that end each line. Blanks
    at the end of a write are held back until the next write shows whether a line ends there."""

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream
        self._blanks = ""

    @property
    def encoding(self) -> str:
        return getattr(self._stream, "encoding", None) or "utf-8"

    def isatty(self) -> bool:
        return False

    def write(self, text: str) -> int:
        *ended, last = (self._blanks + text).split("\n")
        kept = last.rstrip(" ")
        self._blanks = last[len(kept) :]
        self._stream.write("\n".join([*(line.rstrip(" ") for line in ended), kept]))
        return len(text)

    def flush(self) -> None:
        self._stream.flush()


def connect_daemon(options: CommandOptions) -> Client:
    """A connection to the daemon; a socket reset during INIT (a daemon that closed a refused
    connection before reading it) is ``BrokenConnectionError``, like any lost connection."""
    try:
        return connect(options.socket, client_name=_client_name(), timeout_s=options.timeout_s)
    except (KvtierError, TimeoutError):
        raise
    except OSError as exc:
        raise BrokenConnectionError(f"connection to kvtierd lost: {exc}") from exc


def _client_name() -> str:
    return f"kvtierctl/{__version__} pid {os.getpid()}"


def print_json(document: Any) -> None:
    """One JSON document on stdout; plain ``print`` so rich never restyles or wraps it."""
    sys.stdout.write(json.dumps(document, indent=2) + "\n")
    sys.stdout.flush()


# -- status, stats, ls -----------------------------------------------------------------------


#: ``status``'s exit status while the daemon starts (0 ready, 1 not running or failed).
STARTING_STATUS = 3
#: ``status``'s exit status while the daemon serves degraded: a configured pool not attached,
#: or its disk tier failing.
DEGRADED_STATUS = 4


def status(options: CommandOptions) -> int:
    """Whether the daemon answers and how well it serves: 0 ready, 4 degraded, 3 starting, 1
    not running; with ``--json`` a ``ready`` record in every case."""
    try:
        with connect_daemon(options) as client:
            record = client.stats()
            health = daemon_health(client)
    except StartingError as exc:
        phase = str(exc).removeprefix("starting: ")
        if options.json:
            print_json(not_ready_record(options.socket, str(exc), starting=True))
        else:
            options.console.print(
                Text.assemble(("◐ ", "bold yellow"), f"kvtierd is starting ({phase})"),
                f"socket  {options.socket}",
                sep="\n",
            )
        return STARTING_STATUS
    except KvtierError as exc:
        if not options.json:
            raise
        print_json(not_ready_record(options.socket, str(exc)))
        return 1
    show(
        options,
        lambda: status_record(options.socket, record, health),
        lambda: status_view(options.socket, record, health),
    )
    return DEGRADED_STATUS if health.degraded else 0


def daemon_health(client: Client) -> DaemonHealth:
    """The pool's state (POOL_STATUS, anyone may ask) and the disk tier's (the DOCTOR report's
    ``nvme`` line, for the daemon's user and root only: ``None`` for anyone else)."""
    pool = client.pool_status()
    try:
        checks = client.doctor()
    except AccessDeniedError:
        disk_failing = None
    else:
        failed = (c["detail"] for c in checks if c["subject"] == "nvme" and c["status"] == "fail")
        disk_failing = next(failed, "")
    return DaemonHealth(str(pool["state"]), str(pool.get("reason", "")), disk_failing)


def stats(options: CommandOptions) -> int:
    with connect_daemon(options) as client:
        record = client.stats()
    return show(options, lambda: stats_record(record), lambda: stats_view(record))


def tenant_stats(options: CommandOptions) -> int:
    """``stats --tenants``: one row per DRAM region's tenant (its blocks, fill, hits, misses,
    evictions and traffic); the caller's own tenants only, unless it is the daemon's user or
    root."""
    with connect_daemon(options) as client:
        record = client.stats()
        minor = client.daemon_minor
    require_minor(minor, TENANTS_MINOR, "per-tenant figures need")
    tenants = tenants_record(record)
    return show(options, lambda: tenants, lambda: tenants_view(tenants))


def configuration(options: CommandOptions, *, effective: bool) -> int:
    """``config``: the running daemon's configuration (admin), the fields that differ from the
    defaults as TOML (``effective``: every field), after a comment saying where it came from
    and its digest."""
    with connect_daemon(options) as client:
        record = client.configuration()
    if options.json:
        print_json(config_record(record))
        return 0
    print(config_text(record, effective=effective), end="")
    return 0


def ls(options: CommandOptions) -> int:
    with connect_daemon(options) as client:
        namespaces = client.namespaces()
    return show(options, lambda: namespaces_record(namespaces), lambda: namespaces_view(namespaces))


def doctor(options: CommandOptions) -> int:
    """The running daemon's report on its host; exit status 1 if a check failed."""
    with connect_daemon(options) as client:
        checks = client.doctor()
    show(options, lambda: checks, lambda: doctor_view(checks))
    return int(any(check["status"] == "fail" for check in checks))


def show(options: CommandOptions, record: Callable[[], Any], view: Callable[[], Any]) -> int:
    """Print the JSON record with ``--json``, else the rich view; exit status 0."""
    if options.json:
        print_json(record())
    else:
        options.console.print(view())
    return 0


# -- flush, evict, forget ----------------------------------------------------------------------


def flush(options: CommandOptions, *, interval_s: float) -> int:
    """FSYNC with a progress bar over the dirty backlog; prints the durable block count."""
    durable, flushed = anyio.run(_flush, options, interval_s, backend="asyncio")
    if options.json:
        print_json({"durable_blocks": durable, "flushed_blocks": flushed})
    else:
        done = f"flushed {flushed:,} dirty blocks" if flushed else "nothing to flush"
        options.console.print(f"{done}; {durable:,} blocks are durable on disk")
    return 0


def flush_progress(console: Console) -> Progress:
    """The bar ``flush`` draws on ``console`` (none unless it is a terminal)."""
    return Progress(
        SpinnerColumn(),
        TextColumn("[progress.description]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[dirty]}"),
        TimeElapsedColumn(),
        console=console,
        disable=not console.is_terminal,
    )


async def _flush(options: CommandOptions, interval_s: float) -> tuple[int, int]:
    progress = flush_progress(options.error_console)
    async with connect_async(options.socket, client_name=_client_name()) as client:
        with anyio.fail_after(options.timeout_s):
            before = await client.stats()
        backlog = _Backlog(progress, int(before["dirty_blocks"]), int(before["dirty_bytes"]))
        with progress:
            async with anyio.create_task_group() as tg:
                tg.start_soon(backlog.follow, client, interval_s, options.timeout_s)
                durable = await client.fsync()
                tg.cancel_scope.cancel()
            backlog.finish()
    return durable, backlog.total


class _Backlog:
    """The progress bar's model: ``total`` is the largest backlog seen, done is what left it."""

    def __init__(self, progress: Progress, dirty_blocks: int, dirty_bytes: int) -> None:
        self.progress = progress
        self.total = dirty_blocks
        self.task: TaskID = progress.add_task("flushing", total=dirty_blocks, dirty="")
        self.update(dirty_blocks, dirty_bytes)

    def update(self, dirty_blocks: int, dirty_bytes: int) -> None:
        self.total = max(self.total, dirty_blocks)
        self.progress.update(
            self.task,
            total=self.total,
            completed=self.total - dirty_blocks,
            dirty=f"{format_bytes(dirty_bytes)} dirty",
        )

    async def follow(self, client: AsyncClient, interval_s: float, timeout_s: float | None) -> None:
        while True:
            await anyio.sleep(interval_s)
            with anyio.fail_after(timeout_s):
                record = await client.stats()
            self.update(int(record["dirty_blocks"]), int(record["dirty_bytes"]))

    def finish(self) -> None:
        self.progress.update(self.task, description="durable", completed=self.total, dirty="")


def evict(options: CommandOptions) -> int:
    """Drop the DRAM copies of every clean, unleased block of every namespace."""
    with connect_daemon(options) as client:
        evicted = client.evict()
    if options.json:
        print_json({"evicted_blocks": evicted})
    else:
        options.console.print(f"evicted {evicted:,} clean blocks from DRAM")
    return 0
