"""Connection slots against a peer that holds them: the handshake timeout, the per-uid limit and
idle connections giving their slot up (issue 14, row 11), on the real daemon.

Before these, 32 connections that never finished INIT, or 32 idle ones, took every slot of a
``max_connections = 32`` daemon for good: every later client got EBUSY. The timeouts in the
configurations below are small so that the tests are quick; nothing asserts how long anything
took, only that it happens within a generous deadline.
"""

from __future__ import annotations

import contextlib
import json
import select
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvtierd.client import Client, connect
from kvtierd.client.base import init_request
from kvtierd.errors import BrokenConnectionError, BusyError, TimedOutError
from kvtierd.protocol import ClientConnection
from tests.support.daemon import DaemonProcess
from tests.support.frames import last_word
from tests.support.uids import client_as, reachable_directory, require_root, start_as

BLOCK = 4096
DEADLINE_S = 30.0  # generous: only a daemon that never frees the slot should reach it

runtimes = pytest.mark.parametrize("runtime", ["asyncio", "trio"])


def _raw(path: Path) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(DEADLINE_S)
    sock.connect(str(path))
    return sock


def _connect_eventually(path: Path) -> Client:
    """A client, once the daemon has room for it (it answers EBUSY while it has none)."""
    deadline = time.monotonic() + DEADLINE_S
    while True:
        try:
            return connect(path, timeout_s=DEADLINE_S)
        except BusyError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def _wait_closed(client: Client) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while client.connected():
        assert time.monotonic() < deadline, "the daemon did not close the connection"
        time.sleep(0.02)


@pytest.fixture
def init_header() -> bytes:
    _, frame = ClientConnection().request(init_request("slow"))
    return frame


@runtimes
def test_partial_headers_do_not_lock_out_a_good_client(
    tmp_path: Path, runtime: str, init_header: bytes
) -> None:
    config = "[daemon]\nmax_connections = 32\nhandshake_timeout_s = 0.5\n"
    with DaemonProcess(tmp_path, config_text=config, runtime=runtime) as d:
        slow = [_raw(d.socket) for _ in range(40)]
        try:
            for sock in slow:
                # A third of a header, and then nothing (a refused one may be closed already).
                with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                    sock.sendall(init_header[:10])
            with _connect_eventually(d.socket) as good:
                assert good.stats()["connections"] <= 32
            words = [last_word(sock, DEADLINE_S) for sock in slow]
        finally:
            for sock in slow:
                sock.close()
    # Each slow connection was refused at once (the daemon was full) or timed out in INIT.
    assert all(isinstance(word, BusyError | TimedOutError) for word in words), words
    assert any(isinstance(word, TimedOutError) for word in words)


@runtimes
def test_a_silent_connection_is_closed_after_the_handshake_timeout(
    tmp_path: Path, runtime: str
) -> None:
    config = "[daemon]\nhandshake_timeout_s = 0.5\n"
    daemon = DaemonProcess(tmp_path, config_text=config, runtime=runtime)
    with daemon as d, connect(d.socket) as good, _raw(d.socket) as silent:
        word = last_word(silent, DEADLINE_S)
        assert isinstance(word, TimedOutError)
        assert "no INIT within 0.5 s" in str(word)
        # A connection that did its INIT is not touched by the handshake timeout.
        assert good.connected()
        assert good.stats()["connections"] >= 1


@runtimes
def test_an_idle_connection_gives_its_slot_up_to_a_new_one(tmp_path: Path, runtime: str) -> None:
    config = "[daemon]\nmax_connections = 2\nidle_timeout_s = 0.5\n"
    daemon = DaemonProcess(tmp_path, config_text=config, runtime=runtime)
    with daemon as d, connect(d.socket) as first, connect(d.socket) as second:
        first.stats()
        second.stats()  # later than first's: first is the one idle longest
        with _connect_eventually(d.socket) as third:
            _wait_closed(first)
            assert second.connected()
            assert third.stats()["connections"] == 2
        with pytest.raises(BrokenConnectionError):
            first.stats()


def test_a_connection_holding_a_lease_keeps_its_slot(tmp_path: Path) -> None:
    config = "[daemon]\nmax_connections = 1\nidle_timeout_s = 0.2\n"
    with DaemonProcess(tmp_path, config_text=config) as d, connect(d.socket) as holder:
        ns = holder.namespace("t", block_bytes=BLOCK)
        keys = [b"k" * 16]
        ns.put(keys, [np.full(BLOCK, 7, np.uint8)])
        lease = ns.acquire(keys)
        time.sleep(0.6)  # idle for longer than idle_timeout_s, but holding a lease
        with pytest.raises(BusyError, match="too many connections"):
            connect(d.socket)
        assert holder.connected()
        assert bytes(lease.views[0][:1]) == b"\x07"
        lease.release()  # nothing held now: the next newcomer may have the slot
        with _connect_eventually(d.socket) as newcomer:
            _wait_closed(holder)
            assert newcomer.stats()["connections"] == 1


