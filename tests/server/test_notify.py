"""sd_notify as systemd sees it: datagrams on a real AF_UNIX socket, path and abstract."""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvtierd.server.notify import Notifier, notify_address


@pytest.fixture
def listener(tmp_path: Path) -> Iterator[tuple[socket.socket, str]]:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    path = tmp_path / "notify.sock"
    sock.bind(str(path))
    sock.settimeout(5)
    yield sock, str(path)
    sock.close()


def test_messages_arrive_byte_exact(listener: tuple[socket.socket, str]) -> None:
    sock, path = listener
    notifier = Notifier({"NOTIFY_SOCKET": path})
    notifier.status("recovering")
    notifier.extend_timeout(12.5, "pre-faulting the arena, 1.0 of 4.0 GiB")
    notifier.ready("serving on /run/kvtierd/kvtierd.sock")
    notifier.stopping()
    assert [sock.recv(4096) for _ in range(4)] == [
        b"STATUS=recovering",
        b"EXTEND_TIMEOUT_USEC=12500000\nSTATUS=pre-faulting the arena, 1.0 of 4.0 GiB",
        b"READY=1\nSTATUS=serving on /run/kvtierd/kvtierd.sock",
        b"STOPPING=1\nSTATUS=stopping",
    ]


def test_abstract_socket() -> None:
    name = f"kvtierd-test-notify-{os.getpid()}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind(b"\0" + name.encode())
        sock.settimeout(5)
        assert notify_address({"NOTIFY_SOCKET": "@" + name}) == b"\0" + name.encode()
        assert Notifier({"NOTIFY_SOCKET": "@" + name}).send("READY=1")
        assert sock.recv(64) == b"READY=1"


def test_without_notify_socket_nothing_is_sent() -> None:
    notifier = Notifier({})
    assert notifier.address is None
    assert not notifier.send("READY=1")


def test_failures_are_logged_not_raised(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    notifier = Notifier({"NOTIFY_SOCKET": str(tmp_path / "missing.sock")})
    with caplog.at_level(logging.WARNING, logger="kvtierd"):
        notifier.ready("serving")
        notifier.send("WATCHDOG=1")
        notifier.send("WATCHDOG=1")  # logged once while it keeps failing
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(errors) == 1
    assert "READY=1" in errors[0].getMessage()
    assert "No such file" in errors[0].getMessage()
    assert len(warnings) == 1
    assert "WATCHDOG" in warnings[0].getMessage()


def test_watchdog_period_is_for_this_process_only() -> None:
    assert Notifier({"WATCHDOG_USEC": "30000000"}).watchdog_s == 30.0
    mine = {"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": str(os.getpid())}
    assert Notifier(mine).watchdog_s == 30.0
    other = {"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": str(os.getpid() + 1)}
    assert Notifier(other).watchdog_s == 0.0
    assert Notifier({"WATCHDOG_USEC": "junk"}).watchdog_s == 0.0
