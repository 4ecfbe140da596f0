"""Socket activation: the listening Unix socket systemd passes (``kvtierd.socket``), so that
engines' connections wait in its backlog while the daemon restarts or is upgraded, instead of
finding no socket.

systemd binds the socket of a ``.socket`` unit itself and keeps it across the service's
restarts; it passes it to each start as a descriptor from 3 on, saying so in the environment
(``sd_listen_fds(3)``): ``LISTEN_PID`` (the process they are for: a child that inherited the
environment must not take them), ``LISTEN_FDS`` (how many) and ``LISTEN_FDNAMES`` (their
``FileDescriptorName=``). A connection made while no daemon runs completes in the kernel and
waits for the next ``accept``; the engine's INIT is then answered once the new daemon serves
(its client's timeout permitting). The variables are removed once read, so the daemon's own
children (NIXL exporters, probes) never see them. Pure reading of the environment and the
descriptors; the listener is made by :func:`kvtierd.server.accepting.listen_unix`.
"""

from __future__ import annotations

import os
import socket
from collections.abc import MutableMapping
from pathlib import Path

from kvtierd.errors import ConfigError

__all__ = ["LISTEN_FDS_START", "activated", "take_unix_listener"]

#: The first descriptor systemd passes (``SD_LISTEN_FDS_START``).
LISTEN_FDS_START = 3
_VARIABLES = ("LISTEN_PID", "LISTEN_FDS", "LISTEN_FDNAMES")


def activated(environ: MutableMapping[str, str] | None = None) -> int:
    """How many descriptors systemd passed to this process (0: not socket-activated)."""
    env = os.environ if environ is None else environ
    if env.get("LISTEN_PID", "") != str(os.getpid()):
        return 0
    count = env.get("LISTEN_FDS", "")
    return int(count) if count.isdigit() else 0


def take_unix_listener(
    path: Path, environ: MutableMapping[str, str] | None = None
) -> socket.socket | None:
    """The passed socket listening on ``path`` (``None`` when systemd passed none), and the
    variables removed. The other passed descriptors are closed: nothing else is expected.

    Raises:
        ConfigError: sockets were passed, but none is a listening Unix stream socket bound to
            ``path`` (a ``ListenStream=`` that is not ``daemon.socket``).
    """
    env = os.environ if environ is None else environ
    count = activated(env)
    for name in _VARIABLES:
        env.pop(name, None)
    found: socket.socket | None = None
    seen = []
    for fd in range(LISTEN_FDS_START, LISTEN_FDS_START + count):
        try:
            sock = socket.socket(fileno=fd)
        except OSError as exc:  # not a socket
            seen.append(f"descriptor {fd}: {exc.strerror}")
            os.close(fd)
            continue
        bound = sock.getsockname()
        listening = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN)
        if (
            found is None
            and sock.family == socket.AF_UNIX
            and sock.type == socket.SOCK_STREAM
            and listening
            and bound == str(path)
        ):
            os.set_inheritable(fd, False)
            found = sock
            continue
        seen.append(f"descriptor {fd}: {sock.family.name} {sock.type.name} on {bound!r}")
        sock.close()
    if count and found is None:
        raise ConfigError(
            f"systemd passed {count} socket(s), none a listening Unix stream socket on "
            f"{path} (daemon.socket): {'; '.join(seen)}; make kvtierd.socket's ListenStream= "
            "the daemon's socket"
        )
    return found
