"""The descriptor budget (issue 31, item 2), on the real daemon under a low ``RLIMIT_NOFILE``.

Before it, idle connections that never sent a byte (on the Unix socket, on TCP before any
handshake, or on the metrics port, where each held a thread for ever) took descriptors until
the next accept failed with ``EMFILE`` and the daemon exited. Now each listener holds at most
its cap (``docs/operations.md``, "The descriptor budget") and closes the rest at once, and an
accept that fails for want of descriptors pauses and retries.

The daemon runs under ``prlimit --nofile=256``; the floods open several hundred idle
connections on every listener. Nothing asserts how long anything took: "eventually" is a
generous deadline.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

import pytest

from kvtierd.errors import BrokenConnectionError, BusyError, TimedOutError
from kvtierd.protocol import ClientConnection, ReplyReceived
from kvtierd.protocol.frames import PROTOCOL_VERSION
from kvtierd.protocol.messages import InitRequest
from kvtierd.testing import DaemonProcess, free_port
from tests.support.tls import (
    DEADLINE_S,
    Certificates,
    client_hello,
    tcp,
    unix_round_trip,
)

pytestmark = pytest.mark.timeout(300)

runtimes = pytest.mark.parametrize("runtime", ["asyncio", "trio"])

NOFILE = 256
FLOOD = 300  # idle connections per listener: past every cap, past the limit itself

T = TypeVar("T")


def _eventually(attempt: Callable[[], T], what: str) -> T:
    """``attempt()``'s result once it stops raising the errors of a full listener."""
    deadline = time.monotonic() + DEADLINE_S
    while True:
        try:
            return attempt()
        except (BusyError, BrokenConnectionError, TimedOutError, OSError) as exc:
            if time.monotonic() > deadline:
                raise AssertionError(f"{what} never succeeded: {exc!r}") from exc
            time.sleep(0.1)


def _health(port: int) -> int:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as reply:
        status: int = reply.status
        return status


def _config(certs: Certificates, tcp_port: int, metrics_port: int) -> str:
    return f"""
[daemon]
max_connections = 16
max_connections_per_uid = 8
handshake_timeout_s = 2.0
metrics_port = {metrics_port}
metrics_max_connections = 4
metrics_timeout_s = 1.0
""" + certs.remote_section(tcp_port, "max_handshakes = 16\nmax_connections = 4\n")


@contextlib.contextmanager
def _idle(count: int, open_one: Callable[[], socket.socket]) -> Iterator[list[socket.socket]]:
    """``count`` connections that send nothing (those refused at once included)."""
    sockets: list[socket.socket] = []
    try:
        for _ in range(count):
            with contextlib.suppress(OSError):  # a full backlog may refuse one: still a flood
                sockets.append(open_one())
        yield sockets
    finally:
        for sock in sockets:
            sock.close()


def _unix(path: Path) -> Callable[[], socket.socket]:
    def open_one() -> socket.socket:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.connect(str(path))
        return sock

    return open_one


def _start_capped(tmp_path: Path, runtime: str) -> tuple[Certificates, int, int, DaemonProcess]:
    """A daemon started under ``prlimit --nofile=NOFILE`` with a TLS and a metrics listener:
    its certificates, TCP port, metrics port and itself."""
    certs = Certificates.make(tmp_path / "tls")
    tcp_port, metrics_port = free_port(), free_port()
    daemon = DaemonProcess(
        tmp_path,
        config_text=_config(certs, tcp_port, metrics_port),
        runtime=runtime,
        command_prefix=["prlimit", f"--nofile={NOFILE}", "--"],
    )
    daemon.start(120)
    return certs, tcp_port, metrics_port, daemon


@runtimes
def test_floods_on_every_listener_leave_the_unix_socket_serving(
    tmp_path: Path, runtime: str
) -> None:
    certs, tcp_port, metrics_port, daemon = _start_capped(tmp_path, runtime)
    try:
        with (
            _idle(FLOOD, lambda: tcp(tcp_port)),
            _idle(FLOOD, lambda: socket.create_connection(("127.0.0.1", metrics_port))),
        ):
            # TCP and metrics floods take nothing from a local engine: served at once.
            unix_round_trip(daemon.socket, "during-the-tcp-flood")
            with _idle(FLOOD, _unix(daemon.socket)):
                # Its own uid's flood: the engine gets in once the silent ones time out in
                # INIT (daemon.handshake_timeout_s).
                _eventually(
                    lambda: unix_round_trip(daemon.socket, "during-the-unix-flood"),
                    "a local engine's round trip",
                )
            # The idle metrics connections time out (metrics_timeout_s): the port answers.
            assert _eventually(lambda: _health(metrics_port), "GET /health") == 200
            # The idle TCP connections time out in their handshake: a TLS client gets in.
            stats = _eventually(lambda: _tls_stats(certs, tcp_port), "a TLS client's STATFS")
            assert stats["scope"] == "tenant"
        assert daemon.running
        log = daemon.log()
        assert "Too many open files" not in log  # the caps held: no accept ever ran out
        assert "closing new ones at once" in log  # and they were reached
    finally:
        status = daemon.stop()
    assert status == 0, daemon.log()[-3000:]


