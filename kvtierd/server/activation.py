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
children (NIXL exporters, probes) never see them.

systemd passes the descriptors of the service's file-descriptor store the same way, after the
socket's, each named by its ``FDNAME=``: those kvtierd stored (named ``kvtierd-dram-*``: the
DRAM kept across a restart, :mod:`kvtierd.server.fdstore`) are claimed by name, unchecked
here (the store checks them), and handed on by :func:`take_stored`.

Pure reading of the environment and the descriptors; the listener is made by
:func:`kvtierd.server.accepting.listen_unix`.
"""

from __future__ import annotations

import os
import re
import socket
import stat
from collections.abc import MutableMapping
from pathlib import Path

from kvtierd.errors import ConfigError
from kvtierd.server.fdstore import MAX_STORED, PREFIX

__all__ = [
    "LISTEN_FDS_START",
    "MAX_PASSED",
    "activated",
    "claim",
    "take_stored",
    "take_unix_listener",
]

#: The first descriptor systemd passes (``SD_LISTEN_FDS_START``).
LISTEN_FDS_START = 3
#: More descriptors than this passed is a mistake (kvtierd.socket passes one, the store at
#: most :data:`~kvtierd.server.fdstore.MAX_STORED`).
MAX_PASSED = 16 + MAX_STORED
_VARIABLES = ("LISTEN_PID", "LISTEN_FDS", "LISTEN_FDNAMES")
_COUNT = re.compile(r"[0-9]{1,4}")

#: The socket :func:`claim` took, until :func:`take_unix_listener` hands it on.
_claimed: socket.socket | None = None
#: The descriptors of kvtierd's own in the store, by name, until :func:`take_stored`.
_stored: dict[str, list[int]] = {}


def _passed(environ: MutableMapping[str, str]) -> int:
    """How many descriptors the environment says systemd passed to this process."""
    if environ.get("LISTEN_PID", "") != str(os.getpid()):
        return 0
    count = environ.get("LISTEN_FDS", "")
    return int(count) if _COUNT.fullmatch(count) else 0


def activated(environ: MutableMapping[str, str] | None = None) -> bool:
    """Whether this process serves a socket systemd passed (claimed, or still to claim)."""
    return _claimed is not None or _passed(os.environ if environ is None else environ) > 0


def claim(path: Path, environ: MutableMapping[str, str] | None = None) -> None:
    """Take the listening Unix socket on ``path`` that systemd passed, if it passed any, and
    remove the variables: first thing in the daemon's process, before it opens a descriptor of
    its own (a ``LISTEN_FDS`` larger than what was passed then names none of them). Nothing
    passed is ever closed here: what is not that socket is refused.

    Raises:
        ConfigError: more than :data:`MAX_PASSED`, a descriptor that is not open or not a
            socket, or sockets among which none listens on ``path`` (a ``ListenStream=`` that
            is not ``daemon.socket``).
    """
    global _claimed
    env = os.environ if environ is None else environ
    raw = env.get("LISTEN_FDS", "")
    count = _passed(env)
    names = env.get("LISTEN_FDNAMES", "").split(":")
    for name in _VARIABLES:
        env.pop(name, None)
    if raw and not count and _COUNT.fullmatch(raw) is None:
        raise ConfigError(f"LISTEN_FDS={raw!r} is not a count of descriptors")
    if count > MAX_PASSED:
        raise ConfigError(
            f"systemd passed {count} descriptors (LISTEN_FDS); kvtierd takes one socket, "
            f"and refuses more than {MAX_PASSED}"
        )
    seen = []
    sockets = 0
    for position, fd in enumerate(range(LISTEN_FDS_START, LISTEN_FDS_START + count)):
        name = names[position] if len(names) == count else ""
        if name.startswith(PREFIX):  # every one, a name given twice too (the store decides)
            try:
                os.set_inheritable(fd, False)
            except OSError as exc:
                raise ConfigError(
                    f"LISTEN_FDS={count} names descriptor {fd} ({name}), which is not open "
                    f"({exc.strerror})"
                ) from None
            _stored.setdefault(name, []).append(fd)
            continue
        sockets += 1
        try:
            mode = os.fstat(fd).st_mode
        except OSError as exc:
            raise ConfigError(
                f"LISTEN_FDS={count} names descriptor {fd}, which is not open ({exc.strerror})"
            ) from None
        if not stat.S_ISSOCK(mode):
            seen.append(f"descriptor {fd}: not a socket")
            continue
        sock = socket.socket(fileno=fd)
        bound = sock.getsockname()
        listening = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN)
        ours = (
            sock.family == socket.AF_UNIX
            and sock.type == socket.SOCK_STREAM
            and listening
            and bound == str(path)
        )
        if ours and _claimed is None:
            os.set_inheritable(fd, False)
            _claimed = sock
            continue
        seen.append(f"descriptor {fd}: {sock.family.name} {sock.type.name} on {bound!r}")
        sock.detach()  # systemd's to close, not ours
    if sockets and (_claimed is None or seen):
        raise ConfigError(
            f"systemd passed {count} descriptor(s), of which kvtierd takes exactly one: a "
            f"listening Unix stream socket on {path} (daemon.socket); "
            f"{'; '.join(seen) or 'none such'}: make kvtierd.socket's ListenStream= the "
            "daemon's socket"
        )


def take_stored() -> dict[str, list[int]]:
    """The descriptors kvtierd kept in systemd's store that :func:`claim` took, by name,
    handed on once (the caller closes them)."""
    taken = dict(_stored)
    _stored.clear()
    return taken


def take_unix_listener(
    path: Path, environ: MutableMapping[str, str] | None = None
) -> socket.socket | None:
    """The socket systemd passed for ``path`` (claimed now if :func:`claim` was not called),
    handed on once; ``None`` when none was passed."""
    global _claimed
    if _claimed is None:
        claim(path, environ)
    taken, _claimed = _claimed, None
    return taken
