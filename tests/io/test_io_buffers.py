"""The pure parts of the io layer: advancing over partial transfers, and which registered chunk
(fixed buffer index) holds a request."""

from __future__ import annotations

import itertools
import mmap

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvtierd.errors import InvalidRequestError
from kvtierd.io.base import advance, check_request
from kvtierd.io.buffers import FixedRegions, advance_spans, buffer_address

lengths = st.lists(st.integers(1, 64), min_size=1, max_size=8)


@given(lengths, st.data())
def test_advance_leaves_exactly_the_untransferred_suffix(
    sizes: list[int], data: st.DataObject
) -> None:
    whole = bytes(range(256)) * 2
    views, pos = [], 0
    for size in sizes:
        views.append(memoryview(whole)[pos : pos + size])
        pos += size
    moved = data.draw(st.integers(0, pos))
    rest = advance(views, moved)
    assert b"".join(bytes(v) for v in rest) == whole[moved:pos]
    assert all(len(v) > 0 for v in rest)
    spans = advance_spans([(1000 + sum(sizes[:i]), size) for i, size in enumerate(sizes)], moved)
    assert [length for _, length in spans] == [len(v) for v in rest]
    if spans:
        assert spans[0][0] == 1000 + moved
        assert all(a + n == b for (a, n), (b, _) in itertools.pairwise(spans))


@given(
    chunk=st.integers(1, 64),
    nbytes=st.integers(1, 256),
    spans=st.lists(st.tuples(st.integers(-16, 300), st.integers(1, 80)), min_size=1, max_size=4),
)
def test_index_for_names_the_one_chunk_holding_every_span(
    chunk: int, nbytes: int, spans: list[tuple[int, int]]
) -> None:
    start = 10_000
    regions = FixedRegions(start, nbytes, chunk)
    absolute = [(start + offset, length) for offset, length in spans]
    index = regions.index_for(absolute)
    owners = {
        i
        for i, (base, size) in enumerate(regions.chunks())
        for address, length in absolute
        if base <= address and address + length <= base + size
    }
    inside_one = all(
        any(base <= a and a + n <= base + size for base, size in regions.chunks())
        for a, n in absolute
    )
    if inside_one and len(owners) == 1:
        assert index == owners.pop()
    else:
        assert index is None
    assert sum(size for _, size in regions.chunks()) == nbytes


def test_regions_refuse_chunks_past_the_kernel_limit() -> None:
    with pytest.raises(ValueError, match="chunk_bytes"):
        FixedRegions(0, 1, (1 << 30) + 1)
    assert len(FixedRegions(0, 3 << 30, 1 << 30).chunks()) == 3


def test_buffer_address_lets_go_of_the_export() -> None:
    mapping = mmap.mmap(-1, 8192)
    view = memoryview(mapping)
    address = buffer_address(view)
    assert address % mmap.PAGESIZE == 0
    assert buffer_address(view[4096:].toreadonly()) == address + 4096
    view.release()
    mapping.close()  # raises BufferError if an export were still held


def test_check_request_rejects_malformed_requests() -> None:
    data = memoryview(bytearray(16))
    for fd, offset, buffers, message in [
        (3, -1, [data], "negative file offset"),
        (3, 0, [], "no buffers"),
        (3, 0, [data[:0]], "empty buffer"),
        (3, 0, [data[::2]], "contiguous"),
        (3, 0, [data] * 1025, "at most 1024"),
    ]:
        with pytest.raises(InvalidRequestError, match=message):
            check_request(fd, offset, buffers)
    (flat,) = check_request(3, 0, [memoryview(bytearray(16)).cast("I")])
    assert (flat.format, flat.nbytes) == ("B", 16)