def _tls_stats(certs: Certificates, port: int) -> dict[str, object]:
    with certs.connect(port) as client:
        return client.stats()


def _lowest_free_descriptor(pid: int) -> int:
    used = {int(fd) for fd in os.listdir(f"/proc/{pid}/fd")}
    return next(fd for fd in range(len(used) + 1) if fd not in used)


def _set_nofile(pid: int, soft: int) -> None:
    """The daemon's soft limit (its hard one stays :data:`NOFILE`)."""
    subprocess.run(["prlimit", "--pid", str(pid), f"--nofile={soft}:{NOFILE}"], check=True)


@runtimes
def test_accept_out_of_descriptors_pauses_and_serves_again(tmp_path: Path, runtime: str) -> None:
    """The daemon's limit lowered under it to exactly what it holds: every accept fails with
    EMFILE. It logs that (once), keeps running, and serves every listener once the limit is
    back."""
    certs, tcp_port, metrics_port, daemon = _start_capped(tmp_path, runtime)
    assert daemon.process is not None
    pid = daemon.process.pid
    try:
        _set_nofile(pid, _lowest_free_descriptor(pid))
        with (
            _idle(3, _unix(daemon.socket)),
            _idle(3, lambda: tcp(tcp_port)),
            _idle(3, lambda: socket.create_connection(("127.0.0.1", metrics_port))),
        ):
            deadline = time.monotonic() + DEADLINE_S
            while daemon.log().count("Too many open files") < 3:  # one per listener
                assert daemon.running, daemon.log()[-3000:]
                assert time.monotonic() < deadline, daemon.log()[-3000:]
                time.sleep(0.1)
            time.sleep(1.0)  # more failed accepts, which the log holds back
            assert daemon.running
            _set_nofile(pid, NOFILE)
            unix_round_trip(daemon.socket, "after-emfile")
            assert _eventually(lambda: _health(metrics_port), "GET /health") == 200
            assert _tls_stats(certs, tcp_port)["scope"] == "tenant"
        log = daemon.log()
        assert log.count("cannot accept on the Unix socket") == 1, log[-3000:]
        assert log.count("cannot accept on the metrics port") == 1, log[-3000:]
        assert log.count(f"cannot accept on TCP 127.0.0.1:{tcp_port}") == 1, log[-3000:]
    finally:
        status = daemon.stop()
    assert status == 0, daemon.log()[-3000:]


def test_a_budget_beyond_the_hard_limit_refuses_to_start(tmp_path: Path) -> None:
    """The defaults (256 + 32 Unix connections and the daemon's own) do not fit 200."""
    args = ["--socket", str(tmp_path / "s.sock"), "--data-dir", str(tmp_path / "data")]
    command = ["prlimit", "--nofile=200", "--", sys.executable, "-m", "kvtierd", *args]
    check = subprocess.run([*command, "--check"], capture_output=True, text=True, timeout=120)
    assert check.returncode == 2, check.stdout
    assert "fail      nofile    the descriptor budget (288 Unix" in check.stdout
    assert "exceeds RLIMIT_NOFILE 200" in check.stdout
    start = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert start.returncode == 2, start.stderr
    assert "exceeds RLIMIT_NOFILE 200" in start.stderr
    assert not (tmp_path / "s.sock").exists()


def test_a_soft_limit_below_the_budget_is_raised(tmp_path: Path) -> None:
    """Soft 300, hard 1024: the daemon raises its soft limit to its budget and serves."""
    daemon = DaemonProcess(tmp_path, command_prefix=["prlimit", "--nofile=300:1024", "--"])
    daemon.start(120)
    try:
        assert daemon.process is not None
        limits = Path(f"/proc/{daemon.process.pid}/limits").read_text()
        line = next(line for line in limits.splitlines() if line.startswith("Max open files"))
        assert line.split()[3:5] == ["384", "1024"], line  # 256 + 32 + 96
        unix_round_trip(daemon.socket, "raised")
    finally:
        daemon.stop()


def test_the_metrics_port_closes_its_oldest_silent_connection_for_a_new_one(
    tmp_path: Path,
) -> None:
    """Two silent connections fill ``metrics_max_connections = 2``: a third connection that
    sends its request is answered, and the oldest silent one is closed for it (before, the
    third was closed unanswered: what made a slowloris flood fail the liveness probe)."""
    port = free_port()
    config = f"[daemon]\nmetrics_port = {port}\nmetrics_max_connections = 2\n"
    config += "metrics_request_timeout_s = 60.0\n"  # only the eviction can close them
    with DaemonProcess(tmp_path, config_text=config) as daemon:
        with _idle(2, lambda: socket.create_connection(("127.0.0.1", port))) as silent:
            for sock in silent:
                sock.settimeout(DEADLINE_S)
                sock.sendall(b"GET /hea")  # accepted in order, still sending its request
            assert _health(port) == 200
            with contextlib.suppress(ConnectionResetError):
                assert silent[0].recv(1024) == b""  # the oldest: closed unanswered
        assert "closing the oldest for each new one" in daemon.log()
        assert daemon.running


