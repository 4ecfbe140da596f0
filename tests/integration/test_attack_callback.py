"""An attacker's review of LOOKUP served from the socket's readiness callback (asyncio).

The callback answers LOOKUPs of a few keys itself and leaves everything else to the reader, in
order. Each attack checks what a peer sees (one whole reply per request, in request order where
the requests are served in turn; nothing after the connection's end) and what the daemon keeps
(it runs, logs no internal error, and holds no descriptor or lease of a peer that left): frames
split at every byte around the whole-frame path, bad frames among LOOKUPs, LOOKUPs after
DESTROY, FORGET or past ``max_inflight``, a peer that never reads beside one that does, LOOKUPs
of blocks only on NVMe (promoted from the callback), many connections at once, and SIGTERM
while peers pipeline LOOKUPs. Nothing asserts on time: a hang fails on a socket's deadline.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvtierd.client import connect
from kvtierd.errors import InvalidRequestError
from kvtierd.protocol import ReplyReceived
from kvtierd.protocol.frames import HEADER_BYTES, MAX_KEYS_PER_REQUEST
from kvtierd.protocol.messages import (
    DestroyRequest,
    ForgetRequest,
    FsyncRequest,
    LookupReply,
    LookupRequest,
    Message,
    ReadRequest,
    StatfsReply,
    StatfsRequest,
)
from kvtierd.store.slicing import INLINE_ITEMS
from kvtierd.testing import DaemonProcess
from tests.support.attacks import unharmed
from tests.support.rawpeer import DEADLINE_S, RawPeer

pytestmark = pytest.mark.timeout(240)

BLOCK = 4096
STORED = 24
NAME = "callback"


def key(i: int) -> bytes:
    return b"cb-key-%08d" % i


KEYS = [key(i) for i in range(STORED)]
ABSENT = [key(10_000 + i) for i in range(4)]


def store(daemon: DaemonProcess) -> None:
    with connect(daemon.socket) as client:
        ns = client.namespace(NAME, block_bytes=BLOCK)
        assert ns.put(KEYS, [bytes([i]) * BLOCK for i in range(STORED)]) == STORED
        client.fsync()


def frames(peer: RawPeer, messages: list[Message]) -> tuple[list[int], bytes]:
    """The unique ids and the frames of ``messages``, in order."""
    uniques, stream = [], b""
    for message in messages:
        unique, frame = peer.conn.request(message, peer.ns)
        uniques.append(unique)
        stream += frame
    return uniques, stream


def replies(peer: RawPeer, count: int) -> list[ReplyReceived]:
    return [peer.next_reply() for _ in range(count)]


def descriptors(daemon: DaemonProcess) -> int:
    """The sockets the daemon holds (its other descriptors come and go with its work)."""
    assert daemon.process is not None
    fds = Path(f"/proc/{daemon.process.pid}/fd")
    found = 0
    for fd in os.listdir(fds):
        with contextlib.suppress(FileNotFoundError):
            found += os.readlink(fds / fd).startswith("socket:")
    return found


def quiet(daemon: DaemonProcess) -> tuple[int, dict[str, Any]]:
    """The daemon's descriptors and STATFS once this client's is its only connection (the
    sessions of peers that left have ended, their sockets closed); fails after
    :data:`DEADLINE_S`."""
    deadline = time.monotonic() + DEADLINE_S
    with connect(daemon.socket) as client:
        while (stats := client.stats())["connections"] != 1:
            assert time.monotonic() < deadline, stats
            time.sleep(0.05)
        return descriptors(daemon), stats


def check_lookup(reply: ReplyReceived, hits: int) -> None:
    assert isinstance(reply.message, LookupReply), reply
    assert reply.message.hits == hits


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[DaemonProcess]:
    config = "[daemon]\nmax_inflight = 4\n"
    with DaemonProcess(tmp_path / "d", nvme_size="64M", config_text=config) as running:
        store(running)
        yield running
        unharmed(running)


def test_frames_split_at_every_byte_are_answered_in_request_order(daemon: DaemonProcess) -> None:
    """LOOKUPs, a LOOKUP whose body is not one, STATFS: split in two at every byte, and sent
    a byte at a time. Every request one reply, in order, right."""
    peer = RawPeer(daemon.socket, NAME, BLOCK)
    messages: list[Message] = [
        LookupRequest(KEYS[:3]),
        LookupRequest(KEYS[:1]),
        StatfsRequest(),
        LookupRequest(KEYS + ABSENT),
        LookupRequest(ABSENT),
    ]
    wants: list[object] = [3, 1, StatfsReply, STORED, InvalidRequestError, 0]
    for split in itertools.count(1):
        uniques, stream = frames(peer, messages[:4])
        bad_unique, bad = frames(peer, [LookupRequest(KEYS[:1])])
        last_unique, last = frames(peer, messages[4:])
        stream += bad[:HEADER_BYTES] + b"\xc1" * (len(bad) - HEADER_BYTES) + last
        uniques += bad_unique + last_unique
        if split < len(stream):
            peer.sock.sendall(stream[:split])
            time.sleep(0.001)  # most often read alone: a frame cut in the callback
            peer.sock.sendall(stream[split:])
        else:  # and last, a byte at a time
            for at in range(len(stream)):
                peer.sock.sendall(stream[at : at + 1])
        got = replies(peer, len(uniques))
        assert [r.header.unique for r in got] == uniques, split
        for reply, want in zip(got, wants, strict=True):
            if want is StatfsReply:
                assert isinstance(reply.message, StatfsReply), reply
            elif want is InvalidRequestError:
                assert isinstance(reply.error, InvalidRequestError), reply
            else:
                assert isinstance(want, int)
                check_lookup(reply, want)
        if split >= len(stream):
            break
    peer.sock.close()


@pytest.mark.parametrize("bad", ["magic", "oversize"])
def test_a_bad_header_among_lookups_ends_that_connection_after_their_replies(
    daemon: DaemonProcess, bad: str
) -> None:
    peer = RawPeer(daemon.socket, NAME, BLOCK)
    uniques, stream = frames(peer, [LookupRequest(KEYS[:2])] * 5)
    _, wrong = frames(peer, [LookupRequest(KEYS[:1])])
    if bad == "magic":
        wrong = b"XXXX" + wrong[4:]
    else:  # a frame past any negotiated limit: its length word (bytes 8-11) at 2**31
        wrong = wrong[:8] + (1 << 31).to_bytes(4, "little") + wrong[12:]
    _, after = frames(peer, [LookupRequest(KEYS[:2])] * 5)
    peer.sock.sendall(stream + wrong + after)
    got = replies(peer, len(uniques))
    assert [r.header.unique for r in got] == uniques
    for reply in got:
        check_lookup(reply, 2)
    last = peer.next_reply()  # the protocol error, then the end
    assert last.header.unique == 0, last
    assert last.error is not None, last
    with pytest.raises(ConnectionError):
        peer.next_reply()
    peer.sock.close()
    other = RawPeer(daemon.socket, NAME, BLOCK)
    check_lookup(_call(other, LookupRequest(KEYS)), STORED)
    other.sock.close()


def _call(peer: RawPeer, message: Message) -> ReplyReceived:
    unique, frame = peer.conn.request(message, peer.ns)
    peer.sock.sendall(frame)
    reply = peer.next_reply()
    assert reply.header.unique == unique
    return reply


def test_nothing_is_answered_after_destroy(daemon: DaemonProcess) -> None:
    """LOOKUPs pipelined behind DESTROY: the LOOKUP before it and DESTROY answered, nothing
    after, then the end of the stream."""
    peer = RawPeer(daemon.socket, NAME, BLOCK)
    uniques, stream = frames(peer, [LookupRequest(KEYS[:3]), DestroyRequest()])
    _, after = frames(peer, [LookupRequest(KEYS[:1])] * 50)
    peer.sock.sendall(stream + after)
    got = replies(peer, 2)
    assert [r.header.unique for r in got] == uniques
    check_lookup(got[0], 3)
    assert got[1].error is None, got[1]
    with pytest.raises(ConnectionError):
        peer.next_reply()
    peer.sock.close()


def test_lookups_around_forget_and_past_max_inflight_each_get_one_reply(
    daemon: DaemonProcess,
) -> None:
    """FSYNCs (each takes one of the 4 permits) and LOOKUPs pipelined, none read until all
    are sent, then a FORGET and LOOKUPs: one reply each; the LOOKUPs in their order, the
    ones sent before FORGET with every block, a LOOKUP after FORGET's reply with none."""
    peer = RawPeer(daemon.socket, NAME, BLOCK)
    messages: list[Message] = []
    for _ in range(60):
        messages += [FsyncRequest(), LookupRequest(KEYS[:2])]
    uniques, stream = frames(peer, messages)
    sender = threading.Thread(target=peer.sock.sendall, args=(stream,))
    sender.start()
    sender.join(DEADLINE_S)
    got = {r.header.unique: r for r in replies(peer, len(uniques))}
    assert got.keys() == set(uniques)
    lookups = [u for u, m in zip(uniques, messages, strict=True) if isinstance(m, LookupRequest)]
    for unique in lookups:
        check_lookup(got[unique], 2)
    for unique in set(uniques) - set(lookups):
        assert got[unique].error is None, got[unique]
    uniques, stream = frames(peer, [ForgetRequest(KEYS[:1]), *[LookupRequest(KEYS[:2])] * 20])
    peer.sock.sendall(stream)
    got = {r.header.unique: r for r in replies(peer, len(uniques))}
    assert got.keys() == set(uniques)
    assert got[uniques[0]].error is None, got[uniques[0]]
    for unique in uniques[1:]:
        assert isinstance(got[unique].message, LookupReply), got[unique]
        assert got[unique].message.hits in (0, 2)
    check_lookup(_call(peer, LookupRequest(KEYS[:2])), 0)
    peer.sock.close()


