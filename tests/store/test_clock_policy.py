"""ClockPolicy over a real cold index: second chance, eligible and held blocks, rows freed and
added under the hand, a bounded sweep, and (hypothesis) victims that are always stored,
evictable rows, with a block read since the hand last passed outliving every idle one."""

from __future__ import annotations

from collections.abc import Hashable

import numpy as np
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvtierd.store.clock import MAX_CHECKS, WINDOW, ClockPolicy
from kvtierd.store.coldindex import ColdIndex
from kvtierd.store.records import RecordHeader
from kvtierd.store.segments import DiskSlot

NS = b"n" * 16


class Disk:
    """A cold index written the way the NVMe tier writes it: a row per record, a place each."""

    def __init__(self, window: int = 5) -> None:
        self.cold = ColdIndex(seed=5, rows=16)
        # A small window: the hand crosses windows' edges in every test.
        self.policy = ClockPolicy(lambda: self.cold, window=window)
        self.seq = 0
        self.place = 0

    def put(self, key: bytes) -> tuple[bytes, bytes]:
        """Write a record of ``key`` (a newer one when it has one) and tell the policy."""
        self.seq += 1
        self.place += 1
        header = RecordHeader(NS, key, 4096, 4096, 0, self.seq, 0)
        self.cold.add(NS, header, 0, self.place)
        self.policy.inserted((NS, key), 0.0)
        return NS, key

    def drop(self, block: Hashable) -> None:
        """Evict ``block``: every row of its key is freed, as the tier discards them."""
        for row in self.cold.rows().tolist():
            if self.cold.identity(row) == block:
                self.cold.remove(row)
        self.policy.removed(block)

    def sweep_all(self) -> None:
        """Clear every reference byte: a call that may take nothing passes every row twice."""
        assert self.policy.victims(1, lambda b: False) == []


def ids(*keys: bytes) -> list[tuple[bytes, bytes]]:
    return [(NS, k) for k in keys]


def test_a_referenced_row_gets_a_second_chance_and_an_idle_one_goes() -> None:
    disk = Disk()
    a, b, c = disk.put(b"a"), disk.put(b"b"), disk.put(b"c")
    # All referenced (an insert is an access): one pass clears them, the second finds a.
    assert disk.policy.victims(1, lambda x: True) == [a]
    disk.policy.accessed(a, 0.0)
    disk.policy.accessed(c, 0.0)
    # a was read again: b goes first, then c and a lose their bytes and a (next) goes.
    assert disk.policy.victims(1, lambda x: True) == [b]
    disk.drop(b)
    assert disk.policy.victims(2, lambda x: True) == [c, a]


def test_reads_told_by_slot_mark_the_rows_at_those_places() -> None:
    disk = Disk()
    a, b, c = disk.put(b"a"), disk.put(b"b"), disk.put(b"c")  # in slots 1, 2, 3 of segment 0
    slot = {a: DiskSlot(0, 1, 0, 4096), b: DiskSlot(0, 2, 0, 4096), c: DiskSlot(0, 3, 0, 4096)}
    for idle in (a, c, b):
        disk.sweep_all()
        disk.policy.accessed_at([slot[x] for x in (a, b, c) if x != idle])
        # places that hold no record mark nothing and raise nothing
        disk.policy.accessed_at([DiskSlot(0, 9, 0, 4096), DiskSlot(7, 1, 0, 4096)])
        assert disk.policy.victims(1, lambda x: True) == [idle]


def test_only_evictable_blocks_not_held_are_offered() -> None:
    disk = Disk()
    blocks = [disk.put(bytes([k])) for k in range(1, 7)]
    disk.sweep_all()
    disk.policy.hold(blocks[0])
    assert disk.policy.victims(9, lambda x: x != blocks[1]) == blocks[2:]
    disk.policy.release(blocks[0])
    assert disk.policy.victims(1, lambda x: x != blocks[1]) == [blocks[0]]
    # A new insertion ends a hold, like LRU's.
    disk.policy.hold(blocks[3])
    disk.policy.inserted(blocks[3], 0.0)
    assert blocks[3] in disk.policy.victims(9, lambda x: True)


