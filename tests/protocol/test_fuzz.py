"""(c) Any bytes at all produce events or ``RemoteProtocolError``, nothing else: no
``struct.error``, no msgspec exception, no ``IndexError``, no hang, on either side.

Pure noise dies at the magic, so three sources are used: noise; frames with a sound magic but
any version, opcode, length, unique id and body (they reach the state machine and the body
decoder); and valid conversations with bytes flipped, cut or inserted.
"""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from kvtierd.errors import KvtierError, RemoteProtocolError
from kvtierd.protocol import (
    NEED_DATA,
    ClientConnection,
    ConnectionClosed,
    InvalidRequest,
    ReplyReceived,
    RequestReceived,
    ServerConnection,
)
from kvtierd.protocol.messages import REQUEST_TYPES, DestroyRequest, InitRequest, Message
from tests.protocol.peers import drain, handshake, init_frame
from tests.protocol.strategies import (
    THOROUGH,
    message_strategy,
    reply_frames,
    reply_pairs,
    request_frames,
)

_chunks = st.lists(st.binary(min_size=1, max_size=96), max_size=6)


def _feed_server(server: ServerConnection, chunks: list[bytes], eof: bool) -> None:
    for chunk in [*chunks, *([b""] if eof else [])]:
        server.receive_data(chunk)
        events, stop = drain(server)
        for event in events:
            assert isinstance(event, RequestReceived | InvalidRequest)
            if isinstance(event, InvalidRequest):
                assert isinstance(event.error, KvtierError)
                # The owner answers it; that must always be possible.
                server.reply_error(event.header, event.error)
        assert stop is NEED_DATA or isinstance(stop, ConnectionClosed | RemoteProtocolError)
        if stop is not NEED_DATA:
            return


def _feed_client(client: ClientConnection, chunks: list[bytes], eof: bool) -> None:
    for chunk in [*chunks, *([b""] if eof else [])]:
        client.receive_data(chunk)
        events, stop = drain(client)
        for event in events:
            assert isinstance(event, ReplyReceived)
            assert (event.message is None) != (event.error is None)
            assert event.error is None or isinstance(event.error, KvtierError)
        assert stop is NEED_DATA or isinstance(stop, ConnectionClosed | RemoteProtocolError)
        if stop is not NEED_DATA:
            return


@THOROUGH
@given(chunks=_chunks, eof=st.booleans(), ready=st.booleans())
def test_noise_to_the_server(chunks: list[bytes], eof: bool, ready: bool) -> None:
    server = handshake()[1] if ready else ServerConnection()
    _feed_server(server, chunks, eof)


@THOROUGH
@given(
    frames=st.lists(request_frames, min_size=1, max_size=3), eof=st.booleans(), ready=st.booleans()
)
def test_framed_junk_to_the_server(frames: list[bytes], eof: bool, ready: bool) -> None:
    server = handshake(server_max_frame_bytes=4096)[1] if ready else ServerConnection(4096)
    _feed_server(server, [b"".join(frames)], eof)


@THOROUGH
@given(chunks=_chunks, eof=st.booleans())
def test_noise_to_the_client(chunks: list[bytes], eof: bool) -> None:
    client, _ = handshake()
    _feed_client(client, chunks, eof)


@st.composite
def _client_with_pending(draw: st.DrawFn) -> ClientConnection:
    """A client after INIT with a few requests of any opcode awaiting replies (uniques 2..)."""
    client, _ = handshake()
    requests = draw(
        st.lists(st.one_of(*(message_strategy(c) for c in REQUEST_TYPES.values())), max_size=4)
    )
    for request in requests:
        client.request(request)
    return client


@THOROUGH
@given(
    client=_client_with_pending(),
    frames=st.lists(reply_frames, min_size=1, max_size=3),
    eof=st.booleans(),
)
def test_framed_junk_to_the_client(
    client: ClientConnection, frames: list[bytes], eof: bool
) -> None:
    _feed_client(client, [b"".join(frames)], eof)


def _mutate(data: bytes, edits: list[tuple[int, int, int]]) -> bytes:
    buffer = bytearray(data)
    for kind, position, value in edits:
        if not buffer:
            break
        at = position % len(buffer)
        if kind == 0:
            buffer[at] ^= 1 << (value % 8)
        elif kind == 1:
            buffer[at] = value & 0xFF
        elif kind == 2:
            del buffer[at : at + 1 + value % 4]
        else:
            buffer[at:at] = bytes([value & 0xFF])
    return bytes(buffer)


_edits = st.lists(
    st.tuples(st.integers(0, 3), st.integers(0, 1 << 16), st.integers(0, 255)),
    min_size=1,
    max_size=4,
)


@THOROUGH
@given(
    messages=st.lists(
        st.one_of(*(message_strategy(c) for c in REQUEST_TYPES.values())), max_size=4
    ),
    edits=_edits,
    eof=st.booleans(),
)
def test_mutated_conversation_to_the_server(
    messages: list[Message], edits: list[tuple[int, int, int]], eof: bool
) -> None:
    client = ClientConnection()
    stream = init_frame(client) + b"".join(client.request(m, ns=1)[1] for m in messages)
    _feed_server(ServerConnection(), [_mutate(stream, edits)], eof)


@THOROUGH
@given(
    pairs=st.lists(
        reply_pairs().filter(lambda p: not isinstance(p[0], InitRequest | DestroyRequest)),
        max_size=4,
    ),
    edits=_edits,
    eof=st.booleans(),
)
def test_mutated_replies_to_the_client(
    pairs: list[tuple[Message, Message]], edits: list[tuple[int, int, int]], eof: bool
) -> None:
    client, server = handshake()
    stream = b""
    for request, reply in pairs:
        server.receive_data(client.request(request)[1])
        event = server.next_event()
        if isinstance(event, RequestReceived):
            stream += server.reply(event.header, reply)
    _feed_client(client, [_mutate(stream, edits)], eof)
