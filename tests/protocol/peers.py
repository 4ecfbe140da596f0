"""Connected pairs of sans-IO connections and a loop that drains events, for the protocol tests."""

from __future__ import annotations

from kvtierd.errors import RemoteProtocolError
from kvtierd.protocol import (
    DEFAULT_MAX_FRAME_BYTES,
    NEED_DATA,
    ClientConnection,
    ConnectionClosed,
    FrameFlags,
    ReplyReceived,
    RequestReceived,
    ServerConnection,
)
from kvtierd.protocol.frames import PROTOCOL_MINOR
from kvtierd.protocol.messages import InitReply, InitRequest, Message

__all__ = ["INIT_REPLY", "Outcome", "drain", "handshake", "init_frame", "reply_body_to"]

INIT_REPLY = InitReply(1, 0, DEFAULT_MAX_FRAME_BYTES, 256, 8192, 64 << 20, "test")

#: What draining a connection produced: the events, then how it stopped (NEED_DATA, the
#: ConnectionClosed event, or the RemoteProtocolError raised).
Outcome = tuple[list[object], object]


def init_frame(client: ClientConnection, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> bytes:
    """A current client's INIT (its minor decides which reply fields the server sends)."""
    return client.request(InitRequest(1, PROTOCOL_MINOR, max_frame_bytes, "test"))[1]


def handshake(
    server_max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES, reply: InitReply = INIT_REPLY
) -> tuple[ClientConnection, ServerConnection]:
    """A client and a server that completed INIT (the server is READY)."""
    client, server = ClientConnection(), ServerConnection(server_max_frame_bytes)
    server.receive_data(init_frame(client))
    event = server.next_event()
    assert isinstance(event, RequestReceived)
    client.receive_data(server.reply(event.header, reply, FrameFlags.FD_ATTACHED))
    answer = client.next_event()
    assert isinstance(answer, ReplyReceived)
    assert answer.message == reply
    return client, server


def drain(conn: ServerConnection | ClientConnection, limit: int = 10_000) -> Outcome:
    """Pull events until the connection needs data, closes, or raises RemoteProtocolError.

    Any other exception propagates: that is what the tests look for.
    """
    events: list[object] = []
    for _ in range(limit):
        try:
            event = conn.next_event()
        except RemoteProtocolError as exc:
            return events, exc
        if event is NEED_DATA or isinstance(event, ConnectionClosed):
            return events, event
        events.append(event)
    raise AssertionError("next_event() never asked for more data")


def reply_body_to(minor: int, request: Message, reply: Message) -> bytes:
    """The body of ``reply`` to ``request`` as a server sends it to a client whose INIT said
    ``minor`` (fields appended after that minor left out)."""
    client, server = ClientConnection(), ServerConnection()
    server.receive_data(client.request(InitRequest(1, minor, DEFAULT_MAX_FRAME_BYTES))[1])
    server.next_event()
    server.receive_data(client.request(request)[1])
    event = server.next_event()
    assert isinstance(event, RequestReceived)
    return server.reply(event.header, reply)[32:]
