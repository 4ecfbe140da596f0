"""The client library against a real daemon: put, lookup, get, read_into, forget, fsync."""

from __future__ import annotations

import numpy as np
import pytest

from kvtierd.client import (
    BlockNotFoundError,
    InvalidRequestError,
    NotSupportedError,
    chain_keys,
    connect,
    connect_async,
)
from tests.support.daemon import DaemonProcess

BLOCK = 64 << 10


def _blocks(n: int, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, BLOCK, dtype=np.uint8) for _ in range(n)]


def test_put_then_get_returns_the_same_bytes(daemon: DaemonProcess) -> None:
    with connect(daemon.socket) as client:
        ns = client.namespace("t", block_bytes=BLOCK)
        keys = chain_keys(range(16 * 20), 16, ns.key_salt)
        blocks = _blocks(20)
        assert ns.put(keys, blocks) == 20
        assert ns.lookup(keys) == 20
        with ns.get(keys) as views:
            assert all(bytes(v) == b.tobytes() for v, b in zip(views, blocks, strict=True))


def test_lookup_counts_only_the_leading_present_keys(daemon: DaemonProcess) -> None:
    with connect(daemon.socket) as client:
        ns = client.namespace("t", block_bytes=BLOCK)
        keys = chain_keys(range(16 * 10), 16, ns.key_salt)
        ns.put(keys[:4], _blocks(4))
        ns.put(keys[6:], _blocks(4, seed=1))
        assert ns.lookup(keys) == 4


def test_missing_block_raises_block_not_found(daemon: DaemonProcess) -> None:
    with connect(daemon.socket) as client:
        ns = client.namespace("t", block_bytes=BLOCK)
        with pytest.raises(BlockNotFoundError), ns.get([b"k" * 16]):
            pass
        assert client.stats()["leases"] == 0


def test_wrong_block_size_is_refused_and_nothing_is_stored(daemon: DaemonProcess) -> None:
    with connect(daemon.socket) as client:
        ns = client.namespace("t", block_bytes=BLOCK)
        with pytest.raises(InvalidRequestError):
            ns.put([b"k" * 16], [b"short"])
        assert ns.lookup([b"k" * 16]) == 0


def test_forget_removes_from_every_tier(daemon: DaemonProcess) -> None:
    with connect(daemon.socket) as client:
        ns = client.namespace("t", block_bytes=BLOCK)
        keys = chain_keys(range(16 * 3), 16, ns.key_salt)
        ns.put(keys, _blocks(3))
        client.fsync()
        assert ns.forget(keys[1:]) == 2
        assert ns.lookup(keys) == 1


def test_blocks_survive_a_restart_after_fsync(tmp_path) -> None:  # type: ignore[no-untyped-def]
    blocks = _blocks(8)
    with DaemonProcess(tmp_path) as d, connect(d.socket) as client:
        ns = client.namespace("t", block_bytes=BLOCK)
        keys = chain_keys(range(16 * 8), 16, ns.key_salt)
        ns.put(keys, blocks)
        client.fsync()
    with DaemonProcess(tmp_path) as d, connect(d.socket) as client:
        ns = client.namespace("t", block_bytes=BLOCK)
        out = [np.empty(BLOCK, np.uint8) for _ in range(8)]
        assert ns.lookup(keys) == 8
        ns.read_into(keys, out)
        assert all((o == b).all() for o, b in zip(out, blocks, strict=True))


@pytest.mark.anyio
async def test_async_client_pipelines_concurrent_requests(daemon: DaemonProcess) -> None:
    import anyio

    async with connect_async(daemon.socket) as client:
        ns = await client.namespace("t", block_bytes=BLOCK)
        keys = chain_keys(range(16 * 16), 16, ns.key_salt)
        await ns.put(keys, _blocks(16))
        results: list[int] = []

        async def one(n: int) -> None:
            results.append(await ns.lookup(keys[:n]))

        async with anyio.create_task_group() as tg:
            for n in range(1, 17):
                tg.start_soon(one, n)
        assert sorted(results) == list(range(1, 17))
        with pytest.raises(BlockNotFoundError):
            async with ns.get([b"z" * 16]):
                pass


