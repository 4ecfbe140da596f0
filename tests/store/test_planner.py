"""The residency planner (:func:`kvtierd.store.planner.reserve`) against a dict model of a region:
blocks by id with their slots, an LRU order, some pinned. Hypothesis drives reservations of mixed
sizes, pins and frees, and checks every plan against what the model says is allowed."""

from __future__ import annotations

import copy

from hypothesis import given, settings
from hypothesis import strategies as st

from kvtierd.store.planner import reserve
from kvtierd.store.slots import Slot, SlotAllocator

PAGE = 4096
CAPACITY = 16 * PAGE
SIZES = [PAGE, 2 * PAGE, 3 * PAGE, 4 * PAGE]

ops = st.lists(
    st.one_of(
        st.tuples(st.just("reserve"), st.sampled_from(SIZES)),
        st.tuples(st.just("pin"), st.integers(0, 200)),
        st.tuples(st.just("free"), st.integers(0, 200)),
    ),
    min_size=10,
    max_size=120,
)


class Region:
    """The model: which block holds which slot, in LRU order (oldest first), which are pinned."""

    def __init__(self) -> None:
        self.allocator = SlotAllocator(0, CAPACITY, PAGE)
        self.slots: dict[int, Slot] = {}  # insertion order = LRU order
        self.pinned: set[int] = set()
        self.next_id = 0

    def victims(self, n: int, eligible: object) -> list[int]:
        assert callable(eligible)
        return [b for b in self.slots if b not in self.pinned and eligible(b)][:n]

    def evictable(self) -> list[int]:
        return [b for b in self.slots if b not in self.pinned]


@settings(max_examples=300, deadline=None)
@given(ops)
def test_plans_follow_the_rules(operations: list[tuple[str, int]]) -> None:
    region = Region()
    for op, arg in operations:
        if op == "pin" and region.slots:
            region.pinned ^= {list(region.slots)[arg % len(region.slots)]}
            continue
        if op == "free" and region.slots:
            block = list(region.slots)[arg % len(region.slots)]
            region.allocator.free(region.slots.pop(block))
            region.pinned.discard(block)
            continue
        if op != "reserve":
            continue
        nbytes = arg
        could_fit_now = copy.deepcopy(region.allocator).allocate(nbytes) is not None
        candidates = region.evictable()
        same_class = [b for b in candidates if region.slots[b].size == nbytes]

        plan = reserve(region.allocator, nbytes, region.victims, region.slots.__getitem__)

        evicted = list(plan.evictions)
        assert len(set(evicted)) == len(evicted), "a block evicted twice"
        assert set(evicted) <= set(candidates), "a pinned or unknown block evicted"
        if could_fit_now:
            assert plan.slot is not None
            assert not evicted, "evicted although the block fitted"
        if evicted and same_class:  # the first batch is the oldest blocks of the same class
            assert evicted[: min(16, len(same_class))] == same_class[:16]
        if evicted and not same_class:
            assert evicted[0] == candidates[0], "not the oldest candidate"
        if plan.slot is None:
            assert set(evicted) == set(candidates), "gave up with candidates left"
        for block in evicted:
            del region.slots[block]
        if plan.slot is not None:
            assert plan.slot.size >= nbytes
            assert region.allocator.is_live(plan.slot)
            region.slots[region.next_id] = plan.slot
            region.next_id += 1
        for block, slot in region.slots.items():
            assert region.allocator.is_live(slot), f"block {block}'s slot was taken"
        assert region.allocator.used_bytes == sum(s.size for s in region.slots.values())


def test_a_pinned_region_gives_no_slot_and_evicts_nothing() -> None:
    region = Region()
    while (slot := region.allocator.allocate(4 * PAGE)) is not None:
        region.slots[region.next_id] = slot
        region.pinned.add(region.next_id)
        region.next_id += 1
    plan = reserve(region.allocator, PAGE, region.victims, region.slots.__getitem__)
    assert plan.slot is None
    assert plan.evictions == ()
