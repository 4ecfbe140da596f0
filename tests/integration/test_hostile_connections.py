"""A connection's failure ends that connection only (issue 31, items 1 and 6), on the real
daemon listening on TCP with real TLS (``remote.listen``) and on its Unix socket.

Before these, one TCP connection closed before or during the TLS handshake stopped the daemon
(``anyio.EndOfStream`` escaped the handshake into the sessions' task group: exit status 1).
Each test below does to the TCP listener what a port scanner, a load balancer's health check or
a broken client does, then proves the daemon still serves a local engine (PUT and LOOKUP on the
Unix socket) and a good TLS client. One daemon per runtime serves the whole module; nothing
asserts how long anything took.
"""

from __future__ import annotations

import contextlib
import os
import socket
import ssl
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from kvtierd.client import connect
from kvtierd.errors import AccessDeniedError, KvtierError, TimedOutError
from kvtierd.testing import DaemonProcess, free_port
from tests.support.frames import last_word
from tests.support.tls import (
    DEADLINE_S,
    Certificates,
    client_hello,
    reset,
    tcp,
    unix_round_trip,
)

pytestmark = pytest.mark.timeout(300)

#: ``daemon.handshake_timeout_s``: the TLS handshake, then INIT, must end within it.
HANDSHAKE_S = 1.0


@dataclass
class TlsDaemon:
    daemon: DaemonProcess
    certs: Certificates
    port: int
    metrics_port: int
    started_s: float

    def serves(self, name: str) -> None:
        """The daemon runs, a local engine does a PUT and a LOOKUP, a good TLS client STATFS,
        and the metrics port answers."""
        assert self.daemon.running, self.daemon.log()[-3000:]
        unix_round_trip(self.daemon.socket, name)
        with self.certs.connect(self.port) as remote:
            assert remote.stats()["scope"] == "tenant"
        url = f"http://127.0.0.1:{self.metrics_port}/health"
        with urllib.request.urlopen(url, timeout=DEADLINE_S) as reply:
            assert reply.status == 200
        assert self.daemon.running