def test_namespace_can_be_reopened_from_its_listing_without_creating(
    daemon: DaemonProcess,
) -> None:
    layout = {
        "model_id": "m",
        "layers": 2,
        "kv_heads": 1,
        "head_dim": 64,
        "dtype": "float16",
        "block_tokens": 128,
    }
    with connect(daemon.socket) as client:
        ns = client.namespace("t", block_bytes=BLOCK, layout=layout)
        listed = client.namespaces()[0]
        again = client.namespace(
            "t", block_bytes=listed["block_bytes"], layout=listed["layout"], create=False
        )
        assert again.handle.ns == ns.handle.ns
        with pytest.raises(BlockNotFoundError, match="does not exist"):
            client.namespace("typo", block_bytes=BLOCK, create=False)
        assert len(client.namespaces()) == 1


def test_lookup_tiers_names_where_each_hit_is(daemon: DaemonProcess) -> None:
    with connect(daemon.socket) as client:
        ns = client.namespace("t", block_bytes=BLOCK)
        keys = chain_keys(range(16 * 4), 16, ns.key_salt)
        ns.put(keys[:3], _blocks(3))
        assert ns.lookup_tiers(keys) == ["dram"] * 3
        client.fsync()
        client.evict()
        assert ns.lookup_tiers(keys, promote=False) == ["nvme"] * 3
        assert ns.lookup(keys, promote=False) == 3


def test_lookup_each_answers_every_key_in_one_request(daemon: DaemonProcess) -> None:
    """LOOKUP with ``each``: ``None`` for a key not stored, the tier of every other, past the
    misses; in the sync and async faces alike, over one LOOKUP per 8192 keys."""
    with connect(daemon.socket) as client:
        ns = client.namespace("t", block_bytes=BLOCK)
        keys = chain_keys(range(16 * 8), 16, ns.key_salt)
        ns.put([keys[1], keys[4], keys[5]], _blocks(3))
        before = client.namespaces()[0]
        answer = ns.lookup_each(keys)
        assert answer == [None, "dram", None, None, "dram", "dram", None, None]
        after = client.namespaces()[0]
        assert after["lookup_blocks"] - before["lookup_blocks"] == 8
        assert after["hit_blocks"] - before["hit_blocks"] == 3  # present, not leading
        client.fsync()
        client.evict()
        assert ns.lookup_each(keys[4:6], promote=False) == ["nvme", "nvme"]
        assert ns.lookup_each([]) == []
        assert ns.lookup(keys) == 0  # LOOKUP without ``each`` stops at the first miss
        client.daemon_minor = 9  # a daemon that predates ``each`` is not asked: it would refuse
        with pytest.raises(NotSupportedError, match="needs minor 10"):
            ns.lookup_each(keys)


@pytest.mark.anyio
async def test_lookup_each_async(daemon: DaemonProcess) -> None:
    async with connect_async(daemon.socket) as client:
        ns = await client.namespace("t", block_bytes=BLOCK)
        keys = chain_keys(range(16 * 3), 16, ns.key_salt)
        await ns.put([keys[2]], _blocks(1))
        assert await ns.lookup_each(keys) == [None, None, "dram"]


def test_write_in_place_then_lease_without_copies(daemon: DaemonProcess) -> None:
    with connect(daemon.socket) as client:
        ns = client.namespace("t", block_bytes=BLOCK)
        keys = chain_keys(range(16 * 4), 16, ns.key_salt)
        ns.put(keys[:1], _blocks(1))
        with ns.write(keys) as block:
            assert block.views[0] is None  # already stored: skipped
            for i, view in enumerate(block.views[1:], start=1):
                assert view is not None
                np.frombuffer(view, np.uint8)[:] = i  # fill in place
            assert ns.lookup(keys) == 1  # nothing visible before the commit
        assert ns.lookup(keys) == 4
        with ns.lease(keys[1:]) as lease:
            arena = np.frombuffer(ns.arena_buffer(), np.uint8)
            for i, extent in enumerate(lease.extents, start=1):
                assert (arena[extent.offset : extent.offset + extent.length] == i).all()
            held = np.frombuffer(lease.views[0], np.uint8)  # an array still wrapping a view
            lease.release()
            assert held[0] == 1
        assert client.stats()["leases"] == 0


