"""``kvtierctl top``: STATFS every interval, over a connection that survives daemon restarts.

:class:`Sampler` owns the connection and the baseline. A sample either reads STATFS (state
``connected``, with the rates since the previous sample of the same daemon run) or says why it
could not: ``starting`` (the daemon answered with ``StartingError``) or ``restarting`` (the
connection broke, or nothing listens yet). Then the next sample connects again. A daemon whose
uptime went down restarted: its counters started again from zero, so the baseline is dropped
and rates show ``–`` for one interval. Before the daemon was ever seen, "not running" is the
answer as for every command (exit status 1), not something to wait for.

Rates come from :func:`~kvtierd.cli.ctl_records.rates_between` (pure), the drawing from
:mod:`kvtierd.cli.ctl_views`; this module only loops, samples and prints.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import sys
import time
from dataclasses import dataclass

from rich.console import Group, RenderableType
from rich.live import Live
from rich.text import Text

from kvtierd.cli.ctl_commands import CommandOptions, connect_daemon
from kvtierd.cli.ctl_records import Rates, Stats, TopState, rates_between, top_record
from kvtierd.cli.ctl_views import top_state_line, top_view
from kvtierd.client import Client, KvtierError
from kvtierd.errors import BrokenConnectionError, StartingError, TimedOutError

__all__ = ["Sample", "Sampler", "top"]


@dataclass(frozen=True, slots=True)
class Sample:
    """One refresh: the state, the last STATFS seen (``None`` before any) and the rates."""

    state: TopState
    stats: Stats | None
    rates: Rates | None
    reason: str | None = None


class Sampler:
    """STATFS on one connection, made again whenever it is lost."""

    def __init__(self, options: CommandOptions) -> None:
        self._options = options
        self._client: Client | None = None
        self._previous: Stats | None = None
        self._seen = False

    def sample(self) -> Sample:
        """Read STATFS, or say why not. Raises what ``connect`` raised while the daemon was
        never seen, and what is not a daemon going away (permission denied, a refusal)."""
        fresh = self._client is None
        try:
            if self._client is None:
                self._client = connect_daemon(self._options)
            record = self._client.stats()
        except StartingError as exc:
            self._seen = True
            self.close()
            return Sample(TopState.STARTING, self._previous, None, str(exc))
        except (BrokenConnectionError, TimedOutError) as exc:
            if not self._seen:
                raise
            self.close()
            return Sample(TopState.RESTARTING, self._previous, None, str(exc))
        self._seen = True
        own = 2 if fresh else 1  # this STATFS, and the INIT of a new connection
        rates = None
        if self._previous is not None:
            rates = rates_between(self._previous, record, own_requests=own)
        self._previous = record
        return Sample(TopState.CONNECTED, record, rates)

    def close(self) -> None:
        if self._client is not None:
            with contextlib.suppress(KvtierError, OSError):
                self._client.close()
            self._client = None


def _view(header: Text, sample: Sample, options: CommandOptions) -> RenderableType:
    parts: list[RenderableType] = [header]
    if sample.state is not TopState.CONNECTED:
        parts.append(top_state_line(sample.state, options.socket, sample.reason))
    if sample.stats is not None:
        parts.append(top_view(sample.stats, sample.rates))
    return Group(*parts)


def _print_line(sample: Sample, options: CommandOptions) -> None:
    record = top_record(sample.state, options.socket, sample.stats, sample.rates, sample.reason)
    sys.stdout.write(json.dumps(record) + "\n")
    sys.stdout.flush()


def top(options: CommandOptions, *, interval_s: float, iterations: int | None) -> int:
    """Sample every ``interval_s`` until ``iterations`` samples or Ctrl-C (exit status 0).

    On a terminal the view redraws in place; otherwise (a pipe, a log) every sample is printed
    in turn, so ``top --iterations N > file`` records N samples. ``--json``: one JSON object
    per sample and line."""
    console = options.console
    header = Text(
        f"kvtierctl top: {options.socket}, every {interval_s:g}s (Ctrl-C quits)", style="dim"
    )
    live = None
    if console.is_terminal and not options.json:
        live = Live(console=console, auto_refresh=False)
    sampler = Sampler(options)
    try:
        if live is not None:
            live.start()
        for n in itertools.count() if iterations is None else range(iterations):
            if n:
                time.sleep(interval_s)
            sample = sampler.sample()
            if options.json:
                _print_line(sample, options)
            elif live is not None:
                live.update(_view(header, sample, options), refresh=True)
            else:
                console.print(_view(header, sample, options))
    except KeyboardInterrupt:
        pass
    finally:
        if live is not None:
            live.stop()
        sampler.close()
    return 0
