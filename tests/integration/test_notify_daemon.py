"""What a real daemon tells systemd: the datagrams on ``$NOTIFY_SOCKET`` from start to stop, and
a notify socket that cannot be reached logged, not swallowed, while the daemon serves on."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvtierd.client import connect
from kvtierd.testing import DaemonProcess

KINDS = {"STATUS", "READY", "STOPPING", "WATCHDOG", "EXTEND_TIMEOUT_USEC"}


@pytest.fixture
def notify_socket(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[socket.socket]:
    """A datagram socket where systemd's would be, named in the environment the daemon gets."""
    path = tmp_path / "notify.sock"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(path))
    sock.settimeout(30)
    monkeypatch.setenv("NOTIFY_SOCKET", str(path))
    monkeypatch.setenv("WATCHDOG_USEC", "400000")  # a keep-alive every 0.2 s
    monkeypatch.delenv("WATCHDOG_PID", raising=False)
    yield sock
    sock.close()


def _receive_until(sock: socket.socket, last: bytes) -> list[bytes]:
    """Every datagram up to and including ``last`` (each one checked to be sd_notify lines)."""
    out: list[bytes] = []
    while not out or out[-1] != last:
        message = sock.recv(4096)
        for line in message.decode().split("\n"):
            key, sep, _ = line.partition("=")
            assert sep, message
            assert key in KINDS, message
        out.append(message)
    return out


@pytest.mark.parametrize("runtime", ["asyncio", "trio"])
def test_daemon_notifies_systemd_from_start_to_stop(
    tmp_path: Path, notify_socket: socket.socket, runtime: str
) -> None:
    daemon = DaemonProcess(tmp_path / "d", runtime=runtime).start()
    try:
        ready = f"READY=1\nSTATUS=serving on {daemon.socket}".encode()
        before = _receive_until(notify_socket, ready)
        assert before[0].startswith(b"STATUS=starting: "), before
        assert before.count(ready) == 1
        # The keep-alive goes on while serving, from the event loop.
        assert _receive_until(notify_socket, b"WATCHDOG=1")[-1] == b"WATCHDOG=1"
        with connect(daemon.socket) as client:
            assert client.stats()["io_backend"]
        assert daemon.stop() == 0
        after = _receive_until(notify_socket, b"STOPPING=1\nSTATUS=stopping")
        assert not any(m.startswith(b"READY=") for m in after), after
    finally:
        daemon.kill()


def test_unreachable_notify_socket_is_logged_once_per_kind(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    missing = tmp_path / "no-such-dir" / "notify.sock"
    monkeypatch.setenv("NOTIFY_SOCKET", str(missing))
    monkeypatch.setenv("WATCHDOG_USEC", "100000")  # a keep-alive every 0.05 s, each one failing
    monkeypatch.delenv("WATCHDOG_PID", raising=False)
    daemon = DaemonProcess(tmp_path / "d").start()
    try:
        with connect(daemon.socket) as client:
            assert client.stats()["io_backend"]
        time.sleep(1)  # many keep-alives fail meanwhile; the daemon goes on serving
        with connect(daemon.socket) as client:
            assert client.stats()["io_backend"]
        assert daemon.stop() == 0
    finally:
        daemon.kill()
    lines = daemon.log().splitlines()
    errors = [line for line in lines if " ERROR " in line]
    assert len(errors) == 1, errors
    assert "cannot tell systemd READY=1" in errors[0]
    assert str(missing) in errors[0]
    assert "No such file or directory" in errors[0]
    warned = [line for line in lines if "cannot send" in line and " WARNING " in line]
    # STATUS, WATCHDOG and STOPPING: one line each however often they were sent; FDSTORE: the
    # stop tried to hand the DRAM over (and gave up at the first datagram refused).
    assert sorted(line.split("cannot send ")[1].split()[0] for line in warned) == [
        "FDSTORE",
        "STATUS",
        "STOPPING",
        "WATCHDOG",
    ]
    assert "stopped cleanly" in daemon.log()
