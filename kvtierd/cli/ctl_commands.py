"""The ``kvtierctl`` commands: each connects to the daemon, asks, prints and returns a status.

Commands take the parsed command line (:class:`CommandOptions` fields) and raise
:class:`~kvtierd.errors.KvtierError` for anything the daemon refused or could not do, and
:class:`CommandError` for a request that names nothing the daemon has; :mod:`kvtierd.cli.ctl`
turns both into one line on stderr and exit status 1.

Results go to stdout, progress and live views to the terminal; ``--json`` prints exactly one
JSON document on stdout. ``flush`` uses the async client because it must ask two things at once
on one connection: FSYNC, which returns only when the backlog is durable, and STATFS every
``interval_s`` to drive its progress bar; the client pipelines both.
"""

from __future__ import annotations

import errno
import itertools
import json
import os
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
from rich.console import Console, Group, RenderableType
from rich.live import Live
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
    namespaces_record,
    not_ready_record,
    rates_between,
    stats_record,
    status_record,
)
from kvtierd.cli.ctl_views import (
    doctor_view,
    format_bytes,
    namespaces_view,
    stats_view,
    status_view,
    top_view,
)
from kvtierd.client import AsyncClient, Client, KvtierError, Layout, connect, connect_async

__all__ = [
    "CommandError",
    "CommandOptions",
    "NamespaceSelector",
    "connect_daemon",
    "doctor",
    "evict",
    "find_namespace",
    "flush",
    "flush_progress",
    "forget",
    "ls",
    "print_json",
    "show",
    "stats",
    "status",
    "top",
]


class CommandError(KvtierError):
    """The command names something the daemon does not have (exit status 1, like any daemon
    error). Never sent on the wire."""

    errno = errno.ENOENT


@dataclass(frozen=True, slots=True)
class CommandOptions:
    """What every command shares: where the daemon is and how to print."""

    socket: Path
    timeout_s: float | None
    json: bool
    console: Console
    error_console: Console


def connect_daemon(options: CommandOptions) -> Client:
    return connect(options.socket, client_name=_client_name(), timeout_s=options.timeout_s)


def _client_name() -> str:
    return f"kvtierctl/{__version__} pid {os.getpid()}"


def print_json(document: Any) -> None:
    """One JSON document on stdout; plain ``print`` so rich never restyles or wraps it."""
    sys.stdout.write(json.dumps(document, indent=2) + "\n")
    sys.stdout.flush()


# -- status, stats, ls -----------------------------------------------------------------------


def status(options: CommandOptions) -> int:
    """Whether the daemon answers; with ``--json`` a ``ready`` record even when it does not."""
    try:
        with connect_daemon(options) as client:
            record = client.stats()
    except KvtierError as exc:
        if not options.json:
            raise
        print_json(not_ready_record(options.socket, str(exc)))
        return 1
    return show(
        options,
        lambda: status_record(options.socket, record),
        lambda: status_view(options.socket, record),
    )


def stats(options: CommandOptions) -> int:
    with connect_daemon(options) as client:
        record = client.stats()
    return show(options, lambda: stats_record(record), lambda: stats_view(record))


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


# -- top ---------------------------------------------------------------------------------------


def top(options: CommandOptions, *, interval_s: float, iterations: int | None) -> int:
    """Refresh STATFS every ``interval_s`` until ``iterations`` samples or Ctrl-C (exit 0).

    On a terminal the view redraws in place; otherwise (a pipe, a log) every sample is printed
    in turn, so ``top --iterations N > file`` records N samples."""
    console = options.console
    header = Text(
        f"kvtierctl top: {options.socket}, every {interval_s:g}s (Ctrl-C quits)", style="dim"
    )
    with connect_daemon(options) as client:
        live = Live(console=console, auto_refresh=False) if console.is_terminal else None
        try:
            if live is not None:
                live.start()
            previous: Mapping[str, Any] | None = None
            for sample in itertools.count() if iterations is None else range(iterations):
                if sample:
                    time.sleep(interval_s)
                record = client.stats()
                rates = rates_between(previous, record) if previous is not None else None
                view: RenderableType = Group(header, top_view(record, rates))
                if live is not None:
                    live.update(view, refresh=True)
                else:
                    console.print(view)
                previous = record
        except KeyboardInterrupt:
            pass
        finally:
            if live is not None:
                live.stop()
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


@dataclass(frozen=True, slots=True)
class NamespaceSelector:
    """The identity options of ``forget``; ``None`` matches any value."""

    name: str
    tenant: str
    rank: int
    world_size: int
    block_bytes: int | None
    model_id: str | None

    def matches(self, info: Mapping[str, Any]) -> bool:
        layout = info.get("layout")
        return (
            info["name"] == self.name
            and info["tenant"] == self.tenant
            and info["rank"] == self.rank
            and info["world_size"] == self.world_size
            and self.block_bytes in (None, info["block_bytes"])
            and self.model_id in (None, layout["model_id"] if layout else None)
        )

    def describe(self) -> str:
        parts = [f"{self.name!r}", f"tenant {self.tenant!r}", f"rank {self.rank}/{self.world_size}"]
        if self.block_bytes is not None:
            parts.append(f"{self.block_bytes} bytes per block")
        if self.model_id is not None:
            parts.append(f"model {self.model_id!r}")
        return ", ".join(parts)


def find_namespace(
    namespaces: Sequence[Mapping[str, Any]], selector: NamespaceSelector
) -> Mapping[str, Any]:
    """The one listed namespace ``selector`` names; raises :class:`CommandError` otherwise.

    ``forget`` looks the namespace up instead of opening it from the options alone, because
    OPEN_NS creates what it does not find: a typo would make a new, empty namespace and forget
    nothing."""
    found = [info for info in namespaces if selector.matches(info)]
    if not found:
        raise CommandError(f"no namespace {selector.describe()} (see kvtierctl ls)")
    if len(found) > 1:
        raise CommandError(
            f"{len(found)} namespaces match {selector.describe()}; "
            "add --block-bytes or --model-id to choose one"
        )
    return found[0]


def forget(options: CommandOptions, *, selector: NamespaceSelector, keys: Sequence[bytes]) -> int:
    """Remove ``keys`` from every tier of the selected namespace."""
    with connect_daemon(options) as client:
        info = find_namespace(client.namespaces(), selector)
        layout = info.get("layout")
        namespace = client.namespace(
            str(info["name"]),
            block_bytes=int(info["block_bytes"]),
            # A Layout, not the listed dict: the client cannot convert a dict (array-like struct).
            layout=Layout(**layout) if layout else None,
            rank=int(info["rank"]),
            world_size=int(info["world_size"]),
            tenant=str(info["tenant"]),
        )
        forgotten = namespace.forget(keys)
    if options.json:
        print_json({"namespace": info["name"], "requested": len(keys), "forgotten": forgotten})
    else:
        options.console.print(
            f"forgot {forgotten:,} of {len(keys):,} keys from namespace {info['name']!r}"
        )
    return 0
