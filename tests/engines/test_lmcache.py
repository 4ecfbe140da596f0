"""LMCache's own engine (``LMCacheEngine.store()`` / ``retrieve()``) with kvtierd as its storage
tier, against a real daemon: what LMCache stores comes back byte for byte, also from the NVMe
tier after a daemon restart and when the DRAM tier cannot hold everything; a failed store is
never visible; LMCache's prefix hit count is kvtierd's LOOKUP.

The token sequence is the UTF-8 bytes of a public-domain text (a byte-level tokenisation); the
KV is random data of a small model's shape in bfloat16 (a dtype numpy lacks, so every byte path
is exercised). LMCache's engine is driven by the CPU connector of ``kvtierd.testing.lmcache_cpu``.
"""

from __future__ import annotations

import itertools
import os
import threading
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvtierd.client import connect
from kvtierd.engines.lmcache_keys import block_key
from kvtierd.testing import DaemonProcess
from tests.support.scribble import scribble

try:
    with warnings.catch_warnings():
        # LMCache's logger setup uses an opentelemetry handler that warns it is deprecated.
        warnings.filterwarnings("ignore", "`LoggingHandler`", DeprecationWarning)
        import torch
        from lmcache.v1.cache_engine import LMCacheEngineBuilder
        from lmcache.v1.config import LMCacheEngineConfig
        from lmcache.v1.memory_management import MemoryFormat, MemoryObjMetadata, TensorMemoryObj
        from lmcache.v1.metadata import LMCacheMetadata

        from kvtierd.engines.lmcache import KvtierdBackend
        from kvtierd.testing.lmcache_cpu import CpuKvConnector
except ImportError as exc:  # pragma: no cover - depends on the environment
    pytest.skip(
        f"lmcache is not importable ({exc}); `pip install -e .[peers]` installs it",
        allow_module_level=True,
    )

pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.filterwarnings(
        "ignore:`LoggingHandler` in `opentelemetry-sdk` is deprecated:DeprecationWarning"
    ),
]

# Charles Dickens, "A Tale of Two Cities" (1859): public domain.
TEXT = (
    "It was the best of times, it was the worst of times, it was the age of wisdom, it was the "
    "age of foolishness, it was the epoch of belief, it was the epoch of incredulity, it was the "
    "season of Light, it was the season of Darkness, it was the spring of hope, it was the winter "
    "of despair, we had everything before us, we had nothing before us, we were all going direct "
    "to Heaven, we were all going direct the other way - in short, the period was so far like "
    "the present period, that some of its noisiest authorities insisted on its being received, "
    "for good or for evil, in the superlative degree of comparison only."
)
MODEL = "test/tiny-llama"
LAYERS, KV_HEADS, HEAD_DIM, CHUNK = 4, 2, 64, 16  # 32 KiB chunks in bfloat16
DTYPE = torch.bfloat16
_ids = itertools.count()