def test_an_id_without_a_row_is_held_and_read_without_effect() -> None:
    disk = Disk()
    a = disk.put(b"a")
    dirty = (NS, b"not written yet")
    disk.policy.inserted(dirty, 0.0)
    disk.policy.hold(dirty)
    disk.policy.accessed(dirty, 0.0)
    disk.policy.accessed((b"o" * 16, b"a"), 0.0)  # a namespace the index never saw
    assert disk.policy.victims(4, lambda x: True) == [a]
    disk.put(b"not written yet")  # written back: its row starts referenced
    disk.policy.release(dirty)
    assert disk.policy.victims(4, lambda x: True) == [a, dirty]


def test_rows_freed_under_the_hand_are_never_offered() -> None:
    disk = Disk()
    blocks = [disk.put(bytes([k])) for k in range(1, 9)]
    disk.sweep_all()
    assert disk.policy.victims(2, lambda x: True) == blocks[:2]
    for block in blocks[2:5]:  # freed just ahead of the hand
        disk.drop(block)
    # From the hand on, round to the start.
    assert disk.policy.victims(8, lambda x: True) == [*blocks[5:], *blocks[:2]]


def test_an_older_record_of_a_key_is_not_its_block() -> None:
    disk = Disk()
    a, b = disk.put(b"a"), disk.put(b"b")
    disk.sweep_all()
    disk.put(b"a")  # a newer record: its row is referenced, the old one is not the block's age
    assert disk.policy.victims(1, lambda x: True) == [b]
    assert disk.policy.victims(2, lambda x: True) == [b, a]  # second pass: a's new row


def test_the_table_growing_and_being_replaced_under_the_hand() -> None:
    disk = Disk()
    first = [disk.put(b"%d" % k) for k in range(10)]
    disk.sweep_all()
    assert disk.policy.victims(5, lambda x: True) == first[:5]
    later = [disk.put(b"later %d" % k) for k in range(100)]  # rows grow by mremap
    # The new rows are referenced: passed over, round to the start.
    assert disk.policy.victims(10, lambda x: True) == [*first[5:], *first[:5]]
    assert disk.policy.victims(11, lambda x: True) == [*first[5:], *later[:6]]
    assert disk.policy.hand == 10 + 6
    # Recovery replaces the table (smaller now): a hand past its end starts over.
    for block in later:
        disk.drop(block)
    disk.cold = ColdIndex.from_columns(disk.cold.columns(), disk.cold.digests, seed=1)
    disk.cold.touch(disk.cold.find(NS, b"0"))
    assert disk.policy.victims(2, lambda x: True) == first[1:3]


def test_a_sweep_is_bounded_however_many_rows_refuse() -> None:
    disk = Disk(window=WINDOW)
    for k in range(3 * MAX_CHECKS):
        disk.put(k.to_bytes(4, "big"))
    asked: list[Hashable] = []

    def never(block: Hashable) -> bool:
        asked.append(block)
        return False

    assert disk.policy.victims(16, never) == []
    assert len(asked) == MAX_CHECKS
    # The next call goes on from the hand: the blocks asked about first are asked last.
    asked.clear()
    assert disk.policy.victims(16, never) == []
    assert asked[0] != (NS, (0).to_bytes(4, "big"))
    assert disk.policy.victims(1, lambda x: True) != []
    assert len(disk.policy) == 3 * MAX_CHECKS