def _send_until_refused(sock: socket.socket, data: bytes) -> None:
    """Send ``data`` over and over until the socket takes no more (the daemon stopped
    reading: its replies fill our receive buffer, unread)."""
    sock.setblocking(False)
    try:
        while True:
            sock.send(data)
    except BlockingIOError:
        pass


def test_a_peer_that_never_reads_starves_no_one_and_leaves_nothing(
    daemon: DaemonProcess,
) -> None:
    """Four peers pipeline LOOKUPs (two of them READs too, each a lease) and never read a
    reply; another client is served meanwhile; the four leave (two with an RST): every
    descriptor, connection and lease of theirs is let go."""
    baseline, _ = quiet(daemon)
    hogs = []
    for number in range(4):
        hog = RawPeer(daemon.socket, NAME, BLOCK)
        burst: list[Message] = [LookupRequest(KEYS[:4])] * 100
        if number < 2:
            burst += [ReadRequest(KEYS[:2]), LookupRequest(KEYS[:1])] * 20
        _send_until_refused(hog.sock, frames(hog, burst * 10)[1])
        hogs.append(hog)
    with connect(daemon.socket) as client:
        ns = client.namespace(NAME, block_bytes=BLOCK, create=False)
        for i in range(200):
            assert ns.lookup(KEYS[: 1 + i % STORED]) == 1 + i % STORED
        with ns.get(KEYS) as views:
            assert [bytes(v) for v in views] == [bytes([i]) * BLOCK for i in range(STORED)]
    for number, hog in enumerate(hogs):
        if number % 2:
            hog.reset()
        else:
            hog.sock.close()
    fds, stats = quiet(daemon)
    assert (fds, stats["leases"]) == (baseline, 0), stats