_HOLD_CONNECTIONS = """
import json, sys
from kvtierd.client import connect
from kvtierd.errors import BusyError

held, refused = [], []
for _ in range({attempts}):
    try:
        held.append(connect({socket!r}, timeout_s=30))
    except BusyError as exc:
        refused.append(str(exc))
print(json.dumps([len(held), refused]), flush=True)
sys.stdin.read()  # hold them, idle, until the test closes stdin
"""


def _connections(client: Client) -> int:
    return int(client.stats()["connections"])


@pytest.fixture
def shared_dir() -> Iterator[Path]:
    require_root()
    with reachable_directory() as path:
        yield path


def _line(child: Any) -> str:
    ready, _, _ = select.select([child.stdout], [], [], DEADLINE_S)
    assert ready, "the child said nothing"
    line: str = child.stdout.readline()
    assert line, child.stderr.read()
    return line


def test_one_uid_cannot_take_every_connection_slot(shared_dir: Path) -> None:
    config = '[daemon]\nmax_connections = 8\nmax_connections_per_uid = 3\nsocket_mode = "0666"\n'
    with DaemonProcess(shared_dir / "d", config_text=config) as d:
        code = _HOLD_CONNECTIONS.format(attempts=8, socket=str(d.socket))
        with start_as(1234, 1234, code) as greedy:
            try:
                held, refused = json.loads(_line(greedy))
                assert held == 3
                assert len(refused) == 5
                assert all("too many connections from uid 1234" in text for text in refused)
                # While uid 1234 holds its three, another uid still connects, and root too.
                # (a peer that is not the admin counts only its own uid's connections)
                assert client_as(1235, 1235, d.socket, _connections) == 1
                with connect(d.socket) as admin:
                    assert _connections(admin) == 4  # 1234's three and this one
            finally:
                greedy.kill()


#: uid 1234's three sessions, then, until stdin closes, bursts of connections that never send
#: INIT: refused by its per-uid limit, each would hold a place at the socket's door while the
#: daemon waits (up to 1 s) for the INIT it reads before saying EBUSY.
_FLOOD_REFUSALS = """
import socket, sys, threading, time
from kvtierd.client import connect

held = [connect({socket!r}, timeout_s=30) for _ in range(3)]
stop = threading.Event()
threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
print("flooding", flush=True)
bursts = []
while not stop.is_set():
    burst = []
    for _ in range(45):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            s.connect({socket!r})
        except OSError:
            s.close()
            continue
        burst.append(s)
    bursts.append(burst)
    if len(bursts) > 3:  # each kept 1.5 s, past the daemon's wait for its INIT
        for s in bursts.pop(0):
            s.close()
    time.sleep(0.5)
"""

#: Another uid connects ``attempts`` times, 0.2 s apart, and says how many were admitted.
_TRY_CONNECTING = """
import json, time
from kvtierd.client import connect
from kvtierd.errors import KvtierError

admitted, refused = 0, []
for _ in range({attempts}):
    try:
        with connect({socket!r}, timeout_s=10) as client:
            client.stats()
        admitted += 1
    except (KvtierError, OSError) as exc:
        refused.append(repr(exc))
    time.sleep(0.2)
print(json.dumps([admitted, refused]), flush=True)
"""


def test_refused_connections_of_one_uid_leave_room_for_the_others(shared_dir: Path) -> None:
    """A uid at its limit that keeps opening connections which never send INIT holds at most
    its share of the socket's places (sessions plus a few being refused): another uid is
    admitted every time meanwhile. Before, its refusals filled all 32 places kept for them
    plus the free sessions', and the other uid got none (the attacker's finding of issue 33)."""
    config = '[daemon]\nmax_connections = 8\nmax_connections_per_uid = 3\nsocket_mode = "0666"\n'
    with DaemonProcess(shared_dir / "d", config_text=config) as d:
        flood = _FLOOD_REFUSALS.format(socket=str(d.socket))
        with start_as(1234, 1234, flood) as greedy:
            try:
                assert _line(greedy).strip() == "flooding"
                time.sleep(1.0)  # its bursts are under way
                attempts = _TRY_CONNECTING.format(attempts=10, socket=str(d.socket))
                with start_as(1235, 1235, attempts) as other:
                    admitted, refused = json.loads(_line(other))
                assert (admitted, refused) == (10, [])
                assert "of uid 1234 (its share" in d.log()  # the flood reached its share
            finally:
                greedy.kill()
        with connect(d.socket) as admin:  # and the daemon serves on
            assert _connections(admin) == 1