def test_a_class_is_swept_by_its_own_hand_past_any_number_of_other_rows() -> None:
    """Segment 0 holds small slots, segment 1 large: rows of the small class in front of the
    hand are filtered out before any is asked about, the large rows' hand is its own, and
    sweeping one class leaves the other's reference bytes as they were."""
    cold = ColdIndex(seed=5, rows=16)
    policy = ClockPolicy(lambda: cold, window=4096, classes=lambda: np.array([8192, 16384]))
    seq = 0

    def put(key: bytes, segment: int, place: int) -> tuple[bytes, bytes]:
        nonlocal seq
        seq += 1
        cold.add(NS, RecordHeader(NS, key, 4096, 4096, 0, seq, 0), segment, place)
        return NS, key

    small = [put(b"s%d" % i, 0, i) for i in range(2 * MAX_CHECKS)]
    large = [put(b"l%d" % i, 1, i) for i in range(3)]
    asked: list[Hashable] = []

    def evictable(block: Hashable) -> bool:
        asked.append(block)
        return True

    assert policy.victims_in_class(2, 16384, evictable) == large[:2]
    assert asked == large[:2]  # not one small row asked about
    assert policy.class_hand(16384) == cold.find(*large[1]) + 1
    assert policy.hand == 0
    assert policy.class_hand(8192) == 0
    assert not len(cold.unreferenced(0, len(small)))  # the small rows keep their bytes
    cold.touch(cold.find(*large[2]))
    assert policy.victims_in_class(1, 16384, evictable) == [large[0]]  # l2 read: spared
    assert policy.victims_in_class(1, 8192, evictable) == [small[0]]
    assert policy.victims_in_class(1, 4096, evictable) == []  # no segment of that class


class ClockMachine(RuleBasedStateMachine):
    """Any mix of puts, reads, holds, bans and evictions: victims are stored keys' newest rows,
    evictable and not held. Then, from a sweep on: blocks read or written since go after every
    idle one while no hold or ban spares an idle one."""

    def __init__(self) -> None:
        super().__init__()
        self.disk = Disk()
        self.stored: set[tuple[bytes, bytes]] = set()
        self.held: set[tuple[bytes, bytes]] = set()
        #: Since the last full sweep (None: a hold or ban since then voids the comparison).
        self.recent: set[tuple[bytes, bytes]] | None = None

    @initialize(keys=st.lists(st.binary(min_size=1, max_size=3), min_size=1, max_size=20))
    def fill(self, keys: list[bytes]) -> None:
        for key in keys:
            self.put(key)

    @rule(key=st.binary(min_size=1, max_size=3))
    def put(self, key: bytes) -> None:
        block = self.disk.put(key)
        self.stored.add(block)
        self.held.discard(block)
        if self.recent is not None:
            self.recent.add(block)

    @precondition(lambda self: self.stored)
    @rule(data=st.data())
    def read(self, data: st.DataObject) -> None:
        block = data.draw(st.sampled_from(sorted(self.stored)))
        self.disk.policy.accessed(block, 0.0)
        if self.recent is not None:
            self.recent.add(block)

    @precondition(lambda self: self.stored)
    @rule(data=st.data(), release=st.booleans())
    def hold(self, data: st.DataObject, release: bool) -> None:
        block = data.draw(st.sampled_from(sorted(self.stored)))
        if release:
            self.disk.policy.release(block)
            self.held.discard(block)
        else:
            self.disk.policy.hold(block)
            self.held.add(block)
        self.recent = None

    @rule()
    def sweep(self) -> None:
        self.disk.sweep_all()
        self.recent = set()

    @rule(count=st.integers(1, 5), banned=st.sets(st.binary(min_size=1, max_size=3), max_size=4))
    def evict(self, count: int, banned: set[bytes]) -> None:
        out = {(NS, k) for k in banned} & self.stored
        chosen = self.disk.policy.victims(count, lambda b: b not in out)
        assert len(set(chosen)) == len(chosen) <= count
        for block in chosen:
            assert block in self.stored
            assert block not in out
            assert block not in self.held
        idle = self.stored - self.held - out - (self.recent or set())
        if self.recent is not None and chosen and idle - set(chosen):
            # An idle block is left: none read or written since the sweep went before it.
            assert not set(chosen) & self.recent
        if out or self.held:
            self.recent = None
        for block in chosen:
            self.disk.drop(block)
            self.stored.discard(block)

    @invariant()
    def counts_agree(self) -> None:
        assert len(self.disk.policy) == len(self.stored)


TestClockMachine = ClockMachine.TestCase
TestClockMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
