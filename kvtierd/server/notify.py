"""systemd notification: READY, STATUS, STOPPING and the watchdog keep-alive.

Uses the ``sdnotify`` package, which writes to ``$NOTIFY_SOCKET`` and does nothing when the
daemon does not run under systemd. With ``WatchdogSec=`` set in the unit, systemd exports
``WATCHDOG_USEC`` and kills a daemon that stays silent that long; the keep-alive is sent from
the event loop at half that period, so a blocked loop is exactly what gets the daemon restarted.
"""

from __future__ import annotations

import os

import anyio
import sdnotify

__all__ = ["Notifier"]


class Notifier:
    def __init__(self) -> None:
        self._notifier = sdnotify.SystemdNotifier()
        usec = os.environ.get("WATCHDOG_USEC", "")
        pid = os.environ.get("WATCHDOG_PID", "")
        mine = not pid or pid == str(os.getpid())
        self.watchdog_s = int(usec) / 1e6 if usec.isdigit() and mine else 0.0

    def status(self, text: str) -> None:
        self._notifier.notify(f"STATUS={text}")

    def ready(self, text: str) -> None:
        self._notifier.notify(f"READY=1\nSTATUS={text}")

    def stopping(self) -> None:
        self._notifier.notify("STOPPING=1\nSTATUS=stopping")

    async def run_watchdog(self) -> None:
        """Send WATCHDOG=1 every half period until cancelled (returns at once without one)."""
        if not self.watchdog_s:
            return
        while True:
            self._notifier.notify("WATCHDOG=1")
            await anyio.sleep(self.watchdog_s / 2)
