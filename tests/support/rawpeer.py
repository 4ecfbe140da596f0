"""A client that speaks the protocol by hand on a plain Unix socket, for attacks."""

from __future__ import annotations

import socket
import struct
from pathlib import Path

from kvtierd.errors import KvtierError
from kvtierd.protocol import ClientConnection, ReplyReceived
from kvtierd.protocol.frames import PROTOCOL_MINOR
from kvtierd.protocol.messages import InitRequest, Message, OpenNsReply, OpenNsRequest
from tests.support.frames import last_word

DEADLINE_S = 30.0  # generous: only a daemon that never answers reaches it


class RawPeer:
    """INIT and OPEN_NS of namespace ``name`` done, then whatever the attack sends. The
    region descriptor OPEN_NS passes is never received (a plain ``recv`` makes the kernel
    close it). Every wait fails after :data:`DEADLINE_S`: a hang is a failure."""

    def __init__(self, path: Path, name: str, block_bytes: int) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(DEADLINE_S)
        self.sock.connect(str(path))
        self.conn = ClientConnection()
        self.ns = 0
        self.call(InitRequest(1, PROTOCOL_MINOR, 1 << 20, "attacker"))
        reply = self.call(OpenNsRequest(name, block_bytes))
        assert isinstance(reply, OpenNsReply)
        self.ns = reply.ns

    def frame(self, message: Message) -> bytes:
        return self.conn.request(message, self.ns)[1]

    def call(self, message: Message) -> Message:
        self.sock.sendall(self.frame(message))
        event = self.next_reply()
        assert event.error is None, event.error
        assert event.message is not None
        return event.message

    def next_reply(self) -> ReplyReceived:
        while True:
            event = self.conn.next_event()
            if isinstance(event, ReplyReceived):
                return event
            data = self.sock.recv(1 << 16)
            if not data:
                raise ConnectionError("the daemon closed the connection")
            self.conn.receive_data(data)

    def reset(self) -> None:
        """Close with an RST (``SO_LINGER`` 0), whatever is unread or unsent."""
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.sock.close()

    def closed_by_daemon(self) -> KvtierError | None:
        """Read until the daemon closes; its last frame's error (fails on a hang)."""
        try:
            return last_word(self.sock, DEADLINE_S)
        finally:
            self.sock.close()
