"""LOOKUPs the daemon answers from the socket's readiness callback (asyncio; the same requests
on trio go through the reader), pipelined with requests it cannot answer there: every request
gets its own reply, with its own result, and the stream stays whole, also for a peer that
sends thousands of LOOKUPs before it reads a reply (replies the socket does not take at once
are finished by the reader, before any other frame)."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from pathlib import Path

import pytest

from kvtierd.client import connect
from kvtierd.errors import BlockNotFoundError, InvalidRequestError
from kvtierd.keys import chain_keys
from kvtierd.protocol import ClientConnection, Opcode, ReplyReceived
from kvtierd.protocol.frames import HEADER_BYTES, PROTOCOL_MINOR, PROTOCOL_VERSION
from kvtierd.protocol.messages import (
    InitRequest,
    LookupReply,
    LookupRequest,
    Message,
    OpenNsReply,
    OpenNsRequest,
    ReadRequest,
    StatfsRequest,
)
from kvtierd.testing import DaemonProcess

pytestmark = pytest.mark.timeout(180)

BLOCK = 4096
STORED = 40


class _Peer:
    """A raw connection that frames its requests itself and reads replies when told."""

    def __init__(self, path: Path) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.connect(str(path))
        self.conn = ClientConnection()
        self.ns = 0
        self.call(InitRequest(PROTOCOL_VERSION, PROTOCOL_MINOR, 1 << 20))
        opened = self.call(OpenNsRequest("served-now", BLOCK))
        assert isinstance(opened, OpenNsReply)
        self.ns = opened.ns
        self.salt = opened.key_salt

    def frame(self, message: Message) -> tuple[int, bytes]:
        return self.conn.request(message, self.ns)

    def call(self, message: Message) -> Message:
        unique, frame = self.frame(message)
        self.sock.sendall(frame)
        (reply,) = self.replies(1)
        assert reply.header.unique == unique
        assert reply.message is not None, reply.error
        return reply.message

    def replies(self, count: int) -> list[ReplyReceived]:
        got: list[ReplyReceived] = []
        while len(got) < count:
            data, fds, _, _ = socket.recv_fds(self.sock, 1 << 16, 4)
            for fd in fds:  # OPEN_NS's region: not mapped here
                socket.close(fd)
            assert data, f"the daemon closed the connection after {len(got)} replies"
            self.conn.receive_data(data)
            while isinstance(event := self.conn.next_event(), ReplyReceived):
                got.append(event)
        return got


def _store(daemon: DaemonProcess) -> list[bytes]:
    with connect(daemon.socket) as client:
        ns = client.namespace("served-now", block_bytes=BLOCK)
        keys = chain_keys(range(STORED), 1, ns.key_salt)
        assert ns.put(keys, [bytes([i]) * BLOCK for i in range(STORED)]) == STORED
        return keys


@pytest.mark.parametrize("runtime", ["asyncio", "trio"])
def test_pipelined_lookups_among_other_requests_each_get_their_answer(
    tmp_path: Path, runtime: str
) -> None:
    with DaemonProcess(tmp_path / "d", nvme_size="0", runtime=runtime) as daemon:
        keys = _store(daemon)
        peer = _Peer(daemon.socket)
        absent = chain_keys(range(1000, 1004), 1, peer.salt)
        requests: list[tuple[Message, object]] = [
            (LookupRequest(keys[:1]), 1),
            (LookupRequest(keys[:7] + absent), 7),
            (ReadRequest(absent[:1]), BlockNotFoundError),  # not answered from the callback
            (LookupRequest(keys), STORED),
            (StatfsRequest(), None),
            # more keys than the lane answers inline: the reader's LOOKUP, in its turn
            (LookupRequest(keys + chain_keys(range(2000, 2300), 1, peer.salt)), STORED),
            (LookupRequest(absent), 0),
        ]
        expected: dict[int, object] = {}
        stream = b""
        for message, want in requests:
            unique, frame = peer.frame(message)
            expected[unique] = want
            stream += frame
        # and one LOOKUP whose body is not a LOOKUP's: answered EINVAL, the stream goes on
        bad_unique, bad = peer.frame(LookupRequest(keys[:1]))
        bad = bad[:HEADER_BYTES] + b"\xc1" * (len(bad) - HEADER_BYTES)
        expected[bad_unique] = InvalidRequestError
        peer.sock.sendall(stream + bad + peer.frame(LookupRequest(keys[:2]))[1])
        expected[bad_unique + 1] = 2
        replies = {r.header.unique: r for r in peer.replies(len(expected))}
        assert replies.keys() == expected.keys()
        for unique, want in expected.items():
            reply = replies[unique]
            if isinstance(want, type):
                assert isinstance(reply.error, want), (unique, reply)
            elif want is not None:
                assert reply.header.opcode == Opcode.LOOKUP
                assert isinstance(reply.message, LookupReply), (unique, reply)
                assert reply.message.hits == want
                assert reply.message.tiers == bytes(want)  # all in DRAM
        assert isinstance(peer.call(LookupRequest(keys[:3])), LookupReply)
        peer.sock.close()
        assert "handler for" not in daemon.log()  # no internal error


@pytest.mark.parametrize("runtime", ["asyncio", "trio"])
def test_a_peer_that_reads_late_gets_every_lookup_reply_whole(tmp_path: Path, runtime: str) -> None:
    """20,000 LOOKUPs sent before a single reply is read: the daemon's socket fills, a reply
    is left half-written, the reader finishes it before the next; then every reply arrives,
    once, whole, right."""
    with DaemonProcess(tmp_path / "d", nvme_size="0", runtime=runtime) as daemon:
        keys = _store(daemon)
        peer = _Peer(daemon.socket)
        count = 20_000
        frames = []
        for i in range(count):
            _, frame = peer.frame(LookupRequest(keys[: 1 + i % STORED]))
            frames.append(frame)
        sender = threading.Thread(target=peer.sock.sendall, args=(b"".join(frames),))
        sender.start()
        sender.join(2.0)  # the daemon stops reading once its replies back up
        replies = peer.replies(count)
        sender.join()
        hits = sorted(
            (r.header.unique, r.message.hits) for r in replies if isinstance(r.message, LookupReply)
        )
        assert len(hits) == count
        first = hits[0][0]
        assert hits == [(first + i, 1 + i % STORED) for i in range(count)]
        assert isinstance(peer.call(StatfsRequest()), Message)
        peer.sock.close()


@pytest.mark.parametrize("runtime", ["asyncio", "trio"])
def test_replies_left_half_written_by_either_path_keep_request_order(
    tmp_path: Path, runtime: str
) -> None:
    """LOOKUPs (answered by the readiness callback) between STATFSs (answered by the reader)
    and READs (the reader's too, with an error), all sent before a reply is read: the socket
    fills, so replies of both paths are left half-written; the one writer they share finishes
    each before the next, so every reply arrives whole, once, right, and those answered at
    once (LOOKUP, STATFS) arrive in request order."""
    with DaemonProcess(tmp_path / "d", nvme_size="0", runtime=runtime) as daemon:
        keys = _store(daemon)
        peer = _Peer(daemon.socket)
        absent = chain_keys(range(1000, 1001), 1, peer.salt)
        expected: dict[int, object] = {}
        frames = []
        for i in range(6_000):
            message: Message
            if i % 3 == 1:
                message, want = StatfsRequest(), None
            elif i % 30 == 2:
                message, want = ReadRequest(absent), BlockNotFoundError
            else:
                hits = 1 + i % STORED
                message, want = LookupRequest(keys[:hits] + absent), hits
            unique, frame = peer.frame(message)
            expected[unique] = want
            frames.append(frame)
        sender = threading.Thread(target=peer.sock.sendall, args=(b"".join(frames),))
        sender.start()
        sender.join(2.0)  # the daemon stops reading once its replies back up
        replies = peer.replies(len(expected))
        sender.join()
        assert sorted(r.header.unique for r in replies) == sorted(expected)
        at_once = [
            r.header.unique for r in replies if not isinstance(expected[r.header.unique], type)
        ]
        assert at_once == sorted(at_once)
        for reply in replies:
            want = expected[reply.header.unique]
            if isinstance(want, type):
                assert isinstance(reply.error, want), reply
            elif want is None:
                assert reply.header.opcode == Opcode.STATFS, reply
                assert reply.error is None, reply
            else:
                assert isinstance(reply.message, LookupReply), reply
                assert reply.message.hits == want
        assert isinstance(peer.call(StatfsRequest()), Message)
        peer.sock.close()
        assert "handler for" not in daemon.log()  # no internal error


@pytest.mark.parametrize("runtime", ["asyncio", "trio"])
def test_a_peer_that_hangs_up_on_unread_lookup_replies_is_let_go(
    tmp_path: Path, runtime: str
) -> None:
    """LOOKUPs answered from the callback to a peer that never reads them, then closes: the
    session ends (its replies fail to go out, or the socket reports the hang-up) instead of
    waiting on a socket nobody will write to again."""
    with DaemonProcess(tmp_path / "d", nvme_size="0", runtime=runtime) as daemon:
        keys = _store(daemon)
        peer = _Peer(daemon.socket)
        frames = b"".join(peer.frame(LookupRequest(keys[:8]))[1] for _ in range(5_000))
        sender = threading.Thread(target=_send_until_refused, args=(peer.sock, frames))
        sender.start()
        sender.join(2.0)
        peer.sock.shutdown(socket.SHUT_RDWR)  # also ends the sendall blocked on a full socket
        sender.join()
        peer.sock.close()
        deadline = time.monotonic() + 30
        with connect(daemon.socket) as client:  # the peer's session ends: this one is left
            while client.stats()["connections"] > 1:
                assert time.monotonic() < deadline, daemon.log()[-2000:]
                time.sleep(0.05)
            # and the daemon serves on
            assert client.namespace("served-now", block_bytes=BLOCK).lookup(keys) == STORED


def _send_until_refused(sock: socket.socket, data: bytes) -> None:
    with contextlib.suppress(OSError):  # closed under it: the point of the test
        sock.sendall(data)
