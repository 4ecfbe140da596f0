"""The part of systemd a restart test needs, without PID 1: the notify socket and the service's
file-descriptor store.

:class:`ServiceManager` binds a datagram socket where ``$NOTIFY_SOCKET`` points and reads it in
a thread as systemd does: every message's ``KEY=value`` lines with the descriptors sent along
(``SCM_RIGHTS``). ``FDSTORE=1`` keeps them under their ``FDNAME=`` as systemd's
``service_add_fd_store`` does: up to ``fdstore_max`` (the unit's ``FileDescriptorStoreMax=``;
beyond it they are closed), a second descriptor of a file already kept dropped (the first
keeps its name), each new one put first (``LISTEN_FDNAMES`` lists the newest first);
``FDSTOREREMOVE=1`` drops those of a name, ``BARRIER=1`` closes its descriptor once every
message before it is handled. :class:`kvtierd.testing.DaemonProcess` ``manager=`` passes what is
stored to each start from descriptor 3 on, named in ``LISTEN_FDNAMES``, after the listening
socket when there is one: what systemd does for a restarted service.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from pathlib import Path

__all__ = ["ServiceManager"]

#: ``SCM_MAX_FD``: the most descriptors one message carries.
_MAX_FDS = 253


class ServiceManager:
    def __init__(self, directory: Path, *, fdstore_max: int = 80) -> None:
        self.path = directory / "notify.sock"
        self.fdstore_max = fdstore_max
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
        self._sock.bind(str(self.path))
        self._sock.settimeout(0.1)  # so that the thread sees close() soon
        self._closed = threading.Event()
        self._lock = threading.Lock()
        self._stored: list[tuple[str, int]] = []
        #: Every message received, as text, in order.
        self.messages: list[str] = []
        #: Descriptors refused because the store was full.
        self.refused = 0
        self._thread = threading.Thread(target=self._receive, name="notify", daemon=True)
        self._thread.start()

    def environment(self) -> dict[str, str]:
        """What systemd puts in the service's environment for these (``$FDSTORE`` as systemd
        254 and later set it)."""
        return {"NOTIFY_SOCKET": str(self.path), "FDSTORE": str(self.fdstore_max)}

    def stored(self) -> list[tuple[str, int]]:
        """What the store holds, ``(name, descriptor)`` in the order it came (the harness's
        descriptors: do not close them)."""
        with self._lock:
            return list(self._stored)

    def names(self) -> list[str]:
        return [name for name, _ in self.stored()]

    def names_after(self, count: int, timeout_s: float = 5.0) -> list[str]:
        """:meth:`names` once ``count`` messages have arrived in all (systemd handles them as
        they come: a test asks once the sender's have)."""
        deadline = time.monotonic() + timeout_s
        while len(self.messages) < count and time.monotonic() < deadline:
            time.sleep(0.01)
        return self.names()

    def close(self) -> None:
        self._closed.set()
        self._thread.join(5)
        self._sock.close()
        with self._lock:
            for _, fd in self._stored:
                os.close(fd)
            self._stored.clear()

    def __enter__(self) -> ServiceManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _receive(self) -> None:
        while not self._closed.is_set():
            try:
                data, fds, _, _ = socket.recv_fds(self._sock, 65536, _MAX_FDS)
            except TimeoutError:
                continue
            except OSError:
                return
            self._handle(data.decode(errors="replace"), fds)

    def _handle(self, text: str, fds: list[int]) -> None:
        fields = dict(line.partition("=")[::2] for line in text.split("\n") if line)
        with self._lock:
            self.messages.append(text)
            if fields.get("FDSTORE") == "1":
                name = fields.get("FDNAME", "stored")
                for fd in fds:
                    if len(self._stored) >= self.fdstore_max:
                        os.close(fd)
                        self.refused += 1
                    elif any(_same_file(fd, kept) for _, kept in self._stored):
                        os.close(fd)
                    else:
                        self._stored.insert(0, (name, fd))
                return
            if fields.get("FDSTOREREMOVE") == "1":
                name = fields.get("FDNAME", "")
                for stored_name, fd in self._stored:
                    if stored_name == name:
                        os.close(fd)
                self._stored = [(n, fd) for n, fd in self._stored if n != name]
        for fd in fds:  # a barrier's, or descriptors nobody asked to keep
            os.close(fd)


def _same_file(a: int, b: int) -> bool:
    first, second = os.fstat(a), os.fstat(b)
    return (first.st_dev, first.st_ino) == (second.st_dev, second.st_ino)