# -- one remote client, one remote host ----------------------------------------------------


@runtimes
def test_one_remote_client_cannot_take_every_remote_session(tmp_path: Path, runtime: str) -> None:
    """Before ``remote.max_connections_per_uid``, one certificate's idle sessions took all of
    ``remote.max_connections`` (the daemon's per-uid cap, 64, was as large): another tenant's
    engine got ``EBUSY`` until ``idle_timeout_s``. Now one uid holds a quarter of them (2 of
    8) and the others stay open to the other clients."""
    certs = Certificates.make(tmp_path / "tls")
    port = free_port()
    config = certs.remote_section(port, "max_connections = 8\n")
    daemon = DaemonProcess(tmp_path, config_text=config, runtime=runtime)
    daemon.start(120)
    held = []
    try:
        refused = None
        for _ in range(8):  # as many as it is given, up to every remote session
            try:
                held.append(certs.connect(port))
            except BusyError as exc:
                refused = exc
                break
        assert len(held) == 2, f"one client holds {len(held)} of 8 remote sessions"
        assert refused is not None
        assert "from uid 2001 over TCP" in str(refused)
        for _ in range(3):  # the other client gets in, again and again
            with certs.connect(port, "second") as other:
                assert other.stats()["scope"] == "tenant"
        assert held[0].stats()["scope"] == "tenant"  # the first client's sessions serve on
    finally:
        for client in held:
            client.close()
        status = daemon.stop()
    assert status == 0, daemon.log()[-3000:]


def _init_from(certs: Certificates, port: int, source: str) -> None:
    """A listed TLS client connecting from ``source`` (its socket bound to it): the TLS
    handshake, then INIT answered without an error."""
    context = certs.client_context()
    with tcp(port, source) as raw, context.wrap_socket(raw, server_hostname="127.0.0.1") as tls:
        conn = ClientConnection()
        _, frame = conn.request(InitRequest(PROTOCOL_VERSION, 8, 1 << 20))
        tls.sendall(frame)
        while True:
            data = tls.recv(1 << 16)
            assert data, "the daemon closed the connection instead of answering INIT"
            conn.receive_data(data)
            event = conn.next_event()
            if isinstance(event, ReplyReceived):
                assert event.error is None, event.error
                return


def _closed_at_once(port: int) -> bool:
    """Whether a connection from 127.0.0.1 that sends a ClientHello is closed unanswered."""
    with tcp(port) as sock:
        sock.sendall(client_hello())
        try:
            return sock.recv(1 << 16) == b""
        except ConnectionResetError:
            return True


@runtimes
def test_one_host_cannot_take_every_handshake_slot(tmp_path: Path, runtime: str) -> None:
    """Before ``remote.max_handshakes_per_host``, 40 connections from one host trickling a
    ClientHello (no certificate needed) held all of ``remote.max_handshakes`` (32), shared by
    every source address, and a good client's connection was closed at once. Now one host holds
    8, past which its own are closed at once, and a client from another address (127.0.0.2)
    shakes hands and is served."""
    certs = Certificates.make(tmp_path / "tls")
    port = free_port()
    config = "[daemon]\nhandshake_timeout_s = 60.0\n" + certs.remote_section(port)
    daemon = DaemonProcess(tmp_path, config_text=config, runtime=runtime)
    daemon.start(120)
    try:
        hello = client_hello()
        with _idle(40, lambda: tcp(port)) as flood:
            for sock in flood:  # a trickle of a ClientHello: the handshake has begun
                with contextlib.suppress(OSError):
                    sock.send(hello[:1])
            # the flood is held: 127.0.0.1's next connection is closed at once
            assert _eventually(lambda: _closed_at_once(port) or _raise(), "a full host")
            for _ in range(3):
                _init_from(certs, port, "127.0.0.2")
            assert daemon.running
        log = daemon.log()
        assert "(its cap per host): closing new ones from it at once" in log, log[-3000:]
    finally:
        status = daemon.stop()
    assert status == 0, daemon.log()[-3000:]


def _raise() -> bool:
    raise OSError("not yet")


@pytest.mark.parametrize(
    ("caps", "where"),
    [
        ("max_connections_per_uid = 64\n", "remote.max_connections_per_uid: 64 is not below"),
        ("max_connections = 1\n", "remote.max_connections_per_uid: 1 is not below"),
        ("max_handshakes = 8\n", "remote.max_handshakes_per_host: 8 is not below"),
    ],
)
def test_a_per_peer_cap_not_below_its_listeners_refuses_to_start(
    tmp_path: Path, caps: str, where: str
) -> None:
    """One client or one host allowed a whole listener's cap is a configuration error."""
    certs = Certificates.make(tmp_path / "tls")
    config = tmp_path / "kvtierd.toml"
    config.write_text(certs.remote_section(free_port(), caps))
    args = ["--config", str(config), "--socket", str(tmp_path / "s.sock")]
    command = [sys.executable, "-m", "kvtierd", *args, "--data-dir", str(tmp_path / "data")]
    start = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert start.returncode == 2, start.stderr
    assert where in start.stderr
