"""The compact key order against a sorted-list model: adds, removes and pages interleaved, with
sweeps at small bounds, keys with zero bytes and keys that are prefixes of others."""

from __future__ import annotations

import struct

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvtierd.keys import MAX_KEY_BYTES
from kvtierd.store.index import Block, BlockIndex
from kvtierd.store.keyorder import KeyOrder, decode, encode
from kvtierd.store.namespaces import Namespace, NamespaceSpec
from kvtierd.store.tier import BlockRef

# A small alphabet, so keys collide, share prefixes and end in zero bytes; and the longest keys.
KEYS = st.one_of(
    st.lists(st.sampled_from([b"\0", b"\1", b"a", b"\xff"]), min_size=1, max_size=4).map(b"".join),
    st.sampled_from([b"k" * 32, b"k" * 31 + b"\0", b"\xff" * 32, b"\0" * 32]),
)
_WORDS = struct.Struct(f"<{MAX_KEY_BYTES // 8}Q")


def columns(keys: list[bytes]) -> tuple[np.ndarray, np.ndarray]:
    """``keys`` as the cold index holds them: four little-endian words and a length."""
    words = np.array([_WORDS.unpack(k.ljust(MAX_KEY_BYTES, b"\0")) for k in keys], np.uint64)
    return words.reshape(len(keys), MAX_KEY_BYTES // 8), np.array([len(k) for k in keys], np.uint8)


@given(st.lists(KEYS, max_size=40))
def test_codes_sort_as_the_keys_do(keys: list[bytes]) -> None:
    assert sorted(keys, key=encode) == sorted(keys)
    assert [decode(encode(k)) for k in keys] == keys
    as_numpy = np.sort(np.array([encode(k) for k in keys], f"S{MAX_KEY_BYTES + 1}"))
    assert [decode(c) for c in as_numpy.tolist()] == sorted(keys)


@pytest.mark.parametrize("key", [b"", b"x" * 33])
def test_a_key_of_impossible_length_is_refused(key: bytes) -> None:
    with pytest.raises(ValueError):
        encode(key)


class KeyOrderMachine(RuleBasedStateMachine):
    """Every operation against a sorted model, the chunks and sweep bound drawn small so that
    sweeps start, run across many chunks, cut ranges short and interleave with everything."""

    @initialize(
        keys=st.lists(KEYS, max_size=30),
        chunk=st.integers(1, 6),
        merge_at=st.integers(1, 8),
        step=st.integers(1, 6),
        from_columns=st.booleans(),
    )
    def start(
        self, keys: list[bytes], chunk: int, merge_at: int, step: int, from_columns: bool
    ) -> None:
        if from_columns:
            words, klen = columns(keys)
            self.order = KeyOrder.from_columns(
                words, klen, chunk=chunk, merge_at=merge_at, step=step
            )
        else:
            self.order = KeyOrder.of(keys, chunk=chunk, merge_at=merge_at, step=step)
        self.model = set(keys)
        #: A pager under way: its cursor, the keys listed, those stored throughout, and those
        #: stored at some time since its first page.
        self.pager: tuple[bytes, list[bytes], set[bytes], set[bytes]] | None = None

    @rule(key=KEYS)
    def add(self, key: bytes) -> None:
        if key not in self.model:
            self.order.add(key)
            self.model.add(key)
            self._changed(key)

    @rule(data=st.data())
    @precondition(lambda self: self.model)
    def remove(self, data: st.DataObject) -> None:
        key = data.draw(st.sampled_from(sorted(self.model)))
        self.order.remove(key)
        self.model.discard(key)
        self._changed(key)

    @rule(
        after=st.one_of(st.just(b""), KEYS, st.binary(min_size=33, max_size=34)),
        limit=st.integers(0, 6),
    )
    def page(self, after: bytes, limit: int) -> None:
        later = sorted(k for k in self.model if k > after)
        assert self.order.page(after, limit) == (later[:limit], len(later) > limit)

    @rule(key=KEYS)
    def contains(self, key: bytes) -> None:
        assert (key in self.order) == (key in self.model)

    @rule(limit=st.integers(1, 4))
    def pager_step(self, limit: int) -> None:
        """A pager over the changes: a page from its cursor, or a new pager at the end."""
        if self.pager is None:
            self.pager = (b"", [], set(self.model), set(self.model))
        after, listed, throughout, ever = self.pager
        keys, more = self.order.page(after, limit)
        listed += keys
        if more:
            self.pager = (keys[-1], listed, throughout, ever)
            return
        assert listed == sorted(set(listed)), "listed twice or out of order"
        assert throughout <= set(listed), "a key stored throughout was not listed"
        assert set(listed) <= ever, "listed a key never stored"
        self.pager = None

    def _changed(self, key: bytes) -> None:
        if self.pager is not None:
            self.pager[2].discard(key)
            self.pager[3].add(key)

    @invariant()
    def agrees(self) -> None:
        if not hasattr(self, "order"):
            return
        assert len(self.order) == len(self.model)
        assert self.order.page(b"", 1000) == (sorted(self.model), False)
        chunks, bounds = self.order._chunks, self.order._bounds
        assert bounds[0] == b""
        assert len(bounds) == len(chunks)
        assert len(chunks) == 1 or all(len(c) for c in chunks)
        for i, chunk in enumerate(chunks):
            codes = chunk.tolist()
            assert codes == sorted(set(codes))
            assert not codes or bounds[i] <= codes[0]
            assert not codes or i + 1 == len(chunks) or codes[-1] < bounds[i + 1]


TestKeyOrder = KeyOrderMachine.TestCase
TestKeyOrder.settings = settings(max_examples=200, stateful_step_count=80, deadline=None)


def test_a_sweep_moves_the_overlay_into_chunks_a_step_at_a_time() -> None:
    order = KeyOrder.of([bytes([n]) for n in range(1, 200, 2)], chunk=8, merge_at=16, step=4)
    for n in range(0, 200, 2):
        order.add(bytes([n]) if n else b"\0\0")
    assert order.overlay < 16 + len(order._chunks)  # the sweep kept up: each add a step
    while order.sweeping:
        order.add(b"\xff" + bytes([order.overlay]))
    assert all(len(chunk) <= 8 for chunk in order._chunks)
    keys, more = order.page(b"", 1000)
    assert keys == sorted(keys)
    assert (more, len(keys)) == (False, len(order))


def test_from_columns_refuses_what_no_key_is() -> None:
    words, klen = columns([b"ab", b"c"])
    with pytest.raises(ValueError, match="past its length"):
        KeyOrder.from_columns(words, np.array([1, 1], np.uint8))
    with pytest.raises(ValueError, match="outside"):
        KeyOrder.from_columns(words, np.array([0, 1], np.uint8))
    with pytest.raises(ValueError, match="shapes"):
        KeyOrder.from_columns(words, klen[:1])


def test_from_columns_holds_a_repeated_key_once() -> None:
    order = KeyOrder.from_columns(*columns([b"b", b"a\0", b"a", b"b", b"a\0"]), chunk=2)
    assert order.page(b"", 10) == ([b"a", b"a\0", b"b"], False)
    assert len(order) == 3


def _namespace(n: int) -> Namespace:
    spec = NamespaceSpec(f"ns{n}", "tenant", 4096, None, 0, 1)
    return Namespace(n, spec, bytes([n]) * 16, bytes([n]) * 16, b"")


def _block(ns: Namespace, key: bytes) -> Block:
    return Block(ns, BlockRef(ns.digest, key, 4096, 0, 1))


def test_the_index_pages_each_namespace_apart() -> None:
    index = BlockIndex()
    one, two = _namespace(1), _namespace(2)
    blocks = {key: _block(one, key) for key in [b"b", b"a\0", b"a", b"c"]}
    for block in blocks.values():
        index.add(block)
    index.add(_block(two, b"a\0\0"))
    index.remove(blocks[b"b"])
    found, more = index.page(one, b"a", 2)
    assert (found, more) == ([blocks[b"a\0"], blocks[b"c"]], False)
    assert [b.key for b in index.page(two, b"", 5)[0]] == [b"a\0\0"]
    index.remove(blocks[b"a"])
    index.remove(blocks[b"a\0"])
    index.remove(blocks[b"c"])
    assert index.page(one, b"", 5) == ([], False)
    assert one.digest not in index._sorted  # an emptied namespace's order goes


def test_the_index_adopts_keys_in_bulk_once_each() -> None:
    index, ns = BlockIndex(), _namespace(1)
    index.adopt_keys(ns, *columns([b"d", b"b", b"\0"]))
    assert index._sorted[ns.digest].page(b"", 9) == ([b"\0", b"b", b"d"], False)
    index.adopt_keys(ns, *columns([b"b", b"a"]))  # again: a key already listed stays once
    assert index._sorted[ns.digest].page(b"", 9) == ([b"\0", b"a", b"b", b"d"], False)


def test_a_page_reads_past_keys_forgotten_in_a_layer_above() -> None:
    """Keys of the frozen overlay forgotten in the top one: the page reads on beyond them."""
    keys = [bytes([n]) for n in range(1, 21)]
    order = KeyOrder(chunk=100, merge_at=20, step=1)
    for key in keys:
        order.add(key)  # the 20th freezes the overlay; each step folds one key in
    for key in keys[4:7]:
        order.remove(key)
    assert order.sweeping
    assert order.page(keys[3], 2) == ([keys[7], keys[8]], True)
    assert order.page(b"", 5) == ([*keys[:4], keys[7]], True)


def test_many_sweeps_over_many_chunks_keep_every_key() -> None:
    """Thousands of keys, random changes through several sweeps (each step bounded), pages
    checked on the way."""
    rng = np.random.default_rng(7)
    pool = sorted({rng.bytes(int(rng.integers(1, 5))) for _ in range(6000)})
    stored = set(pool[::2])
    order = KeyOrder.of(sorted(stored), chunk=200, merge_at=300, step=40)
    sweeps = 0
    for i in range(6000):
        key = pool[int(rng.integers(len(pool)))]
        was = order.sweeping
        folded = order._frozen_at if was else (0, 0)
        if key in stored:
            order.remove(key)
            stored.discard(key)
        else:
            order.add(key)
            stored.add(key)
        sweeps += was and not order.sweeping
        if order.sweeping:  # one step folded at most ``step`` codes of each kind
            assert all(0 <= b - a <= 40 for a, b in zip(folded, order._frozen_at, strict=True))
        if i % 500 == 0:
            after = pool[int(rng.integers(len(pool)))]
            later = sorted(k for k in stored if k > after)
            assert order.page(after, 100) == (later[:100], len(later) > 100)
    assert sweeps >= 5
    assert order.page(b"", 10000) == (sorted(stored), False)
    assert len(order) == len(stored)
