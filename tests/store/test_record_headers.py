"""records.record_headers (numpy, a run of slot headers at once) against RecordHeader.unpack,
with the header checksums taken by the native module and by Python alike."""

from __future__ import annotations

import importlib.util
import mmap
from unittest import mock

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtierd.store import records
from kvtierd.store.copyhash import DEFAULT_MODULE, CopyHasher
from kvtierd.store.nvme import _as_indexed
from kvtierd.store.records import PAGE_BYTES, CorruptRecord, RecordHeader, record_headers
from kvtierd.store.refs import BlockRef

_NATIVE = CopyHasher(DEFAULT_MODULE)
_PYTHON = CopyHasher("")
HASHERS = [
    pytest.param(_PYTHON, id="python"),
    pytest.param(
        _NATIVE,
        id="native",
        marks=pytest.mark.skipif(
            importlib.util.find_spec(DEFAULT_MODULE) is None, reason="not built here"
        ),
    ),
]

SLOT = 2 * PAGE_BYTES

pages = st.one_of(
    st.builds(
        lambda digest, key, stored, seq, flags: RecordHeader(
            digest, key, stored, stored + 1, seq * 31 % (1 << 64), seq, flags
        ).pack(),
        st.binary(min_size=16, max_size=16),
        st.binary(min_size=1, max_size=32),
        st.integers(1, 3 * PAGE_BYTES),  # some too large for a two-page slot
        st.integers(0, (1 << 64) - 1),
        st.integers(0, 1),
    ),
    st.just(bytes(PAGE_BYTES)),
    st.binary(min_size=PAGE_BYTES, max_size=PAGE_BYTES),
)


@pytest.mark.parametrize("hasher", HASHERS)
@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(pages, st.integers(0, 100), st.integers(0, 255)), max_size=24))
def test_every_header_unpack_accepts_and_that_fits_is_found(
    hasher: CopyHasher, listed: list[tuple[bytes, int, int]]
) -> None:
    verdict = hasher.verdict(wait=True)
    assert verdict is not None
    assert hasher.native == verdict.ok == (hasher is _NATIVE)
    buffer = mmap.mmap(-1, max(1, len(listed)) * SLOT)
    expected: dict[int, RecordHeader] = {}
    for i, (page, flip_at, flip) in enumerate(listed):
        page = bytearray(page)
        if flip_at < 92:  # inside the fields or their checksum: usually a torn header
            page[flip_at] ^= flip
        buffer[i * SLOT : i * SLOT + PAGE_BYTES] = bytes(page)
        try:
            header = RecordHeader.unpack(page)
        except CorruptRecord:
            continue
        if PAGE_BYTES + -(-header.stored_bytes // PAGE_BYTES) * PAGE_BYTES <= SLOT:
            expected[i] = header
    with mock.patch.object(records, "checksums_each", hasher.each):  # this hasher, not the default
        found, fields = record_headers(buffer, SLOT, len(listed), SLOT)
    assert found.tolist() == sorted(expected)
    for j, i in enumerate(found.tolist()):
        klen = int(fields["klen"][j])
        key = fields["key"][j].tobytes()
        assert key == expected[i].key.ljust(32, b"\0")  # zero past the key
        got = RecordHeader(
            bytes(fields["digest"][j]),
            key[:klen],
            int(fields["stored"][j]),
            int(fields["raw"][j]),
            int(fields["checksum"][j]),
            int(fields["seq"][j]),
            int(fields["flags"][j]),
        )
        assert got == expected[i]


@settings(max_examples=50, deadline=None)
@given(junk=st.binary(min_size=1, max_size=64), seq=st.integers(0, 2**63 - 1))
def test_a_page_is_read_by_its_sealed_bytes_alone(junk: bytes, seq: int) -> None:
    """What a reader compares of a header page (``sealed``) is the start of the page written
    (``pack``) and all that ``unpack`` reads: padding of any bytes changes nothing."""
    header = RecordHeader(b"d" * 16, b"key", 4096, 4096, 7, seq, 0)
    sealed = header.sealed()
    assert header.pack() == sealed + bytes(PAGE_BYTES - len(sealed))
    page = sealed + (junk * PAGE_BYTES)[: PAGE_BYTES - len(sealed)]
    assert RecordHeader.unpack(page) == header
    damaged = bytearray(page)
    damaged[len(sealed) - 1] ^= 1  # the checksum's last byte
    with pytest.raises(CorruptRecord):
        RecordHeader.unpack(damaged)


def test_a_cold_read_takes_a_page_of_its_indexed_record_without_unpacking_it() -> None:
    """The cold read's fast check (``nvme._as_indexed``) accepts the page the index's record
    packs to, whatever its padding holds, and nothing else: another seq or key, or a page
    whose sealed bytes changed, goes to the full check."""
    header = RecordHeader(b"d" * 16, b"key", 4096, 4096, 7, 42, 0)
    ref = BlockRef(b"d" * 16, b"key", 4096, 7, 42)
    page = bytearray(header.pack())
    assert _as_indexed(memoryview(page), header, ref)
    page[-1] = 0xFF  # padding: nothing reads it
    assert _as_indexed(memoryview(page), header, ref)
    assert not _as_indexed(memoryview(page), header, BlockRef(b"d" * 16, b"key", 4096, 7, 43))
    assert not _as_indexed(memoryview(page), header, BlockRef(b"d" * 16, b"kez", 4096, 7, 42))
    page[20] ^= 1  # inside the sealed fields
    assert not _as_indexed(memoryview(page), header, ref)
