"""systemd notification: READY, STATUS, EXTEND_TIMEOUT_USEC, STOPPING and the watchdog (and the
datagrams of the file-descriptor store, :mod:`kvtierd.server.fdstore`, which carry
descriptors).

The sd_notify protocol is one datagram of ``KEY=value`` lines to the ``AF_UNIX`` socket named by
``$NOTIFY_SOCKET`` (a leading ``@`` names an abstract socket); without that variable the daemon
does not run under ``Type=notify`` and every call does nothing. Failures are not swallowed: a
datagram that cannot be sent is logged with its errno (an error for READY=1, without which
systemd times the start out; a warning for the rest, once per kind of message until one gets
through again), never raised into the daemon.

With ``WatchdogSec=`` set in the unit, systemd exports ``WATCHDOG_USEC`` and kills a daemon that
stays silent that long; the keep-alive is sent from the event loop at half that period, so a
blocked loop is exactly what gets the daemon restarted.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Mapping, Sequence

import anyio

__all__ = ["Notifier", "notify_address"]

log = logging.getLogger("kvtierd")

#: How long one datagram may wait for room in the manager's queue.
SEND_TIMEOUT_S = 0.5


def notify_address(environ: Mapping[str, str]) -> str | bytes | None:
    """The address ``$NOTIFY_SOCKET`` names (bytes for an abstract socket), or ``None``."""
    name = environ.get("NOTIFY_SOCKET", "")
    if not name:
        return None
    if name.startswith("@"):
        return b"\0" + name[1:].encode()
    return name


class Notifier:
    def __init__(self, environ: Mapping[str, str] | None = None) -> None:
        env = os.environ if environ is None else environ
        self.address = notify_address(env)
        usec = env.get("WATCHDOG_USEC", "")
        pid = env.get("WATCHDOG_PID", "")
        mine = not pid or pid == str(os.getpid())
        self.watchdog_s = int(usec) / 1e6 if usec.isdigit() and mine else 0.0
        self._failing: set[str] = set()

    def send(self, message: str, fds: Sequence[int] = ()) -> bool:
        """Send one datagram, with ``fds`` as ``SCM_RIGHTS``; whether it was delivered
        (``False`` without ``$NOTIFY_SOCKET``)."""
        if self.address is None:
            return False
        kind = message.split("=", 1)[0]
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
                # A manager that stopped reading (its queue full) must not hold the loop or a
                # stop: the datagram is given up and logged, as any that cannot be sent.
                sock.settimeout(SEND_TIMEOUT_S)
                sock.connect(self.address)
                socket.send_fds(sock, [message.encode()], list(fds))
        except OSError as exc:
            if kind == "READY":
                log.error("cannot tell systemd READY=1 (NOTIFY_SOCKET %r): %s", self.address, exc)
            elif kind not in self._failing:
                log.warning(
                    "cannot send %s to systemd (NOTIFY_SOCKET %r): %s", kind, self.address, exc
                )
            self._failing.add(kind)
            return False
        self._failing.discard(kind)
        return True

    def status(self, text: str) -> None:
        self.send(f"STATUS={text}")

    def ready(self, text: str) -> None:
        self.send(f"READY=1\nSTATUS={text}")

    def extend_timeout(self, seconds: float, status: str) -> None:
        """Ask systemd for ``seconds`` more before its start (or stop) timeout fires."""
        self.send(f"EXTEND_TIMEOUT_USEC={max(1, int(seconds * 1e6))}\nSTATUS={status}")

    def stopping(self) -> None:
        self.send("STOPPING=1\nSTATUS=stopping")

    async def run_watchdog(self) -> None:
        """Send WATCHDOG=1 every half period until cancelled (returns at once without one)."""
        if not self.watchdog_s:
            return
        while True:
            self.send("WATCHDOG=1")
            await anyio.sleep(self.watchdog_s / 2)