@pytest.fixture(scope="module", params=["asyncio", "trio"])
def tls_daemon(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[TlsDaemon]:
    runtime: str = request.param
    directory = tmp_path_factory.mktemp(f"hostile-{runtime}")
    certs = Certificates.make(directory / "tls")
    port, metrics_port = free_port(), free_port()
    config = (
        f"[daemon]\nhandshake_timeout_s = {HANDSHAKE_S}\nmetrics_port = {metrics_port}\n"
        f"metrics_timeout_s = {HANDSHAKE_S}\n" + certs.remote_section(port)
    )
    daemon = DaemonProcess(directory, config_text=config, runtime=runtime)
    daemon.start(120)
    try:
        yield TlsDaemon(daemon, certs, port, metrics_port, time.monotonic())
        assert "Traceback" not in daemon.log(), daemon.log()[-5000:]
    finally:
        daemon.kill()


def _wait_closed(sock: socket.socket) -> None:
    """Read ``sock`` until the daemon closes it (EOF or a reset)."""
    try:
        while sock.recv(1 << 16):
            pass
    except ConnectionResetError:
        pass
    except TimeoutError:
        pytest.fail(f"the daemon kept the connection open for {DEADLINE_S} s")


# -- what a peer does to the listener ------------------------------------------------------


def close_before_the_handshake(d: TlsDaemon) -> None:
    tcp(d.port).close()


def reset_before_the_handshake(d: TlsDaemon) -> None:
    reset(tcp(d.port))


def close_in_the_client_hello(d: TlsDaemon) -> None:
    sock = tcp(d.port)
    sock.sendall(client_hello()[:40])
    sock.close()


def reset_in_the_client_hello(d: TlsDaemon) -> None:
    sock = tcp(d.port)
    sock.sendall(client_hello()[:40])
    reset(sock)


def close_after_the_server_hello(d: TlsDaemon) -> None:
    with tcp(d.port) as sock:
        sock.sendall(client_hello())
        assert sock.recv(1)  # the server's first flight: the handshake is half done


def send_garbage(d: TlsDaemon) -> None:
    with tcp(d.port) as sock:
        sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" + os.urandom(1024))
        _wait_closed(sock)


def stall_in_the_handshake(d: TlsDaemon) -> None:
    """Half a ClientHello, then nothing: the handshake timeout closes it."""
    with tcp(d.port) as sock:
        sock.sendall(client_hello()[:40])
        _wait_closed(sock)


def say_nothing(d: TlsDaemon) -> None:
    with tcp(d.port) as sock:
        _wait_closed(sock)


def present_no_certificate(d: TlsDaemon) -> None:
    context = d.certs.context_without_certificate()
    # TLS 1.3: the daemon judges the certificate after the client's handshake; its alert
    # (an SSLError here) does not always get out before the connection closes.
    with (
        tcp(d.port) as raw,
        context.wrap_socket(raw, server_hostname="127.0.0.1") as tls,
        contextlib.suppress(ssl.SSLError),
    ):
        assert tls.recv(1) == b"", "the daemon served a client without a certificate"


def present_another_cas_certificate(d: TlsDaemon) -> None:
    with pytest.raises(KvtierError, match=r"remote\.ca_file"), d.certs.connect(d.port, "forged"):
        pass


def distrust_the_daemon(d: TlsDaemon) -> None:
    """The client aborts the handshake with an alert (unknown CA)."""
    context = d.certs.context_distrusting_the_daemon()
    with tcp(d.port) as raw, pytest.raises(ssl.SSLCertVerificationError):
        context.wrap_socket(raw, server_hostname="127.0.0.1")


ATTACKS: list[Callable[[TlsDaemon], None]] = [
    close_before_the_handshake,
    reset_before_the_handshake,
    close_in_the_client_hello,
    reset_in_the_client_hello,
    close_after_the_server_hello,
    send_garbage,
    stall_in_the_handshake,
    say_nothing,
    present_no_certificate,
    present_another_cas_certificate,
    distrust_the_daemon,
]


@pytest.mark.parametrize("attack", ATTACKS, ids=[a.__name__ for a in ATTACKS])
def test_a_failed_handshake_ends_that_connection_only(
    tls_daemon: TlsDaemon, attack: Callable[[TlsDaemon], None]
) -> None:
    for _ in range(3):
        attack(tls_daemon)
    tls_daemon.serves(attack.__name__)


def _unix(d: TlsDaemon) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(DEADLINE_S)
    sock.connect(str(d.daemon.socket))
    return sock


def _metrics(d: TlsDaemon) -> socket.socket:
    return socket.create_connection(("127.0.0.1", d.metrics_port), timeout=DEADLINE_S)


def unix_close_at_once(d: TlsDaemon) -> None:
    _unix(d).close()


def unix_close_in_the_init_frame(d: TlsDaemon) -> None:
    with _unix(d) as sock:
        sock.sendall(b"KVTD\x01\x00\x00")  # a few bytes of a header


def unix_send_garbage(d: TlsDaemon) -> None:
    with _unix(d) as sock:
        with contextlib.suppress(OSError):  # the daemon may close before all of it is read
            sock.sendall(os.urandom(4096))
        _wait_closed(sock)


def unix_say_nothing(d: TlsDaemon) -> None:
    with _unix(d) as sock:
        _wait_closed(sock)  # ETIMEDOUT after daemon.handshake_timeout_s


def metrics_reset(d: TlsDaemon) -> None:
    reset(_metrics(d))


def metrics_close_in_the_request(d: TlsDaemon) -> None:
    with _metrics(d) as sock:
        sock.sendall(b"GET /hea")


def metrics_send_garbage(d: TlsDaemon) -> None:
    with _metrics(d) as sock:
        sock.sendall(os.urandom(2048) + b"\r\n\r\n")
        _wait_closed(sock)


def metrics_say_nothing(d: TlsDaemon) -> None:
    with _metrics(d) as sock:
        _wait_closed(sock)  # after daemon.metrics_timeout_s


def metrics_trickle(d: TlsDaemon) -> None:
    """A byte every tenth of a second: the request's deadline is for the whole of it."""
    with _metrics(d) as sock:
        with contextlib.suppress(OSError):
            for byte in b"GET /health HTTP/1.0\r\nX-Slow: " + b"x" * 10_000:
                sock.send(bytes([byte]))
                time.sleep(0.1)
        _wait_closed(sock)


OTHER_LISTENERS: list[Callable[[TlsDaemon], None]] = [
    unix_close_at_once,
    unix_close_in_the_init_frame,
    unix_send_garbage,
    unix_say_nothing,
    metrics_reset,
    metrics_close_in_the_request,
    metrics_send_garbage,
    metrics_say_nothing,
    metrics_trickle,
]


@pytest.mark.parametrize("attack", OTHER_LISTENERS, ids=[a.__name__ for a in OTHER_LISTENERS])
def test_a_broken_connection_on_the_other_listeners_ends_it_only(
    tls_daemon: TlsDaemon, attack: Callable[[TlsDaemon], None]
) -> None:
    attack(tls_daemon)
    attack(tls_daemon)
    tls_daemon.serves(attack.__name__)


def test_a_flood_of_failed_handshakes_ends_nothing_else(tls_daemon: TlsDaemon) -> None:
    for attack in ATTACKS * 5:
        if attack not in (stall_in_the_handshake, say_nothing):  # those wait for the timeout
            attack(tls_daemon)
    tls_daemon.serves("after-the-flood")


def test_failed_handshakes_are_logged_once_a_minute_per_address(tls_daemon: TlsDaemon) -> None:
    for _ in range(50):
        reset_before_the_handshake(tls_daemon)
        close_in_the_client_hello(tls_daemon)
    tls_daemon.serves("after-the-logging")
    log = tls_daemon.daemon.log().splitlines()
    by_address: dict[str, list[str]] = {}
    for line in log:
        if "TLS handshake with" in line:
            where = line.split("TLS handshake with ")[1].split()[0]
            by_address.setdefault(where.rpartition(":")[0] or where, []).append(line)
    # 127.0.0.1, and "?" for a connection reset before its address was read (asyncio).
    assert set(by_address) <= {"127.0.0.1", "?"}, by_address
    assert by_address
    # One line per address per minute of the daemon's life at most (the module failed hundreds).
    minutes = int((time.monotonic() - tls_daemon.started_s) // 60)
    for address, lines in by_address.items():
        assert len(lines) <= 1 + minutes, lines
        assert all(f"more from {address} since its last report" in line for line in lines[1:])


# -- the INIT timeout over TLS -------------------------------------------------------------


def test_a_tls_client_without_init_gets_the_etimedout_frame(tls_daemon: TlsDaemon) -> None:
    context = tls_daemon.certs.client_context()
    with tcp(tls_daemon.port) as raw, context.wrap_socket(raw, server_hostname="127.0.0.1") as tls:
        word = last_word(tls, DEADLINE_S)
    assert isinstance(word, TimedOutError), word
    assert f"no INIT within {HANDSHAKE_S:g} s" in str(word)
    tls_daemon.serves("after-the-timeout")


# -- namespaces over TCP -------------------------------------------------------------------


def test_a_remote_client_opens_but_does_not_create_a_namespace(tls_daemon: TlsDaemon) -> None:
    d = tls_daemon
    with d.certs.connect(d.port) as remote:
        with pytest.raises(AccessDeniedError, match=r"remote\.allow_create"):
            remote.namespace("made-far", block_bytes=4096, tenant="alpha")
        assert remote.connected()  # a refused request, not a refused connection
    with connect(d.daemon.socket) as local:
        local.namespace("made-here", block_bytes=4096, tenant="alpha")
        assert "made-far" not in {ns["name"] for ns in local.namespaces()}
    with d.certs.connect(d.port) as remote:
        ns = remote.namespace("made-here", block_bytes=4096, tenant="alpha")
        assert ns.lookup([b"k" * 16]) == 0


def test_remote_allow_create_lets_a_remote_client_create(tmp_path: Path) -> None:
    certs = Certificates.make(tmp_path / "tls")
    port = free_port()
    config = certs.remote_section(port, "allow_create = true\n")
    daemon = DaemonProcess(tmp_path, config_text=config)
    daemon.start(120)
    try:
        with certs.connect(port) as remote:
            remote.namespace("made-far", block_bytes=4096, tenant="alpha")
        with connect(daemon.socket) as local:
            assert "made-far" in {ns["name"] for ns in local.namespaces()}
    finally:
        daemon.kill()


# -- a flood of the metrics port -----------------------------------------------------------


def _slowloris(port: int, stop: threading.Event, opened: list[int]) -> None:
    """20 connections to the metrics port, each sending a request header a byte at a time
    (every 0.2 s) and never finishing it; reopened as the daemon closes them."""
    request = b"GET /health HTTP/1.1\r\nHost: x\r\n" + b"X-Slow: b\r\n" * 1000
    held: list[tuple[socket.socket, int]] = []
    try:
        while not stop.is_set():
            while len(held) < 20:
                with contextlib.suppress(OSError):
                    held.append((socket.create_connection(("127.0.0.1", port), timeout=5), 0))
                    opened[0] += 1
            still: list[tuple[socket.socket, int]] = []
            for sock, sent in held:
                try:
                    sock.send(request[sent : sent + 1])
                    still.append((sock, sent + 1))
                except OSError:
                    sock.close()
            held = still
            stop.wait(0.2)
    finally:
        for sock, _ in held:
            sock.close()


def test_probes_are_answered_through_a_slowloris_flood_of_the_metrics_port(
    tls_daemon: TlsDaemon,
) -> None:
    """20 slowloris connections against ``daemon.metrics_max_connections`` (8): each holding a
    slot, they made 35 of 43 probes fail (closed unanswered), so a liveness probe restarted a
    healthy daemon. Now the oldest connection still sending its request is closed for each
    new one, and a probe's answer needs no slot: every probe is answered."""
    d = tls_daemon
    stop, opened = threading.Event(), [0]
    flood = threading.Thread(target=_slowloris, args=(d.metrics_port, stop, opened))
    flood.start()
    try:
        while opened[0] < 40:  # the flood fills the port, and is reopening what was closed
            time.sleep(0.1)
        for path in ["/health", "/ready"] * 15:
            url = f"http://127.0.0.1:{d.metrics_port}{path}"
            with urllib.request.urlopen(url, timeout=DEADLINE_S) as reply:
                assert reply.status == 200, path
            time.sleep(0.1)
    finally:
        stop.set()
        flood.join()
    d.serves("after-the-slowloris")
    assert "closing the oldest for each new one" in d.daemon.log()
