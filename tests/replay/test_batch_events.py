"""SLSAP's batch events (``inserted_many``, ``removed_many``) decide what the events one at a
time decide: two policies replay the Mooncake trace's first requests, one told block by block,
the other a batch at a time, and must agree on every victim, candidate and admission, and on
every byte of their state, after every request."""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import pytest

from kvtierd.policy import PROMOTION, AccessContext
from kvtierd.replay import TraceRequest
from kvtierd.slsap import SlsapConfig, SlsapPolicy

#: Small enough that ghosts are dropped and the model refitted many times within the slice.
CONFIG = SlsapConfig(min_ghosts=16, min_refit_events=64, ghost_ratio=2.0)
CAPACITY = 96


def _state(policy: SlsapPolicy) -> tuple[object, ...]:
    t = policy._table
    columns = (t.last, t.count, t.klass, t.resident, t.version, t.request, t.tracked)
    return (
        [column.tobytes() for column in columns],
        list(t.keys),
        dict(t._index),
        list(t._free),
        t.resident_count,
        policy._clock,
        policy._references,
        policy._insertions,
        policy._peak_resident,
        sorted(policy._unranked),
        sorted(policy._held),
        policy._model._reuses.tobytes(),
        policy._model._ends.tobytes(),
        policy._model._density.tobytes(),
    )


class Pair:
    """The same policy twice: ``one`` told event by event, ``batched`` in batches."""

    def __init__(self) -> None:
        self.one = SlsapPolicy(CONFIG)
        self.batched = SlsapPolicy(CONFIG)
        self.cached: set[Hashable] = set()

    def both(self, name: str, *args: object) -> object:
        a = getattr(self.one, name)(*args)
        b = getattr(self.batched, name)(*args)
        assert a == b, name
        return a

    def insert(self, blocks: Sequence[Hashable], contexts: Sequence[AccessContext | None]) -> None:
        for block, context in zip(blocks, contexts, strict=True):
            self.one.inserted(block, 0.0, context)
        self.batched.inserted_many(blocks, contexts)
        self.cached.update(blocks)

    def evict(self, count: int, keep: set[Hashable]) -> None:
        victims = self.both("victims", count, lambda b: b not in keep)
        assert isinstance(victims, list)
        for victim in victims:
            self.one.removed(victim)
        self.batched.removed_many(victims)
        self.cached.difference_update(victims)

    def check(self) -> None:
        assert _state(self.one) == _state(self.batched)


def _serve(pair: Pair, index: int, request: TraceRequest) -> None:
    blocks = list(request.hash_ids)
    if index % 11 == 0:  # a READ no LOOKUP named: its blocks are references (one by one)
        observed = -1
    else:
        observed = index
        pair.both("observe_request", blocks, 0.0, index)
    for position, block in enumerate(blocks):
        if block in pair.cached:
            pair.both("accessed", block, 0.0, AccessContext(observed, position=position))
    missing = [b for b in dict.fromkeys(blocks) if b not in pair.cached]
    if index % 13 == 0 and missing:  # a block named twice in one batch
        missing.append(missing[0])
    keep = set(blocks)
    room = CAPACITY - len(pair.cached)
    if len(set(missing)) > room:
        pair.evict(len(set(missing)) - room, keep)
    admitted = missing[: max(CAPACITY - len(pair.cached), 0)]
    if index % 3 == 0 and admitted:
        pair.both("admit", admitted[-1], 0.0, AccessContext(observed, position=0))
    contexts = [
        None if observed < 0 else AccessContext(observed, position=p) for p in range(len(admitted))
    ]
    pair.insert(admitted, contexts)
    if index % 5 == 0:  # background promotions of the densest ghosts
        pair.evict(4, keep)
        candidates = pair.both("promotion_candidates", 4)
        assert isinstance(candidates, list)
        pair.insert(candidates, [PROMOTION] * len(candidates))
    if index % 7 == 0 and pair.cached:  # a dirty block held, released a few requests later
        pair.both("hold", min(pair.cached, key=repr))
    if index % 7 == 3 and pair.cached:
        pair.both("release", min(pair.cached, key=repr))
    pair.check()


def test_batches_decide_what_single_events_decide(trace_slice: list[TraceRequest]) -> None:
    pair = Pair()
    for index, request in enumerate(trace_slice):
        _serve(pair, index, request)
    assert pair.one._model.refits > 3  # maintenance ran within the replay
    assert pair.one._table.ghost_count > 0
    assert pair.both("victims", 8, lambda b: True)


def test_a_batch_that_references_goes_block_by_block() -> None:
    """Blocks no request named (context None) are references: the clock moves per block."""
    pair = Pair()
    pair.insert(["a", "b", "c"], [None, None, None])
    pair.check()
    assert pair.batched._clock == 3
    pair.insert(["b", "d"], [AccessContext(-1), None])
    pair.check()


def test_removed_many_ignores_untracked_ghosts_and_repeats() -> None:
    pair = Pair()
    pair.insert(["a", "b", "c"], [None, None, None])
    for block in ["a", "zz", "a", "b"]:
        pair.one.removed(block)
    pair.batched.removed_many(["a", "zz", "a", "b"])
    pair.check()
    assert pair.batched._table.resident_count == 1


def test_inserted_many_wants_a_context_per_block() -> None:
    with pytest.raises(ValueError):
        SlsapPolicy().inserted_many(["a", "b"], [None])