def test_an_acquired_lease_lives_until_released(daemon: DaemonProcess) -> None:
    with connect(daemon.socket) as client:
        ns = client.namespace("acq", block_bytes=BLOCK)
        keys = chain_keys(range(16 * 3), 16, ns.key_salt)
        data = _blocks(3)
        ns.put(keys, data)
        leases = [ns.acquire(keys[:2]), ns.acquire(keys[2:])]  # held across calls
        assert client.stats()["leased_blocks"] == 3
        assert ns.forget(keys) == 3  # a leased copy stays readable until released
        assert [bytes(v) for lease in leases for v in lease.views] == [bytes(d) for d in data]
        leases[0].release()
        leases[0].release()  # idempotent
        with leases[1]:  # also a context manager
            pass
        assert client.stats()["leases"] == 0


def test_a_write_that_raises_is_never_visible(daemon: DaemonProcess) -> None:
    with connect(daemon.socket) as client:
        ns = client.namespace("t", block_bytes=BLOCK)
        keys = chain_keys(range(16 * 2), 16, ns.key_salt)
        with pytest.raises(RuntimeError), ns.write(keys):
            raise RuntimeError("the engine failed mid-copy")
        assert ns.lookup(keys) == 0
        assert client.stats()["pending_writes"] == 0


@pytest.mark.anyio
async def test_async_write_and_lease(daemon: DaemonProcess) -> None:
    async with connect_async(daemon.socket) as client:
        ns = await client.namespace("t", block_bytes=BLOCK)
        keys = chain_keys(range(16 * 2), 16, ns.key_salt)
        async with ns.write(keys) as block:
            for view in block.views:
                assert view is not None
                np.frombuffer(view, np.uint8)[:] = 9
        async with ns.lease(keys) as lease:
            assert all(v[0] == 9 for v in lease.views)


def test_read_into_fills_a_scatter_list_in_order(daemon: DaemonProcess) -> None:
    """A block read into several buffers (the K and V runs of a strided page) lands in them
    in order, and a list too short for the block is refused with nothing copied."""
    blocks = _blocks(3, seed=2)
    with connect(daemon.socket) as client:
        ns = client.namespace("t", block_bytes=BLOCK)
        keys = chain_keys(range(16 * 3), 16, ns.key_salt)
        ns.put(keys, blocks)
        cuts = (1, BLOCK // 2, BLOCK - 4096)
        outs = [[np.zeros(c, np.uint8), np.zeros(BLOCK - c, np.uint8)] for c in cuts]
        assert ns.read_into(keys, outs) == 3 * BLOCK
        for (head, tail), block in zip(outs, blocks, strict=True):
            assert (np.concatenate([head, tail]) == block).all()
        short = [np.zeros(BLOCK // 2, np.uint8), np.zeros(BLOCK // 2 - 1, np.uint8)]
        with pytest.raises(InvalidRequestError, match="cannot hold"):
            ns.read_into(keys[:1], [short])
        assert not short[0].any()
        assert client.stats()["leases"] == 0


@pytest.mark.anyio
async def test_async_read_into_fills_a_scatter_list(daemon: DaemonProcess) -> None:
    blocks = _blocks(2, seed=3)
    async with connect_async(daemon.socket) as client:
        ns = await client.namespace("t", block_bytes=BLOCK)
        keys = chain_keys(range(16 * 2), 16, ns.key_salt)
        await ns.put(keys, blocks)
        outs = [(bytearray(100), bytearray(BLOCK - 100)) for _ in keys]
        assert await ns.read_into(keys, outs) == 2 * BLOCK
        assert all(bytes(a + b) == blk.tobytes() for (a, b), blk in zip(outs, blocks, strict=True))