def test_many_connections_pipelining_at_once_get_every_reply_in_order(
    daemon: DaemonProcess,
) -> None:
    peers = [RawPeer(daemon.socket, NAME, BLOCK) for _ in range(48)]
    sent = []
    for number, peer in enumerate(peers):
        counts = [1 + (number + i) % STORED for i in range(300)]
        uniques, stream = frames(peer, [LookupRequest(KEYS[:c]) for c in counts])
        peer.sock.sendall(stream)
        sent.append((uniques, counts))
    for peer, (uniques, counts) in zip(peers, sent, strict=True):
        got = replies(peer, len(uniques))
        assert [r.header.unique for r in got] == uniques
        for reply, count in zip(got, counts, strict=True):
            check_lookup(reply, count)
        peer.sock.close()


def test_lookups_of_blocks_on_nvme_only_are_answered_and_promoted(tmp_path: Path) -> None:
    """After a restart every block is on NVMe only: pipelined LOOKUPs (served from the
    callback, promoting as they go) all hit, and each block then reads back its own bytes."""
    daemon = DaemonProcess(tmp_path / "d", nvme_size="64M")
    with daemon:
        store(daemon)
    with daemon:
        peer = RawPeer(daemon.socket, NAME, BLOCK)
        counts = [1 + i % STORED for i in range(500)]
        uniques, stream = frames(peer, [LookupRequest(KEYS[:c]) for c in counts])
        peer.sock.sendall(stream)
        got = replies(peer, len(uniques))
        assert [r.header.unique for r in got] == uniques
        for reply, count in zip(got, counts, strict=True):
            check_lookup(reply, count)
        # answered from NVMe (tier code not DRAM's 0) before the promotions landed
        assert any(bytes(r.message.tiers).strip(b"\0") for r in got if r.message), got[:3]
        peer.sock.close()
        with connect(daemon.socket) as client:
            ns = client.namespace(NAME, block_bytes=BLOCK, create=False)
            with ns.get(KEYS) as views:
                assert [bytes(v) for v in views] == [bytes([i]) * BLOCK for i in range(STORED)]
        unharmed(daemon)


