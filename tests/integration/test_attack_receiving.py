"""Attacks on how the daemon reads requests (issue 32's ``server/receiving.py``), on asyncio
and trio, through the real daemon's Unix socket.

The reader keeps the socket's reader registered between requests on asyncio, and waits with
``wait_readable`` on trio; a peer that errors the socket (``POLLERR``: it hung up with replies
unread) once stopped libuv's poll for good. Each attack below is something a broken or hostile
local client does to a connection after INIT: end its half of the stream inside a frame, reset
inside a frame, trickle a frame a byte at a time, announce a frame of 4 GiB, pipeline far past
``max_inflight`` and hang up without reading, half-close after a burst and expect its answers,
stop reading with its socket's buffer full. Many run at once, from threads. Afterwards the
daemon must still serve a good client its blocks, every attacker's connection, lease and
descriptor must be gone (``/proc/<pid>/fd`` back to where it was), and nothing may have
failed inside it. No assertion is about time: a timeout only turns a hang into a failure.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

from kvtierd.client import connect
from kvtierd.protocol import (
    MAX_KEYS_PER_REQUEST,
)
from kvtierd.protocol.frames import HEADER_BYTES, Opcode, RequestHeader
from kvtierd.protocol.messages import (
    EvictReply,
    EvictRequest,
    LookupReply,
    LookupRequest,
    ReadReply,
    ReadRequest,
)
from kvtierd.testing import DaemonProcess
from tests.support.attacks import unharmed
from tests.support.rawpeer import DEADLINE_S, RawPeer

pytestmark = pytest.mark.timeout(300)

BLOCK = 16 << 10
KEYS = [b"attack-%09d" % i for i in range(256)]
#: Keys per READ of the cold attacks: each round reads keys no earlier round leased.
GROUP = 8
#: ``daemon.max_inflight``: small, so that pipelining passes it many times over.
MAX_INFLIGHT = 8


def _blocks() -> list[bytes]:
    rng = np.random.default_rng(32)
    return [rng.integers(0, 256, BLOCK, dtype=np.uint8).tobytes() for _ in KEYS]


# -- the attacks ------------------------------------------------------------------------------


def half_close_inside_a_frame(peer: RawPeer) -> None:
    """Half a LOOKUP, then the end of the stream: the daemon closes (it cannot have the rest)."""
    frame = peer.frame(LookupRequest(KEYS[:4]))
    peer.sock.sendall(frame[: len(frame) // 2])
    peer.sock.shutdown(socket.SHUT_WR)
    assert peer.closed_by_daemon() is not None  # "stream ended inside a frame"


def reset_inside_a_frame(peer: RawPeer) -> None:
    frame = peer.frame(LookupRequest(KEYS[:4]))
    peer.sock.sendall(frame[: HEADER_BYTES + 3])
    peer.reset()


def trickle_a_frame(peer: RawPeer) -> None:
    """A LOOKUP one byte per ``send``: answered as if sent whole."""
    for byte in peer.frame(LookupRequest(KEYS[:8])):
        peer.sock.send(bytes([byte]))
    event = peer.next_reply()
    assert isinstance(event.message, LookupReply), event
    assert event.message.hits == 8
    peer.sock.close()


def announce_four_gib(peer: RawPeer) -> None:
    """A header whose length is 4 GiB - 1, then bytes: refused at the header, never buffered."""
    header = RequestHeader(Opcode.LOOKUP, 0xFFFF_FFFF, 1 << 40, peer.ns).pack()
    peer.sock.sendall(header + os.urandom(1 << 16))
    assert peer.closed_by_daemon() is not None


def pipeline_past_the_limit_then_reset(peer: RawPeer) -> None:
    """Many READs (each a lease) and LOOKUPs, far past ``max_inflight``, replies never read,
    then an RST: the socket errors (``POLLERR``) while the daemon still has replies to send."""
    burst = b"".join(
        peer.frame(ReadRequest(KEYS[i % 4 : i % 4 + 4]) if i % 2 else LookupRequest(KEYS[:64]))
        for i in range(40 * MAX_INFLIGHT)
    )
    with contextlib.suppress(OSError):  # the daemon stopped reading: its back-pressure
        peer.sock.sendall(burst)
    peer.reset()


def pipeline_then_half_close(peer: RawPeer) -> None:
    """A burst of READs and LOOKUPs past ``max_inflight``, then the end of the stream: every
    request is answered before the daemon closes."""
    count = 4 * MAX_INFLIGHT
    for i in range(count):
        message = ReadRequest(KEYS[i % 8 : i % 8 + 2]) if i % 2 else LookupRequest(KEYS[:2])
        peer.sock.sendall(peer.frame(message))
    peer.sock.shutdown(socket.SHUT_WR)
    answered = 0
    for _ in range(count):
        event = peer.next_reply()
        assert event.error is None, event.error
        assert isinstance(event.message, ReadReply | LookupReply)
        answered += 1
    assert answered == count
    assert peer.closed_by_daemon() is None


def _cold_reads(peer: RawPeer, rounds: int) -> bytes:
    """EVICT then a READ of :data:`GROUP` keys no earlier round leased, ``rounds`` times: each
    READ promotes from the NVMe tier in batches, so it waits on the disk and holds a permit
    meanwhile."""
    assert rounds * GROUP <= len(KEYS)
    return b"".join(
        peer.frame(EvictRequest()) + peer.frame(ReadRequest(KEYS[r * GROUP : (r + 1) * GROUP]))
        for r in range(rounds)
    )


def cold_reads_then_reset(peer: RawPeer) -> None:
    """Cold READs pipelined past ``max_inflight`` (the reader stops on the permits while
    promotions are in flight), then an RST: every promotion's slots and pins, every lease,
    given back."""
    with contextlib.suppress(OSError):
        peer.sock.sendall(_cold_reads(peer, 4 * MAX_INFLIGHT))
    peer.reset()


def cold_reads_then_half_close(peer: RawPeer) -> None:
    """The same burst, then the end of the stream: every request answered, then closed."""
    rounds = 2 * MAX_INFLIGHT
    peer.sock.sendall(_cold_reads(peer, rounds))
    peer.sock.shutdown(socket.SHUT_WR)
    for _ in range(2 * rounds):
        event = peer.next_reply()
        assert event.error is None, event.error
        assert isinstance(event.message, EvictReply | ReadReply)
    assert peer.closed_by_daemon() is None


def stop_reading_with_full_buffers(peer: RawPeer) -> None:
    """LOOKUPs of the largest size, replies never read, until the daemon stops taking bytes;
    then close. The daemon must go on serving everybody else meanwhile (checked after)."""
    keys = [b"k%07d" % i for i in range(MAX_KEYS_PER_REQUEST)]
    frame = peer.frame(LookupRequest(keys))
    peer.sock.settimeout(2.0)  # not a time assertion: how long to push before giving up
    with contextlib.suppress(OSError):  # TimeoutError included
        for _ in range(64):
            peer.sock.sendall(frame)
            frame = peer.frame(LookupRequest(keys))
    peer.sock.close()


ATTACKS: list[Callable[[RawPeer], None]] = [
    half_close_inside_a_frame,
    reset_inside_a_frame,
    trickle_a_frame,
    announce_four_gib,
    pipeline_past_the_limit_then_reset,
    pipeline_then_half_close,
    stop_reading_with_full_buffers,
    cold_reads_then_reset,
    cold_reads_then_half_close,
]


# -- the daemon and its books -----------------------------------------------------------------


@pytest.fixture(scope="module", params=["asyncio", "trio"])
def attacked(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[DaemonProcess]:
    runtime: str = request.param
    directory = tmp_path_factory.mktemp(f"attack-receiving-{runtime}")
    config = f"[daemon]\nmax_inflight = {MAX_INFLIGHT}\nhandshake_timeout_s = 5\n"
    daemon = DaemonProcess(directory, config_text=config, runtime=runtime)
    daemon.start(120)
    try:
        with connect(daemon.socket, timeout_s=DEADLINE_S) as client:
            ns = client.namespace("attacked", block_bytes=BLOCK)
            assert ns.put(KEYS, _blocks()) == len(KEYS)
            client.fsync()  # clean, so that EVICT leaves them on the NVMe tier only
        yield daemon
    finally:
        daemon.kill()


def _descriptors(daemon: DaemonProcess) -> int:
    """The daemon's open sockets and shared-memory files: what a connection could leak (its
    own pipes and rings come and go with probes and are not counted)."""
    assert daemon.process is not None
    fds = Path(f"/proc/{daemon.process.pid}/fd")
    links = []
    for fd in fds.iterdir():
        with contextlib.suppress(FileNotFoundError):  # closed while listed
            links.append(os.readlink(fd))
    return sum(link.startswith(("socket:", "/memfd:")) for link in links)


def _books(daemon: DaemonProcess) -> dict[str, int]:
    """The daemon's books read on one good connection once it is the only one left (closing
    sessions waited for, up to a deadline): connections, leases, and its open descriptors,
    taken when two readings in a row agree."""
    with connect(daemon.socket, timeout_s=DEADLINE_S) as client:
        deadline = time.monotonic() + DEADLINE_S
        last: dict[str, int] = {}
        while True:
            stats = client.stats()
            books = {
                "connections": stats["connections"],
                "leases": stats["leases"],
                "leased_blocks": stats["leased_blocks"],
                "descriptors": _descriptors(daemon),
            }
            quiet = books["connections"] == 1 and books["leases"] == 0
            if (quiet and books == last) or time.monotonic() > deadline:
                return books
            last = books
            time.sleep(0.1)


def _serves_its_blocks(daemon: DaemonProcess) -> None:
    blocks = _blocks()
    with connect(daemon.socket, timeout_s=DEADLINE_S) as client:
        ns = client.namespace("attacked", block_bytes=BLOCK)
        assert ns.lookup(KEYS) == len(KEYS)
        with ns.get(KEYS) as views:
            assert [bytes(v) for v in views] == blocks


@pytest.mark.parametrize("attack", ATTACKS, ids=lambda a: a.__name__)
def test_one_attack_leaves_nothing_behind(
    attacked: DaemonProcess, attack: Callable[[RawPeer], None]
) -> None:
    before = _books(attacked)
    attack(RawPeer(attacked.socket, "attacked", BLOCK))
    _serves_its_blocks(attacked)
    assert _books(attacked) == before
    unharmed(attacked)


def test_every_attack_at_once_leaves_nothing_behind(attacked: DaemonProcess) -> None:
    """Each attack from four threads at once, beside a good client reading its blocks."""
    before = _books(attacked)
    failures: list[BaseException] = []

    def run(attack: Callable[[RawPeer], None]) -> None:
        try:
            attack(RawPeer(attacked.socket, "attacked", BLOCK))
        except BaseException as exc:  # reported below, by attack
            failures.append(AssertionError(f"{attack.__name__}: {exc!r}"))

    threads = [threading.Thread(target=run, args=(a,)) for a in ATTACKS * 4]
    for thread in threads:
        thread.start()
    try:
        _serves_its_blocks(attacked)  # while they run
    finally:
        for thread in threads:
            thread.join(2 * DEADLINE_S)
    assert not any(thread.is_alive() for thread in threads), "an attacker hung"
    assert failures == []
    _serves_its_blocks(attacked)
    assert _books(attacked) == before
    unharmed(attacked)


def test_half_a_frame_and_a_hang_up_in_one_event_end_the_session(attacked: DaemonProcess) -> None:
    """Half a frame, then a hang-up on a reply left unread, reach the daemon as one event: it
    is stopped (``SIGSTOP``) while the peer sends them, so that its loop sees the bytes, the
    end of the stream and the error (``POLLERR``: the unread reply) at once. libuv stops the
    poll on that error after one last callback, which takes the half frame and has nothing to
    answer: the session must still see the end and close (on uvloop it waited for ever, a
    connection left open, until a timer renewed every waiting registration)."""
    assert attacked.process is not None
    before = _books(attacked)
    peer = RawPeer(attacked.socket, "attacked", BLOCK)
    peer.sock.sendall(peer.frame(LookupRequest(KEYS[:4])))
    readable, _, _ = select.select([peer.sock], [], [], DEADLINE_S)
    assert readable, "no reply to the LOOKUP"  # there, and left unread
    frame = peer.frame(LookupRequest(KEYS[:4]))
    os.kill(attacked.process.pid, signal.SIGSTOP)
    try:
        peer.sock.sendall(frame[: len(frame) // 2])
        peer.sock.close()
    finally:
        os.kill(attacked.process.pid, signal.SIGCONT)
    assert _books(attacked) == before
    unharmed(attacked)
