"""SIGHUP, for the daemon's whole life: each one reads the configuration again and applies
what can change live (:mod:`kvtierd.server.reload` decides what), in a task of its own.

The signal is received from before the store opens until the daemon's end, its stop included:
SIGHUP's default action would end the process without its clean stop (no write-back, no
snapshot: the next start a crash recovery). While the daemon starts or stops a SIGHUP is
logged and ignored. A reload reads the file in a worker thread (abandoned if the daemon stops
first), so a slow or stuck file system never holds the event loop; a SIGHUP during a reload
makes it run once more when it ends (an edit made meanwhile is not lost). Nothing a reload
meets ends the daemon: an invalid or unreadable file, or a bug while applying, is an ERROR
line and the configuration that ran goes on running.
"""

from __future__ import annotations

import logging
import signal
from collections.abc import Callable
from typing import Protocol

import anyio
from anyio.abc import TaskGroup

from kvtierd.config import Config, DaemonConfig
from kvtierd.errors import ConfigError
from kvtierd.server.readiness import DaemonPhase, Readiness
from kvtierd.server.reload import Reload

__all__ = ["Hangups", "Reloadable"]

log = logging.getLogger("kvtierd")

#: The live fields that decide the metrics' namespace labels (relabelled only when they change).
_LABEL_FIELDS = frozenset({"daemon.metrics_namespaces", "daemon.metrics_namespace_limit"})


class Reloadable(Protocol):
    """The serving daemon, as a reload sees it."""

    def reload(self, read: Config) -> Reload: ...


class Relabelling(Protocol):
    """The metrics, as a reload sees them."""

    def relabel(self, config: DaemonConfig) -> None: ...


class Hangups:
    """The daemon's SIGHUPs: :meth:`watch` runs for its whole life in ``tg``; :attr:`serving`
    is set once the daemon serves (before it, a SIGHUP is ignored)."""

    def __init__(
        self,
        tg: TaskGroup,
        readiness: Readiness,
        reread: Callable[[], Config] | None,
        metrics: Relabelling | None,
    ) -> None:
        self._tg = tg
        self._readiness = readiness
        self._reread = reread
        self._metrics = metrics
        self.serving: Reloadable | None = None
        self._reloading = anyio.Lock()
        self._again = False

    async def watch(self) -> None:
        """Start a reload for each SIGHUP, until cancelled (the daemon's end)."""
        with anyio.open_signal_receiver(signal.SIGHUP) as signals:
            async for _ in signals:
                self._hangup()

    def _hangup(self) -> None:
        if self._readiness.phase is DaemonPhase.STOPPING:
            log.warning("SIGHUP ignored: stopping")
        elif self.serving is None or self._reread is None:
            why = "still starting" if self._reread is not None else "no way to read it again"
            log.warning("SIGHUP ignored: %s", why)
        elif self._reloading.locked():
            self._again = True
        else:
            self._tg.start_soon(self._reload)

    async def _reload(self) -> None:
        async with self._reloading:
            while True:
                self._again = False
                await self._reload_once()
                if not self._again:
                    return

    async def _reload_once(self) -> None:
        assert self._reread is not None
        assert self.serving is not None
        try:
            read = await anyio.to_thread.run_sync(self._reread, abandon_on_cancel=True)
        except ConfigError as exc:
            log.error("SIGHUP: nothing changed, the configuration is invalid: %s", exc)
            return
        except Exception as exc:  # whatever a broken file does: the daemon serves on
            log.error("SIGHUP: nothing changed, the configuration is unreadable: %r", exc)
            return
        try:
            plan = self.serving.reload(read)
            if self._metrics is not None and any(d.name in _LABEL_FIELDS for d in plan.applied):
                self._metrics.relabel(plan.config.daemon)
        except Exception:  # a bug must cost the reload, never the daemon
            log.exception("SIGHUP: applying the configuration failed")
