"""kvtierd as LMCache's storage tier: a storage plug-in for LMCache's engine (``LMCacheEngine``).

Configure LMCache with (YAML, or the same keys in ``LMCACHE_*`` variables)::

    chunk_size: 256
    local_cpu: false              # kvtierd is the cache; LMCache's CPU pool only stages stores
    max_local_cpu_size: 2         # GB of staging for stores
    storage_plugins: [kvtierd]
    extra_config:
      storage_plugin.kvtierd.module_path: kvtierd.engines.lmcache
      storage_plugin.kvtierd.class_name: KvtierdBackend
      kvtierd.socket: /run/kvtierd/kvtierd.sock   # optional; else kvtierd's default socket
      kvtierd.tenant: default                     # optional

Theory of operation
-------------------
*Why this plug-in point.* LMCache's engine moves every chunk between the serving engine's KV
buffers and a ``MemoryObj`` through its GPU connector. A storage plug-in
(``StoragePluginInterface``, loaded from ``storage_plugins``) is handed those objects on store
and returns objects on retrieve. So a retrieve can hand LMCache a ``MemoryObj`` that *is* the
leased block in kvtierd's shared arena: the GPU connector then copies arena -> engine once, the
only copy a read needs. LMCache's MP-mode L2 adapters and its remote connectors instead fill
buffers LMCache allocated, one more copy per read (``docs/engines.md`` argues this in full).
A store costs engine -> LMCache's staging buffer (LMCache's own copy, before any backend is
called) -> arena.

*Reads.* ``batched_get_blocking`` READs the keys (one request per ``max_keys`` keys; the daemon
promotes NVMe hits into the arena and leases them) and wraps each extent of the whole-arena
tensor in a ``TensorMemoryObj`` whose allocator is the lease: when LMCache drops its last
reference to every object of one READ, the lease is RELEASEd. A key missing at READ (evicted or
forgotten since LOOKUP) ends the hit there: the keys before it are read, the rest answer
``None``, which LMCache treats as a shorter hit. At most half the arena is leased per call:
the rest of a larger read is copied a batch at a time into objects from LMCache's CPU pool (and
each batch's lease released at once), so a request larger than the DRAM tier still completes;
a READ answered ``ENOSPC`` because free slots await write-back is retried once after FSYNC.
With ``local_cpu: true`` LMCache would keep retrieved objects in its own hot cache
indefinitely, which would pin arena blocks; in that mode every block is copied out that way.
*Verification.* A zero-copy object is hashed when it is leased (LMCache's GPU connector makes
the one copy, with torch, which kvtierd cannot hash as it goes), so a warm zero-copy read reads
each byte twice: the hash, then LMCache's copy. A block copied into LMCache's pool is hashed in
the pass that copies it (:func:`kvtierd.client.arena.copy_verified`). Either way a block that
fails (a client of its tenant changed it after COMMIT) ends the hit there, never served.

*Writes.* ``batched_submit_put_task`` ALLOCs arena slots for the keys not stored yet, copies each
object's bytes in and COMMITs; a key becomes visible to any LOOKUP only at COMMIT, and a copy
that fails aborts the write, so a failed write is never visible. It runs synchronously in the
caller's thread (the copy is a memory copy), so LMCache may reuse its staging object on return.
A full arena (``ENOSPC``: every slot leased or awaiting write-back) is answered by FSYNC, which
makes the written blocks clean and so evictable, and one retry. Only full chunks are stored
(LMCache's default, ``save_unfull_chunk: false``); a trailing partial chunk is skipped, so it
reads as a miss.

*Lookups.* ``batched_contains`` is kvtierd's LOOKUP: the count of leading keys present in any
tier, for the whole TP group, and it starts promoting NVMe hits into DRAM at once. LMCache's
engine pins what its lookup found until it has retrieved it (``pin=True``, undone by
``unpin``): the hits already in DRAM are then leased at once (READ_RESIDENT), so no eviction can
take them, and the retrieve turns them into memory objects with no request to the daemon
(about 0.15-0.2 ms saved per chunk). Each lease lasts until its pins are undone and every
object made from it is freed; pin leases hold at most half the arena, past that a pin is just
the lookup (:mod:`kvtierd.engines.lmcache_pins`). Hits on NVMe are not leased: blocks leave
DRAM for NVMe, not for nowhere, and a block that did vanish is a shorter hit at READ. With
``local_cpu: true`` (reads copied out) a pin is only the lookup.

*Keys and namespaces* come from LMCache's ``CacheEngineKey`` and metadata without re-hashing
(:mod:`kvtierd.engines.lmcache_keys`).

*Failures.* LMCache calls backends expecting ``None``/``0`` for "not here", and a cache tier
that is unreachable must not fail the serving engine: a ``KvtierError`` (daemon stopped,
restarted, out of space) is logged, counted in :meth:`KvtierdBackend.statistics`, and answered
as a miss or a skipped store. A broken connection is re-established once per call, so a
restarted daemon is used again at once (and serves what its NVMe tier recovered). After
``close()`` nothing is: every call is answered that way (``ClosedError``), and the connection
and its mapping are gone for good.

*Threads.* LMCache calls a plug-in from its worker threads and, through ``to_thread``, from its
storage loop, so one backend serves several threads on one connection: the client takes their
requests in turns (:mod:`kvtierd.client.sync`), the link's session
(:class:`~kvtierd.engines.link.EngineLink`) opens each namespace once, under its own lock, and
the pins are a thread-safe table. The backend's lock guards what it keeps per session (the
region and the pins) and the counters; it is held across no request.

*Why one module of about 600 lines:* it is one class, the interface LMCache loads by name, and
what it does not need to hold is already elsewhere (keys in ``lmcache_keys``, pins in
``lmcache_pins``, the connection in :mod:`kvtierd.engines.link`, the protocol in
:mod:`kvtierd.client`).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import weakref
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
from lmcache.v1.memory_management import MemoryFormat, MemoryObjMetadata, TensorMemoryObj
from lmcache.v1.storage_backend.abstract_backend import StoragePluginInterface

from kvtierd.client import Client, Namespace, ops
from kvtierd.client.arena import copy_verified, verified_prefix
from kvtierd.engines.link import EngineLink, NamespaceSpec, Session
from kvtierd.engines.lmcache_keys import block_key, namespace_spec
from kvtierd.engines.lmcache_pins import PinTable, SharedLease
from kvtierd.errors import (
    BlockNotFoundError,
    NoSpaceError,
    RemoteProtocolError,
)
from kvtierd.protocol.messages import Extent

__all__ = ["BackendStatistics", "KvtierdBackend"]

log = logging.getLogger("kvtierd.engines.lmcache")
T = TypeVar("T")
#: At most this share of the arena is allocated by one write (ALLOC, copy, COMMIT).
_WRITE_ARENA_SHARE = 8
#: At most this share of the arena is held by lookup pins.
_PIN_ARENA_SHARE = 2


@dataclass(frozen=True, slots=True)
class BackendStatistics:
    """Counters of one :class:`KvtierdBackend` since it was created."""

    stored_chunks: int
    partial_chunks_skipped: int
    failed_stores: int
    lookups: int
    read_chunks: int
    #: of ``read_chunks``, those a lookup had pinned (served without a request to the daemon)
    pinned_chunks: int
    errors: int


@dataclass
class _Session:
    """A session of the backend's link and what the backend keeps with it: its tenant's region
    as a tensor (mapped when the first namespace is opened: every namespace of a backend has
    the backend's tenant, so one region) and the pins of lookups on its connection."""

    link: Session
    chunk_bytes: int
    region: int = 0
    region_bytes: int = 0
    arena: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.uint8))
    pins: PinTable = field(default_factory=lambda: PinTable(0))
    #: Held while the region is attached, so it is mapped once.
    attaching: threading.Lock = field(default_factory=threading.Lock)

    @property
    def client(self) -> Client:
        return self.link.client

    def namespace(self, ident: tuple[Any, ...], spec: Callable[[], NamespaceSpec]) -> Namespace:
        """The namespace known as ``ident``, opened (``spec()``) the first time; the region
        is attached before any namespace is returned, so a caller may use it at once."""
        ns = self.link.namespace_as(ident, spec)
        if not self.region_bytes:
            with self.attaching:
                if not self.region_bytes:
                    self._attach(ns)
        if ns.handle.region != self.region:
            raise ValueError("the namespaces of one LMCache backend must share a tenant")
        return ns

    def _attach(self, ns: Namespace) -> None:
        """Map ``ns``'s region, pinned where CUDA is (copies to HBM are DMA then, with no
        staging copy); every later namespace shares it."""
        device = torch.device("cuda") if torch.cuda.is_available() else None
        self.arena = self.link.arena(ns, device)
        self.pins = PinTable(len(self.arena) // self.chunk_bytes // _PIN_ARENA_SHARE)
        self.region = ns.handle.region
        self.region_bytes = len(self.arena)  # last: published once the rest is set


class KvtierdBackend(StoragePluginInterface):  # type: ignore[misc]
    """LMCache storage backend on a kvtierd daemon (see the module docstring)."""

    def __init__(
        self,
        config: Any = None,
        dst_device: str = "cpu",
        metadata: Any = None,
        local_cpu_backend: Any = None,
        loop: asyncio.AbstractEventLoop | None = None,
    ) -> None:
        """Called by LMCache's plug-in launcher. Raises ``ValueError`` for a configuration this
        backend cannot serve (no CPU staging pool, layer-wise keys)."""
        super().__init__(
            dst_device=dst_device,
            config=config,
            metadata=metadata,
            local_cpu_backend=local_cpu_backend,
            loop=loop,
        )
        if config is None or metadata is None:
            raise ValueError("KvtierdBackend needs LMCache's config and metadata")
        if local_cpu_backend is None:
            raise ValueError(
                "KvtierdBackend stages stores in LMCache's CPU pool: max_local_cpu_size > 0"
            )
        if config.use_layerwise:
            raise ValueError("KvtierdBackend stores whole chunks; use_layerwise is not supported")
        extra = config.extra_config or {}
        self._socket: str | None = extra.get("kvtierd.socket")
        self._tenant = str(extra.get("kvtierd.tenant", "default"))
        self._zero_copy = not config.local_cpu
        self._chunk_tokens = int(config.chunk_size)
        self._hash_algorithm = str(config.pre_caching_hash_algorithm)
        self._shapes = list(metadata.get_shapes(self._chunk_tokens))
        self._dtypes = list(metadata.get_dtypes())
        self._fmt = MemoryFormat.KV_MLA_FMT if metadata.use_mla else MemoryFormat.KV_2LTD
        self._chunk_bytes = sum(
            s.numel() * d.itemsize for s, d in zip(self._shapes, self._dtypes, strict=True)
        )
        self._link = EngineLink(
            self._socket, client_name="kvtierd-lmcache", tenant=self._tenant, log=log
        )
        #: Guards ``_states`` and ``_counts``; held across no request.
        self._lock = threading.Lock()
        #: What the backend keeps with each of the link's sessions (its pins are its
        #: connection's leases), gone with the session.
        self._states: weakref.WeakKeyDictionary[Session, _Session] = weakref.WeakKeyDictionary()
        self._counts = dict.fromkeys(BackendStatistics.__slots__, 0)

    def __str__(self) -> str:
        return "KvtierdBackend"

    # -- connection --------------------------------------------------------------------------

    def _call(self, what: str, fn: Callable[[_Session], T], miss: T) -> T:
        """``fn(session)`` through the link (once more on a new connection if the connection
        was lost under it); ``miss`` (logged, counted) if the daemon cannot serve it or the
        backend is closed."""
        return self._link.call(what, lambda session: fn(self._session_of(session)), miss)

    def _session_of(self, link_session: Session) -> _Session:
        """What the backend keeps with ``link_session``, anew for each connection."""
        with self._lock:
            state = self._states.get(link_session)
            if state is None:
                state = self._states[link_session] = _Session(link_session, self._chunk_bytes)
            return state

    def _count(self, counter: str, n: int = 1) -> None:
        with self._lock:  # LMCache's threads count at once
            self._counts[counter] += n

    def namespace_spec(self, key: Any) -> NamespaceSpec:
        """The kvtierd namespace that holds ``key`` (a ``CacheEngineKey``)."""
        return namespace_spec(
            model_name=key.model_name,
            world_size=key.world_size,
            worker_id=key.worker_id,
            dtype=key.dtype,
            tags=key.tags,
            kv_shape=self.metadata.kv_shape,
            chunk_tokens=self._chunk_tokens,
            chunk_bytes=self._chunk_bytes,
            hash_algorithm=self._hash_algorithm,
            single_group=len(self._shapes) == 1,
        )

    def _namespace(self, session: _Session, key: Any) -> Namespace:
        ident = (key.model_name, key.world_size, key.worker_id, key.dtype, key.tags)
        return session.namespace(ident, lambda: self.namespace_spec(key))

    def _runs(self, session: _Session, keys: Sequence[Any]) -> list[tuple[Namespace, list[int]]]:
        """Consecutive runs of ``keys`` (by index) that share a namespace, in order."""
        runs: list[tuple[Namespace, list[int]]] = []
        for i, key in enumerate(keys):
            ns = self._namespace(session, key)
            if runs and runs[-1][0] is ns:
                runs[-1][1].append(i)
            else:
                runs.append((ns, [i]))
        return runs

    # -- lookups -----------------------------------------------------------------------------

    def batched_contains(self, keys: list[Any], pin: bool = False) -> int:
        """kvtierd's LOOKUP: how many leading ``keys`` are stored (for the whole TP group);
        starts promoting them into DRAM. With ``pin`` (LMCache's engine pins what its lookup
        found until it has retrieved it) the hits already in DRAM are leased at once
        (READ_RESIDENT), so retrieving them needs no READ."""
        self._count("lookups")

        pin = pin and self._zero_copy  # copied-out reads would not use a pin's lease

        def lookup(session: _Session) -> int:
            hits = 0
            pinned: list[Any] = []
            try:
                for ns, idx in self._runs(session, keys):
                    block_keys = [block_key(keys[i].chunk_hash) for i in idx]
                    found = ns.lookup(block_keys)
                    if pin and found:
                        pinned += self._pin(session, ns, block_keys[:found])
                    hits += found
                    if found < len(idx):
                        break
            except BaseException:  # answered as a miss: LMCache will not unpin these
                session.pins.undo(pinned)
                raise
            return hits

        return self._call("lookup", lookup, 0) if keys else 0

    def _pin(self, session: _Session, ns: Namespace, keys: list[bytes]) -> list[Any]:
        """One pin per hit (:mod:`kvtierd.engines.lmcache_pins`): the leading ones in DRAM
        leased at once (READ_RESIDENT) within the pin budget, the others empty."""
        reserved = session.pins.reserve(len(keys))
        lease = None
        if reserved:
            try:
                lease = ns.acquire(keys[:reserved], resident_only=True)
            except BaseException:
                session.pins.unreserve(reserved)
                raise
            try:
                self._require_chunks(lease.extents, lease.release)
            except RemoteProtocolError:
                session.pins.unreserve(reserved)
                raise
        return session.pins.add(ns.handle.ns, keys, lease, reserved)

    def contains(self, key: Any, pin: bool = False) -> bool:
        return self.batched_contains([key], pin) == 1

    async def batched_async_contains(
        self, lookup_id: str, keys: list[Any], pin: bool = False
    ) -> int:
        return await asyncio.to_thread(self.batched_contains, keys, pin)

    def exists_in_put_tasks(self, key: Any) -> bool:
        return False  # stores complete before batched_submit_put_task returns

    def pin(self, key: Any) -> bool:
        return self.contains(key, pin=True)

    def unpin(self, key: Any) -> bool:
        """Let go of one pin of ``key``; a key this backend holds no pin for (it was on NVMe at
        lookup, or the connection was re-established since) needs nothing."""
        current = self._link.current()
        with self._lock:
            session = self._states.get(current) if current is not None else None
        if session is None:
            return True
        ident = (key.model_name, key.world_size, key.worker_id, key.dtype, key.tags)
        ns = session.link.opened(ident)
        if ns is not None:
            session.pins.unpin(ns.handle.ns, block_key(key.chunk_hash))
        return True

    def touch_cache(self) -> None:
        """kvtierd's policy learns from LOOKUP and READ themselves."""

    # -- stores ------------------------------------------------------------------------------

    def batched_submit_put_task(
        self,
        keys: Sequence[Any],
        objs: list[Any],
        transfer_spec: Any = None,
        on_complete_callback: Callable[[Any], None] | None = None,
    ) -> None:
        """Store every full chunk (ALLOC, copy, COMMIT) before returning."""
        full = [
            (k, o) for k, o in zip(keys, objs, strict=True) if o.get_size() == self._chunk_bytes
        ]
        self._count("partial_chunks_skipped", len(keys) - len(full))
        if not full:
            return

        def store(session: _Session) -> int:
            stored = 0
            for ns, idx in self._runs(session, [k for k, _ in full]):
                # after _runs: opening the first namespace mapped the region
                per_write = max(1, session.region_bytes // _WRITE_ARENA_SHARE // self._chunk_bytes)
                for start in range(0, len(idx), per_write):
                    batch = [full[i] for i in idx[start : start + per_write]]
                    self._store_batch(session, ns, batch)
                    stored += len(batch)
                    if on_complete_callback is not None:
                        for key, _ in batch:
                            on_complete_callback(key)
            return stored

        stored = self._call("store", store, 0)
        self._count("stored_chunks", stored)
        self._count("failed_stores", len(full) - stored)

    def _store_batch(self, session: _Session, ns: Namespace, batch: list[tuple[Any, Any]]) -> None:
        session.link.with_room(lambda: self._write(ns, batch))

    @staticmethod
    def _write(ns: Namespace, batch: list[tuple[Any, Any]]) -> None:
        with ns.write([block_key(k.chunk_hash) for k, _ in batch]) as slots:
            for view, (_, obj) in zip(slots.views, batch, strict=True):
                if view is not None:  # None: stored already
                    _copy_into(view, obj)

    async def async_batched_submit_put_task(
        self,
        keys: Sequence[Any],
        objs: list[Any],
        transfer_spec: Any = None,
        on_complete_callback: Callable[[Any], None] | None = None,
    ) -> None:
        await asyncio.to_thread(
            self.batched_submit_put_task, keys, objs, transfer_spec, on_complete_callback
        )

    # -- reads -------------------------------------------------------------------------------

    def batched_get_blocking(self, keys: list[Any]) -> list[Any]:
        """The leading stored chunks of ``keys`` as memory objects; ``None`` from the first
        missing one on."""
        result: list[Any] = [None] * len(keys)
        if not keys:
            return result

        def read(session: _Session) -> int:
            done = 0
            for ns, idx in self._runs(session, keys):
                objs = self._read_run(session, ns, [block_key(keys[i].chunk_hash) for i in idx])
                result[done : done + len(objs)] = objs
                done += len(objs)
                if len(objs) < len(idx):
                    break
            return done

        self._count("read_chunks", self._call("read", read, 0))
        return result

    def _read_run(self, session: _Session, ns: Namespace, keys: list[bytes]) -> list[Any]:
        """The leading stored blocks of ``keys`` as memory objects: first those a lookup pinned
        (no request), then the rest by READ. At most half the arena is leased for zero-copy
        objects per call; beyond that, blocks are copied into LMCache's CPU pool a batch at a
        time, so a read larger than the arena still completes."""
        arena_blocks = max(1, session.region_bytes // self._chunk_bytes)
        lease_budget = arena_blocks // 2 if self._zero_copy else 0
        objs: list[Any] = self._pinned_objects(session, ns, keys) if self._zero_copy else []
        # pins hold part of that half already: READs lease the rest of it, copies beyond
        lease_budget = len(objs) + max(0, lease_budget - session.pins.held_blocks)
        while len(objs) < len(keys):
            zero_copy = len(objs) < lease_budget
            step = lease_budget - len(objs) if zero_copy else max(1, arena_blocks // 8)
            batch = keys[len(objs) : len(objs) + step]
            got = self._read_batch(session, ns, batch, zero_copy)
            objs += got
            if len(got) < len(batch):
                break
        return objs

    def _pinned_objects(self, session: _Session, ns: Namespace, keys: list[bytes]) -> list[Any]:
        """Memory objects for the leading ``keys`` a lookup pinned: each holds its lease until
        LMCache frees it, whether or not the pin is undone first. None once the daemon has
        closed the connection: it released the leases then, and may reuse their slots."""
        if not session.client.connected():
            return []
        objs = [
            TensorMemoryObj(session.arena[e.offset : e.offset + e.length], self._meta(e), lease)
            for lease, e in session.pins.take(ns.handle.ns, keys)
        ]
        self._count("pinned_chunks", len(objs))
        return objs

    def _read_batch(
        self, session: _Session, ns: Namespace, keys: list[bytes], zero_copy: bool
    ) -> list[Any]:
        client = session.client
        try:  # zero-copy objects are hashed here; copies are hashed as they are made
            leases, extents = self._lease(session, ns, keys, verify=zero_copy)
        except BlockNotFoundError:  # gone since LOOKUP: read the prefix that is still there
            present = ns.lookup(keys)
            if not present:
                return []
            try:
                leases, extents = self._lease(session, ns, keys[:present], verify=zero_copy)
            except BlockNotFoundError:
                return []
        except NoSpaceError:  # the arena is full of leases: a shorter hit, not a failure
            log.debug("kvtierd arena full of leases; %d blocks answered as misses", len(keys))
            return []
        self._require_chunks(extents, lambda: client.release_soon(leases))
        if zero_copy:
            owner = SharedLease(lambda: client.release_soon(leases), len(extents))
            return [
                TensorMemoryObj(session.arena[e.offset : e.offset + e.length], self._meta(e), owner)
                for e in extents
            ]
        objs: list[Any] = []
        try:  # copied into LMCache's pool, so the lease ends now
            for e in extents:
                obj = self.local_cpu_backend.allocate(
                    self._shapes,
                    self._dtypes,
                    self._fmt,
                    eviction=not self._zero_copy,
                    busy_loop=False,
                )
                if obj is None:
                    break
                # One pass: the copy into LMCache's pool is hashed as it is made; a block that
                # fails (changed after COMMIT) ends the hit there, as the lease's check would.
                target = _raw_bytes(obj).numpy().data
                if not copy_verified(ns.arena.view(e.offset, e.length), [target], e.checksum):
                    client.corrupt_reads += 1
                    obj.ref_count_down()  # back to LMCache's allocator, never served
                    break
                objs.append(obj)
        finally:
            client.run(ops.release(leases))
        return objs

    def _require_chunks(self, extents: Sequence[Extent], release: Callable[[], object]) -> None:
        """Blocks of another size than a chunk mean a daemon serving other data: give the lease
        back and fail."""
        if any(e.length != self._chunk_bytes for e in extents):
            release()
            raise RemoteProtocolError(
                f"the daemon answered blocks that are not {self._chunk_bytes} bytes"
            )

    @staticmethod
    def _lease(
        session: _Session, ns: Namespace, keys: list[bytes], *, verify: bool = True
    ) -> tuple[list[int], list[Extent]]:
        """READ ``keys``. A READ that finds every free slot awaiting write-back (``ENOSPC``)
        is retried once after FSYNC has made those slots clean, so evictable. With ``verify``
        the leased blocks are hashed now (zero-copy objects: LMCache's own copy moves them,
        which kvtierd cannot hash); without, the caller verifies each copy it makes."""
        client = session.client
        leases, extents = session.link.with_room(
            lambda: client.run(ops.read(ns.handle.ns, keys, client.max_keys))
        )
        if not verify:
            return leases, extents
        # Verified like the library's own reads: a block that fails its checksum ends the hit
        good = verified_prefix([ns.arena.view(e.offset, e.length) for e in extents], extents)
        if good < len(extents):
            client.corrupt_reads += 1
        return leases, extents[:good]

    def _meta(self, extent: Extent) -> Any:
        return MemoryObjMetadata(
            shape=self._shapes[0],
            dtype=self._dtypes[0],
            address=extent.offset,
            phy_size=extent.length,
            ref_count=1,
            fmt=self._fmt,
            shapes=list(self._shapes),
            dtypes=list(self._dtypes),
        )

    def get_blocking(self, key: Any) -> Any:
        return self.batched_get_blocking([key])[0]

    def get_non_blocking(self, key: Any, location: str | None = None) -> Future[Any] | None:
        future: Future[Any] = Future()
        future.set_result(self.get_blocking(key))
        return future

    async def batched_get_non_blocking(
        self, lookup_id: str, keys: list[Any], transfer_spec: Any = None
    ) -> list[Any]:
        objs = await asyncio.to_thread(self.batched_get_blocking, keys)
        return [obj for obj in objs if obj is not None]

    # -- removal and life cycle ---------------------------------------------------------------

    def batched_remove(self, keys: list[Any], force: bool = True) -> int:
        def forget(session: _Session) -> int:
            return sum(
                ns.forget([block_key(keys[i].chunk_hash) for i in idx])
                for ns, idx in self._runs(session, keys)
            )

        return self._call("forget", forget, 0) if keys else 0

    def remove(self, key: Any, force: bool = True) -> bool:
        return self.batched_remove([key], force) == 1

    def get_allocator_backend(self) -> Any:
        return self.local_cpu_backend

    def statistics(self) -> BackendStatistics:
        with self._lock:
            counts = dict(self._counts, errors=self._link.failures)
        return BackendStatistics(**counts)

    def close(self) -> None:
        """Close the connection (after the request in progress, if any) and unmap the region;
        idempotent. Every later call is answered as a miss or a refused store."""
        self._link.close()


def _raw_bytes(obj: Any) -> torch.Tensor:
    """The bytes of a memory object (every layer group) as a flat uint8 tensor."""
    raw: torch.Tensor = obj.raw_tensor
    return raw.reshape(-1).view(torch.uint8)[: obj.get_size()]


def _copy_into(view: memoryview, obj: Any) -> None:
    torch.frombuffer(view, dtype=torch.uint8).copy_(_raw_bytes(obj))
