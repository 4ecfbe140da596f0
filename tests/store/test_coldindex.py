"""The cold index against a dict model: rows by place, keys by their newest row, rebuilt whole."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvtierd.store.coldindex import ColdIndex
from kvtierd.store.coldprobe import find_many
from kvtierd.store.freestack import FreeStack
from kvtierd.store.mapped import anonymous, resized
from kvtierd.store.records import RecordHeader

DIGESTS = [bytes([n]) * 16 for n in range(3)]
# Keys that differ only in trailing zero bytes or length must stay distinct.
KEYS = [b"a", b"a\0", b"a\0\0", b"b", b"\0", b"k" * 32, b"k" * 31 + b"\0", b"xy"]


def header(digest: bytes, key: bytes, seq: int, n: int) -> RecordHeader:
    return RecordHeader(digest, key, 4096 + n, 8192 + n, n * 7919, seq, n & 1)


def newest(rows: dict[int, tuple[RecordHeader, tuple[int, int]]]) -> dict[tuple[bytes, bytes], int]:
    """What :meth:`ColdIndex.from_columns` makes each key's row: highest seq, then lowest row."""
    best: dict[tuple[bytes, bytes], int] = {}
    for row in sorted(rows):
        h = rows[row][0]
        identity = (h.ns_digest, h.key)
        if identity not in best or h.seq > rows[best[identity]][0].seq:
            best[identity] = row
    return best


class ColdIndexMachine(RuleBasedStateMachine):
    """Inserts and removes against the model, with the buckets growing incrementally from the
    smallest table on, so the steps interleave with moves between two tables."""

    def __init__(self) -> None:
        super().__init__()
        self.index = ColdIndex(seed=7, rows=16, incremental_from=16)
        self.rows: dict[int, tuple[RecordHeader, tuple[int, int]]] = {}
        self.keys: dict[tuple[bytes, bytes], int] = {}
        self.n = 0

    @rule(
        ns=st.integers(0, len(DIGESTS) - 1),
        key=st.sampled_from(KEYS),
        seq=st.integers(0, 5),
        segment=st.integers(0, 3),
        index=st.integers(0, 40),
    )
    def add(self, ns: int, key: bytes, seq: int, segment: int, index: int) -> None:
        self.n += 1
        h = header(DIGESTS[ns], key, seq, self.n)
        place = (segment, index)
        if any(p == place for _, p in self.rows.values()):
            with pytest.raises(ValueError):
                self.index.add(DIGESTS[ns], h, segment, index)
            return
        row = self.index.add(DIGESTS[ns], h, segment, index)
        assert row not in self.rows
        self.rows[row] = (h, place)
        identity = (h.ns_digest, key)
        if identity not in self.keys or seq > self.rows[self.keys[identity]][0].seq:
            self.keys[identity] = row

    @precondition(lambda self: self.rows)
    @rule(data=st.data())
    def remove(self, data: st.DataObject) -> None:
        row = data.draw(st.sampled_from(sorted(self.rows)))
        h, _ = self.rows.pop(row)
        if self.keys.get((h.ns_digest, h.key)) == row:
            del self.keys[(h.ns_digest, h.key)]
        self.index.remove(row)
        with pytest.raises(ValueError):
            self.index.remove(row)

    @rule()
    def rebuild(self) -> None:
        """The whole index from its columns, as a snapshot reloads it: rows renumbered."""
        columns = self.index.columns()
        live = sorted(self.rows)
        self.index = ColdIndex.from_columns(columns, self.index.digests, seed=11)
        assert not self.index.moving
        self.rows = {new: self.rows[old] for new, old in enumerate(live)}
        self.keys = newest(self.rows)
        named = set(self.keys.values())
        assert set(self.index.shadowed().tolist()) == set(self.rows) - named

    @invariant()
    def agrees(self) -> None:
        assert len(self.index) == len(self.rows)
        assert self.index.keys == len(self.keys)
        assert sorted(self.index.rows().tolist()) == sorted(self.rows)
        for row, (h, place) in self.rows.items():
            assert self.index.record(row) == h
            assert self.index.place(row) == place
            fields = (h.ns_digest, h.key, h.raw_bytes, h.payload_checksum, h.seq, h.flags)
            assert self.index.ref_fields(row) == (*fields, *place)
            assert self.index.at(*place) == row
        asked = [*KEYS, b"", b"z" * 33]  # and two no key can be
        for digest in DIGESTS:
            for key in KEYS:
                assert self.index.find(digest, key) == self.keys.get((digest, key), -1)
            wanted = [self.keys.get((digest, key), -1) for key in asked]
            assert find_many(self.index, digest, asked).tolist() == wanted
        columns = self.index.columns()
        pieces = list(self.index.chunks(5))
        for name, column in columns.items():
            joined = np.concatenate([p[name] for p in pieces]) if pieces else column
            assert np.array_equal(joined, column)
        if self.rows:
            assert self.index.max_seq() == max(h.seq for h, _ in self.rows.values())


