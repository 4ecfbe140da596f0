"""Stateful property test: the index agrees with a plain dict under inserts and removals."""

from __future__ import annotations

import numpy as np
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvtierd.errors import BlockNotFoundError
from kvtierd.slsap.sparse import SparseConfig, SparseIndex

DIM = 8
CONFIG = SparseConfig(
    layers=(0,),
    q_heads=2,
    kv_heads=1,
    head_dim=DIM,
    recent_blocks=2,
    pool_factor=4.0,
    candidate_factor=2.0,
    pool_min_blocks=16,  # the clusters serve from 17 blocks up
)


class IndexModel(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.index = SparseIndex(CONFIG)
        self.model: dict[int, int] = {}  # block id -> position
        self.next_pos = 0
        self.rng = np.random.default_rng(0)

    @rule(count=st.integers(1, 40), gap=st.integers(0, 3))
    def insert(self, count: int, gap: int) -> None:
        self.next_pos += gap
        ids = np.arange(count) + 1000 + self.next_pos
        pos = np.arange(count) + self.next_pos
        centre = self.rng.standard_normal((count, 1, 1, DIM)).astype(np.float32)
        half = np.abs(self.rng.standard_normal((count, 1, 1, DIM))).astype(np.float32)
        boxes = np.stack([centre - half, centre + half, centre], axis=3)
        self.index.insert_many(ids, pos, boxes)
        self.model.update(zip(ids.tolist(), pos.tolist(), strict=True))
        self.next_pos += count

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def remove(self, data: st.DataObject) -> None:
        block = data.draw(st.sampled_from(sorted(self.model)))
        self.index.remove(block)
        del self.model[block]

    @rule(block=st.integers(0, 999))
    def remove_unknown(self, block: int) -> None:
        try:
            self.index.remove(block)
        except BlockNotFoundError:
            return
        raise AssertionError("removing an unknown block must raise")

    @invariant()
    def same_blocks(self) -> None:
        assert len(self.index) == len(self.model)
        q = self.rng.standard_normal((1, 2, DIM)).astype(np.float32)
        everything = self.index.select(q, max(1, len(self.model)), exhaustive=True).block_ids[0]
        assert sorted(everything[everything >= 0].tolist()) == sorted(self.model)
        some = self.index.select(q, 5).block_ids[0]
        some = some[some >= 0]
        assert set(some.tolist()) <= set(self.model)
        assert len(some) == min(5, len(self.model)) == len(set(some.tolist()))

    @invariant()
    def forced_are_sink_and_recent(self) -> None:
        by_pos = {p: b for b, p in self.model.items()}
        expect = [by_pos[0]] if 0 in by_pos else []
        if by_pos:
            newest = max(by_pos)
            expect += [by_pos[p] for p in (newest, newest - 1) if p in by_pos and p != 0]
        assert self.index.forced().tolist() == expect


IndexModel.TestCase.settings = settings(max_examples=40, stateful_step_count=25, deadline=None)
TestIndexModel = IndexModel.TestCase
