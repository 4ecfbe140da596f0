"""Issue 31 item 5: the largest legal request of every opcode, pipelined on one connection, while
another connection's LOOKUPs are answered (and counted) all along.

Each request is the biggest its bounds allow (8192 keys, a HINT queue of 8192 keys in all, a
sparse HINT of an 8192-block chain with 768 KiB of queries: what fits beside it in a frame, a
LIST_KEYS page of 8192) against a real daemon on the test's runtime. The test checks that every
request got its right answer and that the other client's LOOKUPs ran meanwhile, each answered
correctly; how long they waited is the benchmark's to measure (``tools/bench_loop.py``), never
asserted here.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pytest

from kvtierd.client import NotSupportedError, chain_keys, connect, connect_async, ops
from kvtierd.protocol.messages import (
    EvictReply,
    EvictRequest,
    LookupReply,
    LookupRequest,
    ReadResidentReply,
    ReadResidentRequest,
    ReleaseRequest,
)
from kvtierd.testing import DaemonProcess
from kvtierd.testing.loop_load import (
    BLOCK_BYTES,
    BLOCK_TOKENS,
    HEAD_DIM,
    LAYERS,
    LAYOUT,
    SPARSE_BYTES,
    N,
)

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(600)]

#: 768 KiB of float32 queries ([layers, q_heads, head_dim]): with the 8192-key chain, about the
#: most a 1 MiB frame carries (HINT's own bound on queries is 1 MiB).
QUERY_BYTES = 768 << 10
QUERY_HEADS = QUERY_BYTES // (4 * LAYERS * HEAD_DIM)


def _blocks(count: int, nbytes: int, seed: int) -> list[np.ndarray]:
    return [np.full(nbytes, (seed + i) % 251, np.uint8) for i in range(count)]


def _prepare(socket: Path) -> dict[str, Any]:
    """Four sets of 8192 blocks: ``nvme`` (durable, evicted from DRAM), ``dram`` (resident),
    ``doomed`` (to FORGET) and ``sparse`` (summarised for sparse HINTs); ``new`` is not stored."""
    with connect(socket) as client:
        ns = client.namespace("big", block_bytes=BLOCK_BYTES)
        sparse = client.namespace("sparse", block_bytes=SPARSE_BYTES, layout=LAYOUT, sparse=True)
        keys = chain_keys(range(BLOCK_TOKENS * 4 * N), BLOCK_TOKENS, ns.key_salt)
        sets = {
            name: keys[i * N : (i + 1) * N] for i, name in enumerate(("nvme", "dram", "doomed"))
        }
        sets["new"] = keys[3 * N :]
        sets["sparse"] = chain_keys(range(BLOCK_TOKENS * N), BLOCK_TOKENS, sparse.key_salt)
        assert ns.put(sets["nvme"], _blocks(N, BLOCK_BYTES, 1)) == N
        assert sparse.put(sets["sparse"], _blocks(N, SPARSE_BYTES, 2)) == N
        client.fsync()
        client.evict()
        assert ns.put(sets["dram"], _blocks(N, BLOCK_BYTES, 3)) == N
        assert ns.put(sets["doomed"], _blocks(N, BLOCK_BYTES, 4)) == N
        assert ns.lookup_tiers(sets["nvme"][:1], promote=False) == ["nvme"]
        return sets


async def _heavy(socket: Path, sets: dict[str, Any]) -> dict[str, Any]:
    """Every opcode's largest request, all at once on one connection; what each answered."""
    answers: dict[str, Any] = {}
    async with connect_async(socket) as client:
        ns = await client.namespace("big", block_bytes=BLOCK_BYTES)
        sparse = await client.namespace(
            "sparse", block_bytes=SPARSE_BYTES, layout=LAYOUT, sparse=True
        )
        scratch = await client.namespace("scratch", block_bytes=BLOCK_BYTES)
        nsid = ns.handle.ns
        queries = np.ones((LAYERS, QUERY_HEADS, HEAD_DIM), np.float32)
        assert queries.nbytes == QUERY_BYTES

        async def read_resident() -> int:
            reply = await client.run(ops.request(ReadResidentRequest(sets["dram"]), nsid))
            assert isinstance(reply, ReadResidentReply)
            assert all(extent.length == BLOCK_BYTES for extent in reply.extents)
            if reply.extents:
                await client.run(ops.request(ReleaseRequest([reply.lease])))  # RELEASE too
            return len(reply.extents)

        async def lookup(keys: list[bytes]) -> int:
            reply = await client.run(ops.request(LookupRequest(keys), nsid))
            assert isinstance(reply, LookupReply)
            return reply.hits

        async def read(keys: list[bytes], seed: int) -> int:
            """READ (and RELEASE); how many blocks came back with the bytes put."""
            buffers = [bytearray(BLOCK_BYTES) for _ in keys]
            assert await ns.read_into(keys, buffers) == len(keys) * BLOCK_BYTES
            expected = _blocks(len(keys), BLOCK_BYTES, seed)
            return sum(bytes(b) == e.tobytes() for b, e in zip(buffers, expected, strict=True))

        async def list_keys() -> int:
            page = await client.list_keys(nsid, limit=N)
            return len(page["keys"])

        async def evict() -> int:
            # EVICT walks the whole index whatever its namespace: this one's, so that the
            # blocks the other requests read stay where they are
            reply = await client.run(ops.request(EvictRequest(), scratch.handle.ns))
            assert isinstance(reply, EvictReply)
            return reply.evicted

        async def nixl_grant() -> str:
            try:
                await client.run(ops.nixl_grant(nsid))
            except NotSupportedError:
                return "EOPNOTSUPP"
            return "granted"

        calls: dict[str, Callable[[], Awaitable[Any]]] = {
            "lookup_dram": lambda: lookup(sets["dram"]),
            "lookup_nvme": lambda: lookup(sets["nvme"]),
            "read_resident": read_resident,
            "read_dram": lambda: read(sets["dram"], 3),
            "read_nvme": lambda: read(sets["nvme"], 1),
            "put": lambda: ns.put(sets["new"], _blocks(N, BLOCK_BYTES, 5)),
            "forget": lambda: ns.forget(sets["doomed"]),
            "hint_queue": lambda: ns.hint([sets["nvme"][: N // 2], sets["nvme"][N // 2 :]]),
            "hint_sparse": lambda: sparse.hint_attention(
                sets["sparse"], queries, query_layers=list(range(LAYERS)), budget_blocks=64
            ),
            "list_keys": list_keys,
            "fsync": client.fsync,
            "statfs": client.stats,
            "list_ns": client.namespaces,
            "pool_status": client.pool_status,
            "doctor": client.doctor,
            "evict": evict,
            "nixl_grant": nixl_grant,
        }

        async def one(name: str, call: Callable[[], Awaitable[Any]]) -> None:
            answers[name] = await call()

        async with anyio.create_task_group() as tg:
            for name, call in calls.items():
                tg.start_soon(one, name, call)
    return answers


async def _watch(socket: Path, key: list[bytes], done: anyio.Event) -> list[int]:
    """Another client's LOOKUPs of one stored key until ``done``: each one's hit count."""
    hits: list[int] = []
    async with connect_async(socket) as client:
        ns = await client.namespace("watch", block_bytes=BLOCK_BYTES)
        while not done.is_set():
            hits.append(await ns.lookup(key))
    return hits


async def test_every_opcode_at_its_largest_while_another_client_looks_up(
    tmp_path: Path, anyio_backend: str
) -> None:
    with DaemonProcess(tmp_path, dram_size="384M", nvme_size="512M", runtime=anyio_backend) as d:
        sets = await anyio.to_thread.run_sync(_prepare, d.socket)
        with connect(d.socket) as setup:
            watched = setup.namespace("watch", block_bytes=BLOCK_BYTES)
            key = chain_keys(range(BLOCK_TOKENS), BLOCK_TOKENS, watched.key_salt)
            watched.put(key, _blocks(1, BLOCK_BYTES, 6))
        done = anyio.Event()
        watched_hits: list[int] = []

        async def watch() -> None:
            watched_hits.extend(await _watch(d.socket, key, done))

        async with anyio.create_task_group() as tg:
            tg.start_soon(watch)
            await anyio.sleep(0.2)  # the watcher is looking up before the load starts
            try:
                answers = await _heavy(d.socket, sets)
            finally:
                done.set()

        assert answers["lookup_dram"] == N
        assert answers["lookup_nvme"] == N
        # the leading blocks still in DRAM: the other requests' promotions and allocations
        # may have evicted clean ones meanwhile (READ_RESIDENT never waits for them)
        assert 0 <= answers["read_resident"] <= N
        assert answers["read_dram"] == N  # every block's bytes as put
        assert answers["read_nvme"] == N
        assert answers["put"] == N
        assert answers["forget"] == N
        assert 0 <= answers["hint_queue"] <= N
        ranked, predicted = answers["hint_sparse"]
        assert sets["sparse"][0] in ranked  # the attention sink is always kept
        assert set(ranked) <= set(sets["sparse"])
        assert not set(ranked) & set(predicted)
        assert answers["list_keys"] == N
        assert answers["fsync"] >= N
        assert answers["statfs"]["requests"] > 0
        assert {n["name"] for n in answers["list_ns"]} >= {"big", "sparse", "watch"}
        assert answers["pool_status"]["state"] == "none"
        assert answers["doctor"]
        assert answers["evict"] == 0  # scratch holds no block
        assert answers["nixl_grant"] == "EOPNOTSUPP"
        assert len(watched_hits) > 0, "the other client's LOOKUPs never ran"
        assert set(watched_hits) == {1}
        with connect(d.socket) as after:  # and the daemon serves on
            ns = after.namespace("big", block_bytes=BLOCK_BYTES)
            assert ns.lookup(sets["new"][:16], promote=False) == 16
            assert ns.lookup(sets["doomed"][:1], promote=False) == 0