TestColdIndex = ColdIndexMachine.TestCase
TestColdIndex.settings = settings(max_examples=150, stateful_step_count=60, deadline=None)


def test_many_keys_grow_the_buckets_and_rows_and_stay_found() -> None:
    index = ColdIndex(rows=16)
    digest = DIGESTS[1]
    for i in range(5000):
        index.add(digest, header(digest, i.to_bytes(4, "big"), i, i), i // 100, i % 100)
    for i in range(0, 5000, 2):
        index.remove(index.find(digest, i.to_bytes(4, "big")))
    for i in range(5000):
        row = index.find(digest, i.to_bytes(4, "big"))
        assert (row >= 0) == bool(i % 2)
        if row >= 0:
            assert index.record(row).seq == i
            assert index.at(i // 100, i % 100) == row
    assert len(index) == index.keys == 2500


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(st.booleans(), st.integers(0, 199), st.integers(0, 3)),
        min_size=1,
        max_size=400,
    )
)
def test_growing_buckets_agree_with_a_dict_through_many_keys(
    steps: list[tuple[bool, int, int]],
) -> None:
    """More keys than the small key set above reaches: inserts of new and repeated keys and
    removes, several growths in flight among them, checked against a dict after every step."""
    index = ColdIndex(seed=9, rows=16, incremental_from=16)
    digest = DIGESTS[2]
    rows: dict[int, RecordHeader] = {}
    keys: dict[bytes, int] = {}
    for n, (insert, k, seq) in enumerate(steps):
        key = k.to_bytes(2, "big")
        if insert or key not in keys:
            h = header(digest, key, seq, n)
            row = index.add(digest, h, 0, n)
            rows[row] = h
            if key not in keys or seq > rows[keys[key]].seq:
                keys[key] = row
        else:
            row = keys.pop(key)
            del rows[row]
            index.remove(row)
            # The key's older records stay; the newest of them names it again only after a
            # rebuild, as in the daemon (it replaces or removes every older copy).
            for old in [r for r, h in rows.items() if h.key == key]:
                del rows[old]
                index.remove(old)
        assert len(index) == len(rows)
        assert index.keys == len(keys)
        for key, row in keys.items():
            assert index.find(digest, key) == row
        if index.moving:  # the probe of many keys looks in both tables
            every = [k.to_bytes(2, "big") for k in range(200)]
            assert find_many(index, digest, every).tolist() == [keys.get(k, -1) for k in every]
    every = [k.to_bytes(2, "big") for k in range(200)]
    for key in every:
        assert index.find(digest, key) == keys.get(key, -1)
    assert find_many(index, digest, every).tolist() == [keys.get(k, -1) for k in every]


