"""The arena's slot allocator against a model: no overlap, exact accounting, stale refs refused."""

from __future__ import annotations

import itertools
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtierd.store.slots import Slot, SlotAllocator

sizes = st.sampled_from([4096, 8192, 12288, 20000, 65536, 100000])
ops = st.lists(st.tuples(st.booleans(), sizes, st.integers(0, 10**6)), max_size=200)


@settings(max_examples=150, deadline=None)
@given(ops)
def test_live_slots_never_overlap_and_accounting_is_exact(
    steps: list[tuple[bool, int, int]],
) -> None:
    alloc = SlotAllocator(4096, 1 << 20)
    live: list[Slot] = []
    for free, size, pick in steps:
        if free and live:
            alloc.free(live.pop(pick % len(live)))
            continue
        slot = alloc.allocate(size)
        if slot is None:
            assert alloc.free_bytes < alloc.size_class(size) or live
            continue
        assert slot.size >= size
        assert slot.offset % 4096 == 0
        live.append(slot)
        spans = sorted((s.offset, s.offset + s.size) for s in live)
        assert all(a[1] <= b[0] for a, b in itertools.pairwise(spans))
        assert spans[0][0] >= 4096
        assert spans[-1][1] <= 4096 + (1 << 20)
        assert alloc.used_bytes == sum(s.size for s in live)


def test_freed_slot_of_the_same_class_is_reused_in_place() -> None:
    alloc = SlotAllocator(0, 1 << 20)
    first = alloc.allocate(5000)
    assert first is not None
    alloc.free(first)
    again = alloc.allocate(8000)
    assert again is not None
    assert again.offset == first.offset
    assert again.generation == first.generation + 1


def test_stale_reference_and_double_free_are_refused() -> None:
    alloc = SlotAllocator(0, 1 << 16)
    slot = alloc.allocate(4096)
    assert slot is not None
    alloc.free(slot)
    assert not alloc.is_live(slot)
    with pytest.raises(ValueError):
        alloc.free(slot)


def test_full_region_returns_none_then_merges_free_neighbours() -> None:
    alloc = SlotAllocator(0, 4 * 4096)
    small = [alloc.allocate(4096) for _ in range(4)]
    assert all(s is not None for s in small)
    assert alloc.allocate(4096) is None
    for s in small[:2]:
        assert s is not None
        alloc.free(s)
    merged = alloc.allocate(8192)
    assert merged is not None
    assert merged.offset == 0
    assert merged.size == 8192


def test_no_slot_crosses_a_boundary() -> None:
    alloc = SlotAllocator(4096, 1 << 20, boundary=1 << 18)
    slots = [alloc.allocate(100_000) for _ in range(8)]
    for slot in slots:
        if slot is not None:
            assert slot.offset // (1 << 18) == (slot.offset + slot.size - 1) // (1 << 18)


@settings(max_examples=150, deadline=None)
@given(ops, st.lists(st.tuples(st.booleans(), sizes), max_size=60))
def test_adopted_slots_stay_in_use_and_the_rest_is_allocatable(
    before: list[tuple[bool, int, int]], after: list[tuple[bool, int]]
) -> None:
    """A restarted daemon's allocator takes its predecessor's live slots (the DRAM it kept):
    they stay exactly where they were, nothing allocated later overlaps them, no slot crosses
    the boundary, and the accounting is exact."""
    boundary = 256 << 10
    old = SlotAllocator(4096, 1 << 20, boundary=boundary)
    live: list[Slot] = []
    for free, size, pick in before:
        if free and live:
            old.free(live.pop(pick % len(live)))
        elif (slot := old.allocate(size)) is not None:
            live.append(slot)
    new = SlotAllocator(4096, 1 << 20, boundary=boundary)
    kept = new.adopt(sorted((s.offset, s.size) for s in live))
    assert [(s.offset, s.size) for s in kept] == sorted((s.offset, s.size) for s in live)
    assert all(new.is_live(s) for s in kept)
    assert new.used_bytes == sum(s.size for s in live)
    held = list(kept)
    for free, size in after:
        if free and len(held) > len(kept):
            new.free(held.pop())
        elif (slot := new.allocate(size)) is not None:
            held.append(slot)
        spans = sorted((s.offset, s.offset + s.size) for s in held)
        assert all(a[1] <= b[0] for a, b in itertools.pairwise(spans))
        assert new.used_bytes == sum(s.size for s in held)
        assert all((s.offset + s.size - 1) // boundary == s.offset // boundary for s in held)


@pytest.mark.parametrize(
    "spans",
    [
        [(4096, 8192), (8192, 4096)],  # overlapping
        [(4097, 4096)],  # not aligned
        [(4096, 5000)],  # not a whole size class
        [(4096 + (1 << 20) - 4096, 8192)],  # past the region
        [(0, 4096)],  # before the region
    ],
)
def test_adopting_a_bad_span_is_refused_and_changes_nothing(spans: list[tuple[int, int]]) -> None:
    alloc = SlotAllocator(4096, 1 << 20)
    with pytest.raises(ValueError):
        alloc.adopt(spans)
    assert alloc.used_bytes == 0
    assert alloc.allocate(4096) is not None


def test_only_a_fresh_allocator_adopts() -> None:
    alloc = SlotAllocator(0, 1 << 20)
    assert alloc.allocate(4096) is not None
    with pytest.raises(ValueError, match="fresh"):
        alloc.adopt([(8192, 4096)])


def test_after_adoption_blocks_of_the_same_size_fill_the_gaps_without_a_merge(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Half of a region's 64 KiB blocks kept at random: the other half's places are free slots
    of that size, each allocation popped from its free list (a merge sorts every free slot: a
    million of them would hold the loop for seconds)."""
    size, count = 64 << 10, 512
    alloc = SlotAllocator(0, size * count, boundary=1 << 20)
    kept = sorted(random.Random(5).sample(range(count), count // 2))
    alloc.adopt([(i * size, size) for i in kept])
    merges = 0
    merge = alloc._merge

    def counted(wanted: int) -> int | None:
        nonlocal merges
        merges += 1
        return merge(wanted)

    monkeypatch.setattr(alloc, "_merge", counted)
    got = [alloc.allocate(size) for _ in range(count - len(kept))]
    assert all(slot is not None for slot in got)
    assert merges == 0
    assert alloc.allocate(size) is None  # full
    assert alloc.used_bytes == size * count