def tokens(n: int) -> list[int]:
    data = (TEXT.encode() * (n // len(TEXT) + 1))[:n]
    return list(data)


def random_kv(n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(LAYERS, 2, n, KV_HEADS, HEAD_DIM, generator=g).to(DTYPE)


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.int16), b.view(torch.int16))


class Engine:
    """One LMCacheEngine whose only storage is kvtierd (LMCache's CPU pool stages stores; with
    ``local_cpu`` it is also LMCache's hot cache, and kvtierd's reads are copied into it)."""

    def __init__(self, socket: Path, staging_gb: float = 0.03, local_cpu: bool = False) -> None:
        kv_shape = (LAYERS, 2, CHUNK, KV_HEADS, HEAD_DIM)
        config = LMCacheEngineConfig.from_defaults(
            chunk_size=CHUNK,
            local_cpu=local_cpu,
            max_local_cpu_size=staging_gb,
            storage_plugins=["kvtierd"],
            extra_config={
                "storage_plugin.kvtierd.module_path": "kvtierd.engines.lmcache",
                "storage_plugin.kvtierd.class_name": "KvtierdBackend",
                "kvtierd.socket": str(socket),
            },
        )
        metadata = LMCacheMetadata(
            model_name=MODEL,
            world_size=1,
            local_world_size=1,
            worker_id=0,
            local_worker_id=0,
            kv_dtype=DTYPE,
            kv_shape=kv_shape,
            chunk_size=CHUNK,
        )
        self.instance = f"kvtierd-test-{os.getpid()}-{next(_ids)}"
        self.engine = LMCacheEngineBuilder.get_or_create(
            self.instance, config, metadata, CpuKvConnector(kv_shape), None, None
        )
        self.engine.post_init()
        backend = self.engine.storage_manager.storage_backends.get("kvtierd")
        assert isinstance(backend, KvtierdBackend), "LMCache did not load the kvtierd plug-in"
        self.backend = backend

    def store(self, ids: list[int], kv: torch.Tensor) -> None:
        self.engine.store(ids, kvcaches=kv)

    def retrieve(self, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        out = torch.zeros(LAYERS, 2, len(ids), KV_HEADS, HEAD_DIM, dtype=DTYPE)
        mask = self.engine.retrieve(ids, kvcaches=out)
        return mask, out

    def keys(self, ids: list[int]) -> list[Any]:
        return [key for _, _, key in self.engine.token_database.process_tokens(tokens=ids)]

    def namespace(self, client: Any, ids: list[int]) -> Any:
        """The kvtierd namespace LMCache's keys for ``ids`` live in, opened on ``client``."""
        spec = self.backend.namespace_spec(self.keys(ids)[0])
        return client.namespace(
            spec.name,
            block_bytes=spec.block_bytes,
            layout=spec.layout,
            rank=spec.rank,
            world_size=spec.world_size,
            create=False,
        )

    def close(self) -> None:
        manager = self.engine.storage_manager
        LMCacheEngineBuilder.destroy(self.instance)
        manager.loop.close()  # LMCache stops its storage loop's thread but leaves it open


@pytest.fixture(autouse=True)
def _no_usage_reports(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LMCACHE_TRACK_USAGE", "false")  # LMCache would report to its servers


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[DaemonProcess]:
    with DaemonProcess(tmp_path / "kvtierd", dram_size="64M", nvme_size="256M") as d:
        yield d


@pytest.fixture
def engine(daemon: DaemonProcess) -> Iterator[Engine]:
    e = Engine(daemon.socket)
    try:
        yield e
    finally:
        e.close()


def test_store_then_retrieve_is_byte_exact(engine: Engine, daemon: DaemonProcess) -> None:
    ids, kv = tokens(512), random_kv(512)
    engine.store(ids, kv)
    assert engine.engine.lookup(ids) == 512
    mask, out = engine.retrieve(ids)
    assert bool(mask.all())
    assert same_bytes(out, kv)
    stats = engine.backend.statistics()
    assert (stats.stored_chunks, stats.read_chunks, stats.errors) == (32, 32, 0)
    with connect(daemon.socket) as client:
        [ns] = [n for n in client.namespaces() if n["name"].startswith("lmcache/")]
    assert ns["name"] == f"lmcache/{MODEL}/builtin"
    assert ns["dram_blocks"] == 32


def test_prefix_hit_is_kvtierd_lookup(engine: Engine, daemon: DaemonProcess) -> None:
    ids, kv = tokens(512), random_kv(512, seed=1)
    engine.store(ids[:320], kv[:, :, :320].contiguous())  # 20 of 32 chunks
    assert engine.engine.lookup(ids) == 320
    keys = engine.keys(ids)
    with connect(daemon.socket) as client:
        ns = engine.namespace(client, ids)
        assert ns.lookup([block_key(k.chunk_hash) for k in keys]) == 20
        ns.forget([block_key(keys[5].chunk_hash)])  # a hole: the hit ends before it
    assert engine.engine.lookup(ids) == 5 * CHUNK
    mask, out = engine.retrieve(ids)
    assert int(mask.sum()) == 5 * CHUNK
    assert bool(mask[: 5 * CHUNK].all())
    assert same_bytes(out[:, :, : 5 * CHUNK], kv[:, :, : 5 * CHUNK])


def test_lookup_pins_hold_the_dram_hits_until_retrieved(
    engine: Engine, daemon: DaemonProcess
) -> None:
    ids, kv = tokens(512), random_kv(512, seed=5)
    engine.store(ids, kv)
    keys = [block_key(k.chunk_hash) for k in engine.keys(ids)]
    # what LMCache's engine does for a request: lookup with pin, retrieve, unpin
    assert engine.engine.lookup(ids, lookup_id="request-1", pin=True) == 512
    with connect(daemon.socket) as client:
        assert client.stats()["leased_blocks"] == 32
        client.evict()  # an EVICT between lookup and retrieve cannot take pinned blocks
        ns = engine.namespace(client, ids)
        assert ns.lookup_tiers(keys, promote=False) == ["dram"] * 32
    mask, out = engine.retrieve(ids)
    assert bool(mask.all())
    assert same_bytes(out, kv)
    stats = engine.backend.statistics()
    assert (stats.read_chunks, stats.pinned_chunks, stats.errors) == (32, 32, 0)
    with connect(daemon.socket) as client:
        assert client.stats()["leased_blocks"] == 32  # retrieved, but still pinned
        engine.engine.lookup_unpin("request-1")
        assert _no_leases_soon(client)
        client.fsync()  # a block still awaiting write-back is dirty, and EVICT keeps it
        client.evict()
        ns = engine.namespace(client, ids)
        assert ns.lookup_tiers(keys, promote=False) == ["nvme"] * 32
    # pinned again, undone before any retrieve: nothing stays leased
    assert engine.engine.lookup(ids, lookup_id="request-2", pin=True) == 512
    engine.engine.lookup_unpin("request-2")
    with connect(daemon.socket) as client:
        assert _no_leases_soon(client)


def test_unpinning_a_chunk_found_on_nvme_leaves_other_lookups_pins(
    engine: Engine, daemon: DaemonProcess
) -> None:
    ids, kv = tokens(512), random_kv(512, seed=6)
    engine.store(ids, kv)
    keys = [block_key(k.chunk_hash) for k in engine.keys(ids)]
    with connect(daemon.socket) as client:
        client.fsync()
        ns = engine.namespace(client, ids)
        for _ in range(10):
            client.evict()
            # request 1 finds every chunk on NVMe (its pins lease nothing) and promotes them
            assert engine.engine.lookup(ids, lookup_id="request-1", pin=True) == 512
            deadline = time.monotonic() + 30
            while ns.lookup_tiers(keys, promote=False) != ["dram"] * 32:
                assert time.monotonic() < deadline, "LOOKUP's promotions did not finish"
                time.sleep(0.01)
            if client.stats()["leased_blocks"] == 0:
                break
            # the promotions were done before its pins were taken (the disk was that fast):
            # they leased the chunks, not the case tested here; again
            engine.engine.lookup_unpin("request-1")
            assert _no_leases_soon(client)
        else:
            pytest.fail("request 1's pins leased the chunks every time")
        # request 2 finds them in DRAM and leases them
        assert engine.engine.lookup(ids, lookup_id="request-2", pin=True) == 512
        assert client.stats()["leased_blocks"] == 32
        engine.engine.lookup_unpin("request-1")  # must not take request 2's pins
        # a request on the backend's own connection: served after any RELEASE sent before it
        assert engine.backend.batched_contains(engine.keys(ids)[:1]) == 1
        assert client.stats()["leased_blocks"] == 32
        mask, out = engine.retrieve(ids)
        assert bool(mask.all())
        assert same_bytes(out, kv)
        assert engine.backend.statistics().pinned_chunks == 32
        engine.engine.lookup_unpin("request-2")
        assert _no_leases_soon(client)


def _no_leases_soon(client: Any) -> bool:
    """RELEASE goes out without waiting for its reply, on the backend's own connection, so
    another connection sees it take effect a moment later."""
    deadline = time.monotonic() + 10
    while client.stats()["leases"] and time.monotonic() < deadline:
        time.sleep(0.01)
    return client.stats()["leases"] == 0


def test_with_local_cpu_reads_are_copies_into_lmcache_s_pool(daemon: DaemonProcess) -> None:
    writer, reader = Engine(daemon.socket), Engine(daemon.socket, local_cpu=True)
    try:
        ids, kv = tokens(512), random_kv(512, seed=7)
        writer.store(ids, kv)
        assert reader.engine.lookup(ids) == 512
        mask, out = reader.retrieve(ids)
        assert bool(mask.all())
        assert same_bytes(out, kv)
        stats = reader.backend.statistics()
        assert (stats.read_chunks, stats.pinned_chunks, stats.errors) == (32, 0, 0)
        with connect(daemon.socket) as client:
            assert _no_leases_soon(client)  # copied out: no lease outlives the read
    finally:
        writer.close()
        reader.close()


@pytest.mark.parametrize("local_cpu", [False, True], ids=["zero-copy", "local-cpu"])
def test_a_chunk_scribbled_after_commit_is_a_miss(daemon: DaemonProcess, local_cpu: bool) -> None:
    """Zero-copy objects are verified when leased, copies into LMCache's pool as they are
    made: either way the chunk a client of the tenant changed after COMMIT ends the hit."""
    writer, reader = Engine(daemon.socket), Engine(daemon.socket, local_cpu=local_cpu)
    try:
        ids, kv = tokens(512), random_kv(512, seed=8)
        writer.store(ids, kv)
        with connect(daemon.socket) as client:
            scribble(writer.namespace(client, ids), [block_key(writer.keys(ids)[5].chunk_hash)])
        mask, out = reader.retrieve(ids)
        assert int(mask.sum()) == 5 * CHUNK
        assert bool(mask[: 5 * CHUNK].all())
        assert same_bytes(out[:, :, : 5 * CHUNK], kv[:, :, : 5 * CHUNK])
        assert reader.backend.statistics().read_chunks == 5
        with connect(daemon.socket) as client:
            assert _no_leases_soon(client)
    finally:
        writer.close()
        reader.close()


def test_failed_store_is_never_visible(engine: Engine) -> None:
    ids, kv = tokens(64), random_kv(64, seed=2)
    good_keys = engine.keys(ids)
    staged = engine.engine.storage_manager.allocate(
        engine.engine.metadata.get_shapes(CHUNK), engine.engine.metadata.get_dtypes()
    )
    assert staged is not None
    staged.tensor.copy_(kv[:, :, :CHUNK].permute(1, 0, 2, 3, 4).reshape(staged.tensor.shape))
    # A chunk whose bytes cannot be read (its buffer is one byte short): the copy into the
    # arena fails half-way through the write.
    meta = staged.metadata
    short = TensorMemoryObj(
        torch.zeros(meta.phy_size - 1, dtype=torch.uint8),
        MemoryObjMetadata(meta.shape, meta.dtype, 0, meta.phy_size - 1, 1, meta.fmt),
        None,
    )
    with pytest.raises(RuntimeError):
        engine.backend.batched_submit_put_task(good_keys[:2], [staged, short])
    staged.ref_count_down()
    assert engine.backend.batched_contains(good_keys) == 0
    assert engine.engine.lookup(ids) == 0
    engine.store(ids, kv)  # the same keys store normally afterwards
    mask, out = engine.retrieve(ids)
    assert bool(mask.all())
    assert same_bytes(out, kv)


def test_daemon_restart_serves_from_disk(engine: Engine, daemon: DaemonProcess) -> None:
    ids, kv = tokens(1024), random_kv(1024, seed=3)
    engine.store(ids, kv)
    with connect(daemon.socket) as client:
        client.fsync()
    daemon.stop()
    assert engine.engine.lookup(ids) == 0  # unreachable: a miss, not an error
    assert engine.backend.statistics().errors > 0
    daemon.start()
    keys = [block_key(k.chunk_hash) for k in engine.keys(ids)]
    with connect(daemon.socket) as client:
        ns = engine.namespace(client, ids)
        assert set(ns.lookup_tiers(keys, promote=False)) == {"nvme"}
    assert engine.engine.lookup(ids) == 1024
    mask, out = engine.retrieve(ids)
    assert bool(mask.all())
    assert same_bytes(out, kv)


def test_more_than_dram_holds(tmp_path: Path) -> None:
    # 16 MiB of DRAM, 48 MiB of KV (1536 chunks of 32 KiB): stores go through write-back and
    # eviction, and one retrieve needs more blocks than the arena can lease at once.
    chunks = 1536
    with DaemonProcess(tmp_path / "small", dram_size="16M", nvme_size="160M") as d:
        engine = Engine(d.socket, staging_gb=0.1)
        try:
            ids, kv = tokens(chunks * CHUNK), random_kv(chunks * CHUNK, seed=4)
            engine.store(ids, kv)
            assert engine.backend.statistics().stored_chunks == chunks
            assert engine.engine.lookup(ids) == len(ids)
            mask, out = engine.retrieve(ids)
            assert bool(mask.all())
            assert same_bytes(out, kv)
            with connect(d.socket) as client:
                [info] = [n for n in client.namespaces() if n["name"].startswith("lmcache/")]
            assert info["dram_blocks"] < chunks <= info["nvme_blocks"]
        finally:
            engine.close()


def _chunk(engine: Engine, seed: int) -> TensorMemoryObj:
    """A memory object of one chunk of random bytes, as LMCache hands a backend to store."""
    shapes = list(engine.engine.metadata.get_shapes(CHUNK))
    dtypes = list(engine.engine.metadata.get_dtypes())
    size = sum(s.numel() * d.itemsize for s, d in zip(shapes, dtypes, strict=True))
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (size,), dtype=torch.uint8, generator=g)
    meta = MemoryObjMetadata(
        shapes[0], dtypes[0], 0, size, 1, MemoryFormat.KV_2LTD, shapes=shapes, dtypes=dtypes
    )
    return TensorMemoryObj(raw, meta, None)


def _chunk_bytes(obj: Any) -> torch.Tensor:
    return obj.raw_tensor.reshape(-1).view(torch.uint8)[: obj.get_size()]


def _connections_soon(client: Any, wanted: int) -> bool:
    """The daemon forgets a closed connection a moment after the client has closed it."""
    deadline = time.monotonic() + 10
    while client.stats()["connections"] != wanted and time.monotonic() < deadline:
        time.sleep(0.01)
    return bool(client.stats()["connections"] == wanted)


def _fresh_backend(engine: Engine) -> KvtierdBackend:
    """Another backend as LMCache's launcher builds it, not connected yet."""
    b = engine.backend
    return KvtierdBackend(b.config, b.dst_device, b.metadata, b.local_cpu_backend, b.loop)


def _put_then_get_in_threads(
    engine: Engine, backend: KvtierdBackend, keys: list[list[Any]], seed: int
) -> None:
    """One thread per list of keys, started together: put a chunk per key, then get them all
    back and compare the bytes."""
    start = threading.Barrier(len(keys))
    errors: list[BaseException] = []

    def put_then_get(t: int) -> None:
        try:
            objs = [_chunk(engine, seed + t * len(keys[t]) + i) for i in range(len(keys[t]))]
            start.wait()
            backend.batched_submit_put_task(keys[t], objs)
            got = backend.batched_get_blocking(keys[t])
            assert all(g is not None for g in got), "a stored chunk was not read"
            for g, o in zip(got, objs, strict=True):
                assert torch.equal(_chunk_bytes(g), _chunk_bytes(o))
                g.ref_count_down()  # what LMCache does once it has loaded a chunk
        except BaseException as exc:  # reported by the test, not lost in a thread
            errors.append(exc)

    workers = [
        threading.Thread(target=put_then_get, args=(t,), daemon=True) for t in range(len(keys))
    ]
    for worker in workers:
        worker.start()
    deadline = time.monotonic() + 60
    for worker in workers:
        worker.join(max(0.0, deadline - time.monotonic()))
    assert not any(w.is_alive() for w in workers), "a thread hung"
    if errors:
        raise errors[0]


@pytest.mark.timeout(180)
def test_threads_put_then_get_through_one_backend(engine: Engine, daemon: DaemonProcess) -> None:
    """LMCache's own plug-in smoke test, in our words: four threads put then get through one
    backend, from its start-up on (where they all open the namespace at once), several times."""
    threads, chunks, rounds = 4, 8, 5
    text = tokens(chunks * CHUNK)
    with connect(daemon.socket) as observer:
        baseline = observer.stats()["connections"]
        for round_ in range(rounds):
            # tokens of its own for each thread and round: each put stores new chunks
            shifts = [round_ * threads + t for t in range(threads)]
            keys = [engine.keys([(b + shift) % 256 for b in text]) for shift in shifts]
            backend = _fresh_backend(engine)
            _put_then_get_in_threads(engine, backend, keys, seed=round_ * threads * chunks)
            stats = backend.statistics()
            assert (stats.stored_chunks, stats.read_chunks, stats.errors) == (
                threads * chunks,
                threads * chunks,
                0,
            )
            assert _no_leases_soon(observer)
            backend.close()
            assert _connections_soon(observer, baseline)


def test_a_closed_backend_neither_reconnects_nor_stores(
    engine: Engine, daemon: DaemonProcess
) -> None:
    ids = tokens(64)
    stored, fresh = engine.keys(ids[:32]), engine.keys([7, *ids[:31]])
    backend = engine.backend
    backend.batched_submit_put_task(stored, [_chunk(engine, i) for i in range(2)])
    with connect(daemon.socket) as observer:
        assert _connections_soon(observer, 2)  # the backend's connection and this one
        backend.close()
        assert _connections_soon(observer, 1)
        backend.batched_submit_put_task(fresh, [_chunk(engine, i) for i in range(2, 4)])
        assert backend.batched_contains(stored) == 0
        assert backend.batched_get_blocking(stored) == [None, None]
        assert backend.batched_remove(stored) == 0
        backend.close()  # idempotent
        assert observer.stats()["connections"] == 1  # nothing reconnected
        stats = backend.statistics()
        assert (stats.stored_chunks, stats.failed_stores, stats.errors) == (2, 2, 4)
        ns = engine.namespace(observer, ids)
        assert ns.lookup([block_key(k.chunk_hash) for k in stored]) == 2
        assert ns.lookup([block_key(k.chunk_hash) for k in fresh]) == 0  # refused, not stored
