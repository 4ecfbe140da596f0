"""``copy_verified``: the client's one pass that copies a block out of the arena and hashes the
copy, over any split of the destination into buffers."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from kvtierd.client.arena import copy_verified
from kvtierd.store.records import checksum

blocks = st.binary(min_size=0, max_size=600 << 10)


@st.composite
def split(draw: st.DrawFn, length: int) -> list[int]:
    """Sizes of buffers that hold ``length`` bytes (and maybe some to spare)."""
    cuts = sorted(draw(st.lists(st.integers(0, length), max_size=5)))
    sizes = [b - a for a, b in zip([0, *cuts], [*cuts, length], strict=True)]
    return [*sizes, draw(st.integers(0, 3))]  # a spare tail buffer the block does not fill


@given(data=st.data(), source=blocks)
def test_the_copy_is_the_source_in_order_and_its_hash_is_checked(
    data: st.DataObject, source: bytes
) -> None:
    targets = [memoryview(bytearray(n)) for n in data.draw(split(len(source)))]
    assert copy_verified(memoryview(source), targets, checksum(source))
    assert b"".join(bytes(t) for t in targets)[: len(source)] == source
    assert not copy_verified(memoryview(source), targets, checksum(source) ^ 1)


@given(source=st.binary(min_size=1, max_size=300 << 10), short=st.integers(1, 4096))
def test_buffers_too_short_for_the_block_never_verify(source: bytes, short: int) -> None:
    room = max(0, len(source) - short)
    targets = [memoryview(bytearray(room // 2)), memoryview(bytearray(room - room // 2))]
    assert not copy_verified(memoryview(source), targets, checksum(source[:room]))