def test_buckets_grow_a_bounded_number_of_buckets_per_insert() -> None:
    """A growth of a large table moves a few buckets per insert (counted, not timed) and
    ends before the next one would start: never all at once on one insert."""
    index = ColdIndex(seed=1, rows=16, incremental_from=1024)
    digest = DIGESTS[0]
    growths, largest = 0, 0
    for i in range(60_000):
        before = index.moving
        index.add(digest, header(digest, i.to_bytes(4, "big"), i, i), i // 1000, i % 1000)
        after = index.moving
        if after > before:  # a growth began: the last one had ended
            assert before == 0
            growths += 1
        else:
            largest = max(largest, before - after)
        if i % 3 == 0:  # tombstones too: every third key goes again
            index.remove(index.find(digest, (i // 2).to_bytes(4, "big")))
    assert growths >= 4
    assert 0 < largest <= 16
    for i in range(0, 60_000, 997):
        row = index.find(digest, i.to_bytes(4, "big"))
        assert row < 0 or index.record(row).seq == i


@settings(max_examples=50, deadline=None)
@given(
    st.lists(
        st.tuples(st.sampled_from(KEYS), st.integers(0, 3), st.integers(0, 1)),
        max_size=60,
    )
)
def test_from_columns_keeps_the_newest_of_each_key(listed: list[tuple[bytes, int, int]]) -> None:
    index = ColdIndex(seed=3)
    rows = {}
    for n, (key, seq, ns) in enumerate(listed):
        h = header(DIGESTS[ns], key, seq, n)
        rows[index.add(DIGESTS[ns], h, 0, n)] = (h, (0, n))
    rebuilt = ColdIndex.from_columns(index.columns(), index.digests, seed=5)
    keys = newest(rows)
    for (digest, key), row in keys.items():
        assert rebuilt.record(rebuilt.find(digest, key)) == rows[row][0]
    assert len(rebuilt.shadowed()) == len(rows) - len(keys)


def test_from_columns_refuses_a_place_listed_twice() -> None:
    index = ColdIndex()
    index.add(DIGESTS[0], header(DIGESTS[0], b"a", 1, 1), 0, 0)
    index.add(DIGESTS[0], header(DIGESTS[0], b"b", 1, 2), 0, 1)
    columns = index.columns()
    columns["index"][1] = 0
    with pytest.raises(ValueError, match="twice"):
        ColdIndex.from_columns(columns, index.digests)
    columns = index.columns()
    columns["klen"][0] = 33
    with pytest.raises(ValueError, match="key length"):
        ColdIndex.from_columns(columns, index.digests)


def test_free_stack_is_last_in_first_out_through_growing_and_shrinking() -> None:
    stack = FreeStack()
    model: list[int] = []
    for i in range(1000):
        stack.push(i * 3)
        model.append(i * 3)
    stack.extend(np.arange(5, dtype=np.uint64))
    model.extend(range(5))
    assert stack.values().tolist() == model
    while model:
        assert stack.pop() == model.pop()
    with pytest.raises(IndexError):
        stack.pop()
    assert len(stack) == 0


@pytest.mark.parametrize("held", [False, True])
def test_a_mapping_grows_and_shrinks_keeping_its_bytes(held: bool) -> None:
    """In place when no view is exported; copied, the held view untouched, when one is."""
    mapped = anonymous(3 * 4096)
    mapped[:6] = b"kvtier"
    mapped[-2:] = b"ok"
    view = memoryview(mapped) if held else None
    grown = resized(mapped, 40 * 4096)
    assert (grown is mapped) != held
    assert grown[:6] == b"kvtier"
    assert grown[3 * 4096 - 2 : 3 * 4096] == b"ok"
    assert grown[3 * 4096 :] == bytes(37 * 4096)
    if view is not None:
        assert view[:6] == b"kvtier"
        view.release()
    assert resized(grown, 5)[:] == b"kvtie"


def test_reference_bytes_are_set_on_add_and_touch_and_survive_the_rows_growing() -> None:
    index = ColdIndex(seed=3, rows=16)
    first = index.add(DIGESTS[0], header(DIGESTS[0], b"a", 1, 1), 0, 0)
    assert index.unreferenced(0, index.extent).tolist() == []  # an insert is an access
    index.clear_references(0, index.extent)
    assert index.unreferenced(0, index.extent).tolist() == [first]
    index.touch(first)
    for n in range(2, 200):  # past 16 rows: the columns grow by mremap
        index.add(DIGESTS[1], header(DIGESTS[1], n.to_bytes(2, "big"), 1, n), 1, n)
    assert index.extent == 199
    assert first not in index.unreferenced(0, index.extent).tolist()
    index.clear_references(0, 100)
    assert index.unreferenced(0, index.extent).tolist() == list(range(100))
    assert index.identity(first) == (DIGESTS[0], b"a")
    # A freed row is never a candidate; reused, it starts referenced again.
    index.remove(first)
    assert index.identity(first) is None
    assert first not in index.unreferenced(0, index.extent).tolist()
    again = index.add(DIGESTS[2], header(DIGESTS[2], b"b", 1, 300), 2, 0)
    assert again == first
    assert first not in index.unreferenced(0, index.extent).tolist()


def test_a_rebuilt_index_starts_with_every_reference_clear() -> None:
    index = ColdIndex(seed=3)
    for n in range(10):
        index.add(DIGESTS[0], header(DIGESTS[0], bytes([n + 1]), 1, n), 0, n)
    rebuilt = ColdIndex.from_columns(index.columns(), index.digests, seed=3)
    assert rebuilt.unreferenced(0, rebuilt.extent).tolist() == list(range(10))
