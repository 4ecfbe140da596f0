"""A sparse namespace's summaries follow their blocks: a block promoted into DRAM without one
gets it again, so does one in DRAM whose summary the bound let go, and one a FORGET drops while
it is being summarised gets none (no summary may outlive its block). In-process, on a real data
file."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import anyio
import anyio.lowlevel
import numpy as np
import pytest

from kvtierd.config import load_config
from kvtierd.protocol.messages import Layout
from kvtierd.store.index import Owner
from kvtierd.store.lifecycle import open_store
from kvtierd.store.namespaces import Namespace, NamespaceSpec
from kvtierd.store.records import checksum
from kvtierd.store.store import BlockStore
from tests.store.test_store_pressure import ROOT, key_of

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(120)]

LAYOUT = Layout("toy", 4, 2, 8, "float32", 4)
BLOCK = 2 * 4 * 2 * 8 * 4 * 4


@contextlib.asynccontextmanager
async def sparse_store(directory: Path) -> AsyncIterator[tuple[BlockStore, Namespace]]:
    config = load_config(
        None,
        {
            "daemon": {"data_dir": str(directory)},
            "dram": {"size": "16M", "mlock": "never", "hugepages": "never"},
            "nvme": {"size": "64M", "segment_bytes": "4M"},
        },
    )
    async with open_store(config) as store:
        spec = NamespaceSpec("s", "default", BLOCK, LAYOUT, 0, 1, sparse=True)
        ns, _ = store.registry.open(spec, ROOT)
        yield store, ns


def content(key: bytes, nbytes: int) -> bytes:
    """Float32 keys and values, as a model's blocks hold (random bytes would hold NaNs)."""
    rng = np.random.default_rng(int.from_bytes(key[:8], "little"))
    return rng.normal(0, 1, nbytes // 4).astype(np.float32).tobytes()


async def _commit(store: BlockStore, ns: Namespace, keys: list[bytes]) -> None:
    owner = Owner("w")
    write = await store.alloc(owner, ns, keys)
    for key, slot in zip(keys, write.slots, strict=True):
        assert slot is not None
        store.arena.view[slot.offset : slot.offset + BLOCK] = content(key, BLOCK)
    await store.commit(owner, write.id, [checksum(content(k, BLOCK)) for k in keys], False)


async def test_a_block_promoted_without_a_summary_gets_it_again(tmp_path: Path) -> None:
    async with sparse_store(tmp_path) as (store, ns):
        keys = [key_of(i) for i in range(4)]
        await _commit(store, ns, keys)
        await store.fsync()
        await store.evict_dram(ns)
        sparse = store.residency.sparse
        for key in keys:  # as after a restart: the blocks are on disk, no summary in memory
            block = store.index.get(ns, key)
            assert block is not None
            sparse.forget(block)
        assert sparse.summaries == 0
        for key in keys:
            block = store.index.get(ns, key)
            assert block is not None
            await store.residency.promotions.make_resident(block)
        assert sparse.summaries == len(keys)
        assert all(sparse.summarised((ns.digest, key)) for key in keys)


async def test_a_block_forgotten_while_it_is_summarised_gets_no_summary(tmp_path: Path) -> None:
    async with sparse_store(tmp_path) as (store, ns):
        key = key_of(7)
        await _commit(store, ns, [key])
        block = store.index.get(ns, key)
        assert block is not None
        sparse = store.residency.sparse
        sparse.forget(block)
        block.pins += 1  # as the promotion that summarises it holds it
        async with anyio.create_task_group() as tg:
            tg.start_soon(store.residency.summarise_missing, [block])
            await anyio.lowlevel.checkpoint()  # it is in its worker thread now
            store.index.remove(block)  # what FORGET does first
        store.residency.unpin(block)
        assert block.forgotten
        assert not sparse.summarised(block.id)
        assert sparse.summaries == 0


async def test_a_resident_block_whose_summary_went_gets_it_again(tmp_path: Path) -> None:
    """Promotion summarises what it loads but skips resident blocks: a HINT naming a resident
    block without a summary (the summaries' bound dropped it) has it summarised in the
    background, one job at a time, its pins given back once it is done."""
    async with sparse_store(tmp_path) as (store, ns):
        keys = [key_of(i) for i in range(4)]
        await _commit(store, ns, keys)
        await store.fsync()  # no write-back holds them meanwhile
        sparse = store.residency.sparse
        blocks = [store.index.get(ns, key) for key in keys]
        pins = [b.pins for b in blocks if b is not None]
        for block in blocks[:3]:
            assert block is not None
            assert block.dram is not None
            sparse.forget(block)
        assert store.summarise_resident(ns, [*keys, key_of(99)])  # an unknown key is skipped
        assert not store.summarise_resident(ns, keys)  # one job at a time
        with anyio.fail_after(30):
            # a background job: no event to wait on
            while not all(sparse.summarised((ns.digest, key)) for key in keys):  # noqa: ASYNC110
                await anyio.sleep(0.01)
            while [b.pins for b in blocks if b is not None] != pins:  # noqa: ASYNC110
                await anyio.sleep(0.01)  # its pins go with it
        assert sparse.summaries == len(keys)
        assert not store.summarise_resident(ns, keys)  # nothing left to summarise


async def test_a_hint_asks_for_no_more_summaries_than_half_the_bound_holds(
    tmp_path: Path,
) -> None:
    """A batch larger than the summaries' bound would push its own first summaries out before
    any session indexed them: a HINT names at most half the bound's worth of unsummarised
    blocks."""
    async with sparse_store(tmp_path) as (store, ns):
        keys = [key_of(i) for i in range(8)]
        await _commit(store, ns, keys)
        sparse = store.residency.sparse
        for key in keys:
            block = store.index.get(ns, key)
            assert block is not None
            sparse.forget(block)
        one = 4 * 2 * 3 * 8 * 2  # layers, KV heads, min/max/mean, head_dim, float16
        queries = np.ones((2, 2, 8), np.float32)
        for bound, asked in ((3 * one, 1), (6 * one, 3), (1 << 20, 8)):
            sparse.max_summary_bytes = bound
            selection = await sparse.select(ns, b"s", keys, queries, [2, 3], 2)
            assert len(selection.unsummarised) == asked


async def test_an_index_that_outgrows_its_clusters_is_clustered_in_the_background(
    tmp_path: Path,
) -> None:
    """A HINT that indexes thousands of blocks answers by scoring every one of them and leaves
    their k-means clustering to a job the store owns; later HINTs use the clusters."""
    async with sparse_store(tmp_path) as (store, ns):
        keys = [key_of(i) for i in range(1100)]  # past pool_min_blocks (1024)
        for first in range(0, len(keys), 275):
            await _commit(store, ns, keys[first : first + 275])
        sparse = store.residency.sparse
        queries = np.ones((2, 2, 8), np.float32)
        first = await sparse.select(ns, b"s", keys, queries, [2, 3], 4)
        entry = sparse._sessions[(ns.id, b"s")]
        assert entry.fitting is entry.index  # the HINT did not wait for it
        assert sparse.fits == 1
        with anyio.fail_after(60):
            while entry.fitting is not None:  # noqa: ASYNC110 - a background job, no event
                await anyio.sleep(0.01)
        assert not entry.index.fit_due()
        assert sparse.fits == 0
        again = await sparse.select(ns, b"s", keys, queries, [2, 3], 4)
        assert (first.selected >= 0).all()
        assert (again.selected >= 0).all()
        assert entry.fitting is None  # nothing more to cluster


async def test_a_closing_store_cancels_its_background_fits(tmp_path: Path) -> None:
    """A fit keeps nothing worth waiting for: the store's close cancels it instead of
    waiting seconds for k-means, and starts no other."""
    async with sparse_store(tmp_path) as (store, ns):
        keys = [key_of(i) for i in range(1100)]
        for first in range(0, len(keys), 275):
            await _commit(store, ns, keys[first : first + 275])
        sparse = store.residency.sparse
        await sparse.select(ns, b"s", keys, np.ones((2, 2, 8), np.float32), [2, 3], 4)
        assert sparse.fits == 1
        sparse.cancel_fits()  # before the job's first turn: it must not run at all
        with anyio.fail_after(30):
            while sparse.fits:  # noqa: ASYNC110 - a background job, no event
                await anyio.sleep(0.01)
        entry = sparse._sessions[(ns.id, b"s")]
        assert entry.fitting is None
        assert entry.index.fit_due()  # cancelled: never installed
        await sparse.select(ns, b"t", keys, np.ones((2, 2, 8), np.float32), [2, 3], 4)
        assert sparse.fits == 0  # closing: no new fit
