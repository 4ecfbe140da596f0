"""The exporter's control frames (:mod:`kvtierd.nixl.control`) and its restart back-off
(:mod:`kvtierd.nixl.restarts`): pure, no NIXL."""

from __future__ import annotations

import contextlib
import struct

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvtierd.errors import RemoteProtocolError
from kvtierd.nixl.control import (
    MAX_FRAME_BYTES,
    FrameDecoder,
    FromExporter,
    Pull,
    Pulled,
    Ready,
    Stir,
    ToExporter,
    encode,
)
from kvtierd.nixl.restarts import RestartBackoff

U64 = st.integers(0, (1 << 64) - 1)
TO_EXPORTER = st.one_of(
    st.builds(Stir),
    st.builds(Pull, U64, st.text(), st.binary(), st.binary(), U64, U64, st.floats(0, 1e6)),
)
FROM_EXPORTER = st.one_of(
    st.builds(Ready, st.text(), U64, U64, st.binary()),
    st.builds(Pulled, U64, st.integers(0, 200), st.text()),
)


@given(st.lists(TO_EXPORTER, max_size=5), st.integers(1, 64))
def test_messages_to_an_exporter_decode_whole_or_in_pieces(
    messages: list[Stir | Pull], piece: int
) -> None:
    stream = b"".join(encode(m) for m in messages)
    whole: FrameDecoder[ToExporter] = FrameDecoder(ToExporter)
    assert whole.feed(stream) == messages
    split: FrameDecoder[ToExporter] = FrameDecoder(ToExporter)
    got = [m for i in range(0, len(stream), piece) for m in split.feed(stream[i : i + piece])]
    assert got == messages
    assert split.pending_bytes == 0


@given(st.lists(FROM_EXPORTER, max_size=5))
def test_messages_from_an_exporter_round_trip(messages: list[Ready | Pulled]) -> None:
    decoder: FrameDecoder[FromExporter] = FrameDecoder(FromExporter)
    assert decoder.feed(b"".join(encode(m) for m in messages)) == messages


def test_a_frame_is_a_little_endian_length_and_a_tagged_map() -> None:
    frame = encode(Pulled(7, 5, "EIO"))
    (length,) = struct.unpack_from("<I", frame)
    assert length == len(frame) - 4
    assert msgspec.msgpack.decode(frame[4:]) == {"type": "pulled", "id": 7, "errno": 5,
                                                 "message": "EIO"}  # fmt: skip


def test_a_message_of_the_other_direction_is_a_protocol_error() -> None:
    decoder: FrameDecoder[ToExporter] = FrameDecoder(ToExporter)
    with pytest.raises(RemoteProtocolError, match="not a control message"):
        decoder.feed(encode(Pulled(1)))


@given(st.binary(min_size=1, max_size=64))
def test_garbage_is_a_protocol_error_or_an_incomplete_frame(garbage: bytes) -> None:
    decoder: FrameDecoder[FromExporter] = FrameDecoder(FromExporter)
    with contextlib.suppress(RemoteProtocolError):
        assert decoder.feed(struct.pack("<I", len(garbage)) + garbage) == []


def test_an_oversized_frame_is_refused_before_it_arrives() -> None:
    decoder: FrameDecoder[FromExporter] = FrameDecoder(FromExporter)
    with pytest.raises(RemoteProtocolError, match="over the limit"):
        decoder.feed(struct.pack("<I", MAX_FRAME_BYTES + 1))


def test_a_back_off_doubles_while_an_exporter_keeps_dying_young() -> None:
    backoff = RestartBackoff(first_s=0.5, max_s=4.0, healthy_s=30.0)
    assert [backoff.died(1.0) for _ in range(6)] == [0.5, 1.0, 2.0, 4.0, 4.0, 4.0]
    assert backoff.died(30.0) == 0.5  # it served a while: a fresh start
    assert backoff.died(0.0) == 1.0


def test_a_back_off_must_be_one() -> None:
    with pytest.raises(ValueError, match="back-off"):
        RestartBackoff(first_s=5.0, max_s=1.0)
