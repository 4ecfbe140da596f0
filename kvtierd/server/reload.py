"""SIGHUP: the configuration read again, the settings that can change live applied at once, the
others named as waiting for a restart (pure: which is which, and the configuration that
results).

A restart throws away what DRAM holds and drops the engines' connections, so what can change
without one should: the log level, how long an idle connection keeps its slot, how long a
stop waits for requests in flight, how fast the reuse model prefetches, which namespaces get
metric labels. Everything else (sizes, paths, listeners, limits that size memory or descriptor
budgets taken at start-up) is read once: a SIGHUP says which of those differ and that a restart
applies them, and runs on unchanged. ``kvtierctl config`` then shows what runs.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec

from kvtierd.config import Config
from kvtierd.config_render import Difference, differences

__all__ = ["LIVE_FIELDS", "Reload", "plan_reload"]

#: Fields a SIGHUP applies at once; every other waits for a restart.
LIVE_FIELDS = frozenset(
    {
        "daemon.log_level",
        "daemon.idle_timeout_s",
        "daemon.shutdown_grace_s",
        "daemon.metrics_namespaces",
        "daemon.metrics_namespace_limit",
        "dram.prefetch_bytes_per_s",
    }
)


@dataclass(frozen=True, slots=True)
class Reload:
    """What a SIGHUP does: the configuration to run from now on (the running one with the new
    values of the live fields), what it applied, and what waits for a restart."""

    config: Config
    applied: tuple[Difference, ...]
    held: tuple[Difference, ...]


def plan_reload(running: Config, read: Config) -> Reload:
    """The :class:`Reload` from ``running`` to the configuration just ``read``."""
    found = differences(running, read)
    applied = tuple(d for d in found if d.name in LIVE_FIELDS)
    config = running
    for d in applied:
        section, _, name = d.name.partition(".")
        table = msgspec.structs.replace(
            getattr(config, section), **{name: getattr(getattr(read, section), name)}
        )
        config = msgspec.structs.replace(config, **{section: table})
    return Reload(config, applied, tuple(d for d in found if d.name not in LIVE_FIELDS))
