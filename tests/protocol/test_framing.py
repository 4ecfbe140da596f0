"""(b) h11-style framing: a stream of frames decodes to the same events however it is cut, and
trailing garbage neither corrupts the frames before it nor raises anything but the protocol
error."""

from __future__ import annotations

import itertools

from hypothesis import given
from hypothesis import strategies as st

from kvtierd.errors import RemoteProtocolError
from kvtierd.protocol import (
    NEED_DATA,
    ClientConnection,
    ConnectionClosed,
    ReplyReceived,
    RequestReceived,
)
from kvtierd.protocol.frames import REPLY_MAGIC, REQUEST_MAGIC
from kvtierd.protocol.messages import (
    REQUEST_TYPES,
    DestroyRequest,
    InitRequest,
    LookupRequest,
    Message,
)
from tests.protocol.peers import Outcome, drain, handshake
from tests.protocol.strategies import FAST, garbage, message_strategy, reply_pairs

_non_init_requests = st.lists(
    st.one_of(*(message_strategy(c) for c in REQUEST_TYPES.values() if c is not InitRequest)),
    min_size=1,
    max_size=6,
)


def _split(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({c % (len(data) + 1) for c in cuts})
    bounds = [0, *points, len(data)]
    # b"" would mean end of stream: never a chunk.
    return [data[a:b] for a, b in itertools.pairwise(bounds) if b > a]


def _stop(stop: object) -> object:
    """How a drain ended, comparable across runs (exceptions do not compare equal)."""
    return ("raised", str(stop)) if isinstance(stop, Exception) else stop


def _server_events(stream: bytes, chunks: list[bytes]) -> Outcome:
    """Feed ``stream`` in ``chunks`` to a READY server, pulling events after every chunk."""
    _, server = handshake()
    events: list[object] = []
    stop: object = NEED_DATA
    for chunk in chunks:
        server.receive_data(chunk)
        got, stop = drain(server)
        events += got
        if stop is not NEED_DATA:
            break
    return events, _stop(stop)


def _request_stream(messages: list[Message]) -> bytes:
    client, _ = handshake()
    return b"".join(client.request(m, ns=7)[1] for m in messages)


@FAST
@given(messages=_non_init_requests, cuts=st.lists(st.integers(0, 1 << 16), max_size=12))
def test_requests_decode_the_same_whole_byte_by_byte_and_in_random_splits(
    messages: list[Message], cuts: list[int]
) -> None:
    stream = _request_stream(messages)
    whole = _server_events(stream, [stream])
    received = [e.message for e in whole[0] if isinstance(e, RequestReceived)]
    # A DESTROY ends the conversation: what follows it is a protocol error.
    upto = next((i + 1 for i, m in enumerate(messages) if isinstance(m, DestroyRequest)), None)
    assert received == messages[:upto]
    assert whole[1] is NEED_DATA if upto in (None, len(messages)) else whole[1][0] == "raised"
    assert _server_events(stream, [stream[i : i + 1] for i in range(len(stream))]) == whole
    assert _server_events(stream, _split(stream, cuts)) == whole


@FAST
@given(
    messages=_non_init_requests,
    kinds=st.lists(st.sampled_from([bytes, bytearray, memoryview]), min_size=6, max_size=6),
    tail=st.integers(0, 40),
)
def test_frames_that_arrive_one_whole_frame_per_chunk_decode_the_same(
    messages: list[Message], kinds: list[type], tail: int
) -> None:
    """A chunk that is exactly one frame into an empty buffer is handed back without going
    through the buffer (when it is ``bytes``): it decodes as the whole stream does, whatever
    kind of buffer each chunk is, and a part of the next frame after it still waits for the
    rest."""
    client, _ = handshake()
    frames = [client.request(m, ns=7)[1] for m in messages]
    stream = b"".join(frames)
    whole = _server_events(stream, [stream])
    chunks = [kind(frame) for kind, frame in zip(kinds, frames, strict=False)]
    assert _server_events(stream, chunks) == whole
    # a whole frame, then the head of the next one: the head waits, then completes
    if len(frames) > 1:
        cut = min(tail, len(frames[1]) - 1) + 1
        pieces = [frames[0] + frames[1][:cut], frames[1][cut:], *frames[2:]]
        assert _server_events(stream, [p for p in pieces if p]) == whole


@FAST
@given(
    messages=_non_init_requests.filter(
        lambda ms: not any(isinstance(m, DestroyRequest) for m in ms)
    ),
    junk=garbage(REQUEST_MAGIC),
    cuts=st.lists(st.integers(0, 1 << 16), max_size=6),
)
def test_trailing_garbage_after_requests(
    messages: list[Message], junk: bytes, cuts: list[int]
) -> None:
    stream = _request_stream(messages)
    expected, _ = _server_events(stream, [stream])
    for chunks in ([stream + junk], _split(stream + junk, cuts)):
        _, server = handshake()
        events: list[object] = []
        stop: object = NEED_DATA
        for chunk in chunks:
            server.receive_data(chunk)
            got, stop = drain(server)
            events += got
            if stop is not NEED_DATA:
                break
        assert events == expected
        # Fewer than 8 bytes cannot be judged yet; 8 or more are a bad magic.
        if len(junk) < 8:
            assert stop is NEED_DATA
        else:
            assert isinstance(stop, RemoteProtocolError)
        # End of stream inside the garbage is always the protocol error, never a hang.
        if stop is NEED_DATA:
            server.receive_data(b"")
            assert isinstance(drain(server)[1], RemoteProtocolError)


def _reply_stream(
    pairs: list[tuple[Message, Message]], order: list[int]
) -> tuple[ClientConnection, bytes, list[Message]]:
    """A client with ``pairs`` pending, and the server's replies sent in ``order``."""
    client, server = handshake()
    headers = []
    for request, _ in pairs:
        _, frame = client.request(request)
        server.receive_data(frame)
        event = server.next_event()
        assert isinstance(event, RequestReceived)
        headers.append(event.header)
    stream = b""
    replies: list[Message] = []
    for i in order:
        stream += server.reply(headers[i], pairs[i][1])
        replies.append(pairs[i][1])
    return client, stream, replies


_pairs = st.lists(
    reply_pairs().filter(lambda p: not isinstance(p[0], InitRequest | DestroyRequest)),
    min_size=1,
    max_size=5,
)


@FAST
@given(pairs=_pairs, data=st.data(), cuts=st.lists(st.integers(0, 1 << 16), max_size=12))
def test_out_of_order_replies_decode_the_same_however_cut(
    pairs: list[tuple[Message, Message]], data: st.DataObject, cuts: list[int]
) -> None:
    order = data.draw(st.permutations(range(len(pairs))))
    results: list[Outcome] = []
    for how in ("whole", "bytes", "splits"):
        client, stream, replies = _reply_stream(pairs, order)
        if how == "whole":
            chunks = [stream]
        elif how == "bytes":
            chunks = [stream[i : i + 1] for i in range(len(stream))]
        else:
            chunks = _split(stream, cuts)
        events: list[object] = []
        for chunk in chunks:
            client.receive_data(chunk)
            got, stop = drain(client)
            assert stop is NEED_DATA
            events += got
        assert [e.message for e in events if isinstance(e, ReplyReceived)] == replies
        assert client.pending == 0
        results.append((events, stop))
    assert results[0] == results[1] == results[2]


@FAST
@given(pairs=_pairs, junk=garbage(REPLY_MAGIC))
def test_trailing_garbage_after_replies(pairs: list[tuple[Message, Message]], junk: bytes) -> None:
    client, stream, replies = _reply_stream(pairs, list(range(len(pairs))))
    client.receive_data(stream + junk)
    events, stop = drain(client)
    assert [e.message for e in events if isinstance(e, ReplyReceived)] == replies
    assert stop is NEED_DATA if len(junk) < 8 else isinstance(stop, RemoteProtocolError)


def test_end_of_stream_at_a_frame_boundary_is_connection_closed() -> None:
    _, server = handshake()
    server.receive_data(b"")
    assert isinstance(server.next_event(), ConnectionClosed)
    client, _ = handshake()
    client.receive_data(b"")
    assert isinstance(client.next_event(), ConnectionClosed)


def test_end_of_stream_inside_a_frame_is_a_protocol_error() -> None:
    client, server = handshake()
    _, frame = client.request(LookupRequest([b"k" * 16]))
    server.receive_data(frame[:-1])
    assert server.next_event() is NEED_DATA
    server.receive_data(b"")
    assert isinstance(drain(server)[1], RemoteProtocolError)


def test_fatal_frame_reaches_the_client_as_an_error_with_unique_zero() -> None:
    client, server = handshake()
    client.receive_data(server.fatal(RemoteProtocolError("bad magic")))
    event = client.next_event()
    assert isinstance(event, ReplyReceived)
    assert event.header.unique == 0
    assert event.message is None
    assert isinstance(event.error, RemoteProtocolError)
    assert str(event.error) == "bad magic"