def test_sigterm_while_peers_pipeline_lookups_stops_cleanly(tmp_path: Path) -> None:
    """Four peers pipeline LOOKUPs in bursts of 200 and read them, on and on; SIGTERM: the
    daemon stops cleanly, and every peer read only whole replies, in order, then the end."""
    daemon = DaemonProcess(tmp_path / "d", nvme_size="64M")
    daemon.start()
    store(daemon)
    counted = [0] * 4
    failures: list[BaseException] = []
    stop = threading.Event()

    def storm(number: int) -> None:
        peer = RawPeer(daemon.socket, NAME, BLOCK)
        try:
            while not stop.is_set():
                uniques, stream = frames(peer, [LookupRequest(KEYS[:3])] * 200)
                peer.sock.sendall(stream)
                for unique in uniques:
                    reply = peer.next_reply()
                    assert reply.header.unique == unique
                    if reply.error is None:
                        check_lookup(reply, 3)
                    counted[number] += 1
        except (ConnectionError, OSError):
            pass  # the daemon went away: the end
        except BaseException as exc:  # a torn frame, a reply out of order
            failures.append(exc)
        finally:
            peer.sock.close()

    threads = [threading.Thread(target=storm, args=(n,)) for n in range(4)]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + DEADLINE_S
    while min(counted) < 1000 and not failures:
        assert time.monotonic() < deadline, counted
        time.sleep(0.01)
    try:
        assert daemon.stop() == 0, daemon.log()[-3000:]
    finally:
        stop.set()
        for thread in threads:
            thread.join(DEADLINE_S)
    assert not failures, failures
    log = daemon.log()
    assert "stopped cleanly" in log, log[-3000:]
    assert "Traceback" not in log, log[-3000:]


def test_long_chains_among_short_lookups_each_get_their_answer(daemon: DaemonProcess) -> None:
    """LOOKUPs of 8192 keys (past the 256 the callback answers: the lane serves them, in
    their turn) pipelined among short ones, from two peers at once while a third client is
    served: every request one reply, with its own hits; the short ones in their order."""
    assert INLINE_ITEMS <= 256
    chain = KEYS + [key(20_000 + i) for i in range(MAX_KEYS_PER_REQUEST - STORED)]
    peers = [RawPeer(daemon.socket, NAME, BLOCK) for _ in range(2)]
    sent = []
    for peer in peers:
        messages: list[Message] = []
        for i in range(30):
            messages += [LookupRequest(chain), *[LookupRequest(KEYS[: 1 + i % 5])] * 20]
        uniques, stream = frames(peer, messages)
        threading.Thread(target=peer.sock.sendall, args=(stream,), daemon=True).start()
        sent.append((uniques, messages))
    with connect(daemon.socket) as client:
        ns = client.namespace(NAME, block_bytes=BLOCK, create=False)
        for i in range(50):
            assert ns.lookup(KEYS[: 1 + i]) == min(1 + i, STORED)
    for peer, (uniques, messages) in zip(peers, sent, strict=True):
        got = replies(peer, len(uniques))
        assert sorted(r.header.unique for r in got) == sorted(uniques)
        want = {
            u: min(len(m.keys), STORED)
            for u, m in zip(uniques, messages, strict=True)
            if isinstance(m, LookupRequest)
        }
        for reply in got:
            check_lookup(reply, want[reply.header.unique])
        short = [u for u in uniques if want[u] < STORED]
        assert [r.header.unique for r in got if r.header.unique in set(short)] == short
        peer.sock.close()


def test_a_peer_that_half_closes_after_pipelining_gets_every_reply_then_the_end(
    daemon: DaemonProcess,
) -> None:
    """LOOKUPs and STATFS pipelined, then ``shutdown(SHUT_WR)``: the end of the stream reaches
    the callback after the requests; every one is answered, in order, then the daemon closes."""
    peer = RawPeer(daemon.socket, NAME, BLOCK)
    messages: list[Message] = [LookupRequest(KEYS[: 1 + i % STORED]) for i in range(500)]
    messages.insert(250, StatfsRequest())
    uniques, stream = frames(peer, messages)
    peer.sock.sendall(stream)
    peer.sock.shutdown(socket.SHUT_WR)
    got = replies(peer, len(uniques))
    assert [r.header.unique for r in got] == uniques
    for reply, message in zip(got, messages, strict=True):
        if isinstance(message, LookupRequest):
            check_lookup(reply, len(message.keys))
    with pytest.raises(ConnectionError):
        peer.next_reply()
    peer.sock.close()
