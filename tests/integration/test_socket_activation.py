"""Socket activation: the daemon serves the listening socket systemd passes (``kvtierd.socket``),
and a connection made while it restarts waits in that socket's backlog and is served by the next
start, with no error. The harness passes the socket as systemd does (descriptor 3,
``LISTEN_FDS``, ``LISTEN_PID``: :class:`kvtierd.testing.DaemonProcess` ``listening=``)."""

from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvtierd.client import Reconnect, connect
from kvtierd.testing import DaemonProcess, activated_prefix

pytestmark = pytest.mark.timeout(180)

KEY = bytes(range(16))
#: An engine's policy: it waits out a start (INIT answered EAGAIN while the daemon starts).
POLICY = Reconnect(timeout_s=60.0)


def _listening(path: Path) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(str(path))
    sock.listen(64)
    return sock


@contextlib.contextmanager
def _activated(tmp_path: Path) -> Iterator[DaemonProcess]:
    """A daemon (not started) passed a listening socket at every start, as systemd would;
    killed and the socket closed at the end."""
    directory = tmp_path / "d"
    directory.mkdir()
    sock = _listening(directory / "kvtierd.sock")
    daemon = DaemonProcess(directory, listening=sock)
    try:
        yield daemon
    finally:
        daemon.kill()
        sock.close()


def test_a_connection_made_during_a_restart_is_served_by_the_next_start(tmp_path: Path) -> None:
    with _activated(tmp_path) as daemon:
        daemon.start()
        with connect(daemon.socket) as client:
            ns = client.namespace("kept", block_bytes=4096)
            ns.put([KEY], [b"\x07" * 4096])
            client.fsync()
        assert daemon.stop() == 0
        assert daemon.socket.is_socket()  # systemd's: left in place
        answers: list[object] = []

        def engine() -> None:  # connects while no daemon runs: waits in the backlog
            try:
                with connect(daemon.socket, client_name="waiting", reconnect=POLICY) as client:
                    ns = client.namespace("kept", block_bytes=4096)
                    answers.append(ns.lookup_tiers([KEY]))
            except Exception as exc:  # what the assertion shows
                answers.append(exc)

        waiting = threading.Thread(target=engine)
        waiting.start()
        waiting.join(1.0)
        assert waiting.is_alive()  # queued, not refused
        assert answers == []
        daemon.start()
        waiting.join(60)
        assert answers == [["nvme"]]  # served by the new daemon, what FSYNC kept
        assert daemon.log().count("passed by systemd (socket activation)") >= 2


def test_an_engine_connected_across_a_restart_sees_no_failed_request(tmp_path: Path) -> None:
    with _activated(tmp_path) as daemon:
        daemon.start()
        failures: list[BaseException] = []
        served = 0
        stop = threading.Event()
        with connect(daemon.socket, client_name="engine", reconnect=POLICY) as client:
            ns = client.namespace("steady", block_bytes=4096)

            def requests() -> None:
                nonlocal served
                for i in range(10_000):
                    if stop.is_set():
                        return
                    key = i.to_bytes(16, "big")
                    try:
                        ns.put([key], [bytes([i % 251]) * 4096])
                        assert ns.lookup([key]) == 1
                        served += 1
                    except BaseException as exc:  # any failed request fails the test
                        failures.append(exc)
                        return

            worker = threading.Thread(target=requests)
            worker.start()
            time.sleep(0.5)
            assert daemon.stop() == 0  # a restart under the engine's requests
            daemon.start()
            time.sleep(0.5)
            stop.set()
            worker.join(60)
            assert client.reconnects >= 1
        assert failures == []
        assert served > 0


def test_a_passed_socket_on_another_path_is_refused_saying_which(tmp_path: Path) -> None:
    other = _listening(tmp_path / "other.sock")
    wrapper = activated_prefix(other.fileno())
    result = subprocess.run(
        [*wrapper, sys.executable, "-m", "kvtierd", "--socket", str(tmp_path / "kvtierd.sock"),
         "--data-dir", str(tmp_path / "data"), "--dram-size", "32M", "--nvme-size", "0"],
        pass_fds=(other.fileno(),),
        env={**__import__("os").environ, "LISTEN_FDS": "1"},
        capture_output=True,
        text=True,
        timeout=60,
    )  # fmt: skip
    other.close()
    assert result.returncode == 2, result.stderr
    assert "kvtierd takes exactly one: a listening Unix stream socket on" in result.stderr
    assert "kvtierd.socket's ListenStream=" in result.stderr
