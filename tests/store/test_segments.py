"""SegmentMap's slot accounting: what is used, what is free, and what may be returned."""

from __future__ import annotations

import pytest

from kvtierd.store.records import PAGE_BYTES
from kvtierd.store.segments import DiskSlot, SegmentMap, slot_bytes_for

FILE_ID = bytes(range(16))
SLOT = slot_bytes_for(PAGE_BYTES)  # a header page and one payload page


def _map(slots_per_segment: int = 4, segments: int = 4) -> SegmentMap:
    file_bytes = PAGE_BYTES + segments * (PAGE_BYTES + slots_per_segment * SLOT)
    return SegmentMap(FILE_ID, file_bytes, slots_per_segment * SLOT)


def _carve(segmap: SegmentMap, *, all_free: bool = True) -> int:
    header = segmap.plan_segment(SLOT)
    assert header is not None
    return segmap.add_segment(header, all_free=all_free)


def test_allocate_free_and_reuse_count_bytes() -> None:
    segmap = _map()
    _carve(segmap)
    taken = [segmap.allocate(SLOT) for _ in range(4)]
    assert None not in taken
    assert segmap.allocate(SLOT) is None  # the segment is full
    assert segmap.used_bytes == 4 * SLOT
    first = taken[0]
    assert first is not None
    segmap.free(first)
    assert segmap.used_bytes == 3 * SLOT
    again = segmap.allocate(SLOT)
    assert again == first
    assert segmap.used_bytes == 4 * SLOT


def test_a_slot_cannot_be_freed_twice_or_unless_used() -> None:
    segmap = _map()
    _carve(segmap)
    slot = segmap.allocate(SLOT)
    assert slot is not None
    segmap.free(slot)
    with pytest.raises(ValueError, match="not in use"):
        segmap.free(slot)
    for bogus in (
        DiskSlot(0, 3, 0, SLOT),  # never allocated
        DiskSlot(5, 0, 0, SLOT),  # no such segment
        DiskSlot(0, 9, 0, SLOT),  # no such slot
        DiskSlot(0, -1, 0, SLOT),  # never wraps around
        DiskSlot(-1, 0, 0, SLOT),
    ):
        with pytest.raises(ValueError, match="not in use"):
            segmap.free(bogus)
    assert segmap.used_bytes == 0


def test_recovery_marks_used_and_adopts_the_rest_as_free() -> None:
    segmap = _map()
    number = _carve(segmap, all_free=False)
    used = segmap.mark_used(number, 2)
    assert used.offset == segmap.segments[number].slot_offset(2)
    assert segmap.mark_used(number, 2) == used  # marking again counts once
    assert segmap.used_bytes == SLOT
    segmap.adopt_free(number, [0, 1, 3])
    taken = {segmap.allocate(SLOT) for _ in range(3)}
    assert {slot.index for slot in taken if slot is not None} == {0, 1, 3}
    assert segmap.allocate(SLOT) is None
    segmap.free(used)
    assert segmap.used_bytes == 3 * SLOT


def test_segments_keep_their_own_accounting() -> None:
    segmap = _map()
    for _ in range(2):
        _carve(segmap)
    slots = [segmap.allocate(SLOT) for _ in range(8)]
    assert {slot.segment for slot in slots if slot is not None} == {0, 1}
    for slot in slots:
        assert slot is not None
        segmap.free(slot)
    assert segmap.used_bytes == 0


def test_a_free_slot_can_be_claimed_and_no_other() -> None:
    """``claim`` takes one particular free slot (what zeroing a failed write's leftovers needs:
    no write may be given the slot meanwhile), and refuses one in use or taken already."""
    segmap = _map()
    _carve(segmap)
    taken = [segmap.allocate(SLOT) for _ in range(4)]
    assert None not in taken
    a, b, c, _ = (slot for slot in taken if slot is not None)
    for slot in (a, b, c):
        segmap.free(slot)
    assert not segmap.claim(taken[3])  # type: ignore[arg-type]  # in use
    assert segmap.claim(b)  # from the middle of the free slots
    assert not segmap.claim(b)  # taken already
    assert segmap.used_bytes == 2 * SLOT
    segmap.free(b, last=True)  # handed out after the others, which keep their order
    assert [segmap.allocate(SLOT) for _ in range(4)] == [c, a, b, None]
