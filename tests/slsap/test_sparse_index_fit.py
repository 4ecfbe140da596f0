"""Clusters made off the index's back (``fit_later``): the same clusters as a fit in place, the
blocks indexed or removed meanwhile taken into account, and a fit overtaken by a compaction
dropped."""

from __future__ import annotations

import numpy as np
import pytest

from kvtierd.slsap.sparse import SparseConfig, SparseIndex
from kvtierd.slsap.sparse.ivf import FitStopped

DIM = 8
CONFIG = SparseConfig(
    layers=(0, 1),
    q_heads=2,
    kv_heads=1,
    head_dim=DIM,
    pool_factor=2.0,
    candidate_factor=1.0,
    pool_min_blocks=32,  # the clusters serve from 33 blocks up
)


def _boxes(rng: np.random.Generator, n: int) -> np.ndarray:
    centre = rng.normal(0, 1, (n, 2, 1, 1, DIM)).astype(np.float32)
    low, high = centre - 0.2, centre + 0.2
    return np.concatenate([low, high, centre], axis=3)  # [n, layers, kv_heads, 3, DIM]


def _queries(rng: np.random.Generator) -> np.ndarray:
    return rng.normal(0, 1, (2, 2, DIM)).astype(np.float32)


def _filled(n: int, *, fit: bool) -> SparseIndex:
    index = SparseIndex(CONFIG)
    rng = np.random.default_rng(7)
    index.insert_many(np.arange(n), np.arange(n), _boxes(rng, n), fit=fit)
    return index


def test_a_fit_made_aside_selects_as_a_fit_in_place_does() -> None:
    now = _filled(200, fit=True)
    later = _filled(200, fit=False)
    assert later.fit_due()
    assert not now.fit_due()
    later.fit_later()(lambda: False)()  # the work, then its installation
    assert not later.fit_due()
    rng = np.random.default_rng(1)
    for _ in range(5):
        q = _queries(rng)
        assert np.array_equal(now.select(q, 6).block_ids, later.select(q, 6).block_ids)


def test_blocks_indexed_and_removed_while_it_is_made_are_taken_into_account() -> None:
    index = _filled(200, fit=False)
    work = index.fit_later()
    rng = np.random.default_rng(3)
    index.insert_many(np.arange(200, 240), np.arange(200, 240), _boxes(rng, 40), fit=False)
    index.remove(5)
    install = work(lambda: False)
    install()
    assert not index.fit_due()
    chosen: set[int] = set()
    for _ in range(40):
        selection = index.select(_queries(rng), 12)
        chosen |= set(selection.block_ids[selection.block_ids >= 0].tolist())
    assert 5 not in chosen  # removed while the clusters were made
    assert chosen & set(range(200, 240))  # indexed meanwhile: the clusters pool them too


def test_a_fit_overtaken_by_a_compaction_is_dropped() -> None:
    index = _filled(200, fit=False)
    work = index.fit_later()
    for block in range(150):  # enough removals to compact the slots (and refit in place)
        index.remove(block)
    install = work(lambda: False)
    install()  # described slots that moved: installed, it would pool removed blocks' slots
    assert len(index) == 50
    rng = np.random.default_rng(4)
    for _ in range(40):
        selection = index.select(_queries(rng), 8)
        assert set(selection.block_ids[selection.block_ids >= 0].tolist()) <= set(range(150, 200))


def test_a_fit_told_to_stop_stops_and_leaves_the_index_as_it_was() -> None:
    index = _filled(200, fit=False)
    work = index.fit_later()
    with pytest.raises(FitStopped):
        work(lambda: True)
    assert index.fit_due()
    index.select(_queries(np.random.default_rng(5)), 6)  # still scores every block
