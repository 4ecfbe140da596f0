"""kvtierd as SGLang HiCache's L3 storage: a ``HiCacheStorage`` SGLang loads by name.

Start SGLang with::

    --hicache-storage-backend dynamic --hicache-storage-backend-extra-config \\
      '{"backend_name": "kvtierd", "module_path": "kvtierd.engines.sglang",
        "class_name": "KvtierdHiCacheStorage", "interface_v1": 1}'

optionally with ``"socket"`` (kvtierd's socket; else its default) and ``"tenant"`` (the kvtierd
tenant; default ``"default"``). SGLang's factory builds a dynamic backend as
``cls(storage_config, kwargs)`` and then calls ``register_mem_pool_host``.

Theory of operation
-------------------
*Keys* come from :mod:`kvtierd.engines.sglang_keys`: the rank's identity goes into the
namespace, the tenant's ``cache_salt`` and SGLang's page hash into the key.

*Pages.* A page is the host pool's flat data page (``get_data_page(index)``): K and V of every
layer of ``page_size`` tokens, in the pool's layout, so the legacy ``batch_get``/``batch_set``
(tensors) and the ``_v1`` calls (host-pool indices, used when ``interface_v1`` is set) store the
same bytes. ``batch_get_v1`` leases the leading hits in the arena and copies each straight into
its host-pool page (one copy, into the page's contiguous runs, hashed as it is copied: a page
changed after COMMIT is a miss, found in the one pass over memory that loads it);
``batch_set_v1`` ALLOCs arena slots, copies each host page into its slot and COMMITs (the
two-phase write: a page is visible at COMMIT or never). A full arena (``ENOSPC``) is answered
by FSYNC, which makes written blocks evictable, and one retry.

*Lookups.* ``batch_exists`` is one LOOKUP: the leading pages present in any tier; it also starts
promoting the NVMe hits into DRAM, so the prefetch that follows finds them there.

*Hybrid models.* The ``_v2`` calls move the pages of every pool SGLang registers with
``register_mem_host_pool_v2`` (Mamba states, sliding-window and indexer pages): each pool has a
namespace of its own, the KV pool the ``_v1`` calls' one. ``batch_exists_v2`` is one LOOKUP for
the KV pages and one per pool (asking for every key where a pool keeps only trailing windows),
and answers the longest prefix every pool allows (:mod:`kvtierd.engines.sglang_hits`: all or
nothing). A pool's pages are copied with the pool's own page calls, verified as they leave the
arena. A pool that cannot be served is refused at registration.

*Failures.* SGLang's prefetch and backup threads die on an exception from a backend and treat
``None`` from a ``_v1`` call as garbage, so neither reaches them: every ``KvtierError`` (daemon
gone, restarted, out of space, a namespace the restarted daemon salts otherwise) is logged,
counted in :meth:`KvtierdHiCacheStorage.statistics` and answered as a miss (``False``, 0, or
``None`` for one ``get``, which is that call's contract). The daemon is reached through an
:class:`~kvtierd.engines.link.EngineLink`: a lost connection is dropped and made again (once
within the call, else on the next), so a restarted daemon serves what its NVMe tier kept.
Bad arguments this module checks (not a contiguous CPU tensor, not one value per key, a
``_v1`` call before ``register_mem_pool_host``, an unregistered pool, host indices that do not
match a transfer's keys, a hit policy other than SGLang's two) are SGLang's bug and raise.

*Threads.* SGLang calls from its prefetch, backup and scheduler threads; the kvtierd client takes
their requests in turns. This module's lock guards the counters; the link opens the session and
each namespace once, which every caller waits for anyway.

The module is past 600 lines because SGLang loads one class by name and calls its whole
interface on it (the tensor, ``_v1`` and ``_v2`` calls share the host pools, the namespaces
and the link); what is pure is apart (keys in :mod:`~kvtierd.engines.sglang_keys`, the hybrid
hit rule in :mod:`~kvtierd.engines.sglang_hits`, page runs in
:mod:`~kvtierd.engines.host_runs`).
"""

from __future__ import annotations

import logging
import threading
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, PoolTransferResult

from kvtierd.client import Client, Namespace
from kvtierd.engines.host_runs import HostRuns
from kvtierd.engines.link import EngineLink, NamespaceSpec, Session
from kvtierd.engines.sglang_hits import (
    ALL_PAGES,
    PoolHits,
    hit_policy,
    pool_hits,
    usable_prefix,
)
from kvtierd.engines.sglang_keys import (
    KV_POOL,
    StorageIdentity,
    cache_salt_of,
    identity_of,
    namespace_name,
    page_key,
)
from kvtierd.errors import (
    BlockNotFoundError,
    CorruptBlockError,
    InvalidRequestError,
)

__all__ = ["KvtierdHiCacheStorage", "StorageStatistics"]

log = logging.getLogger("kvtierd.engines.sglang")
#: The host-pool layouts whose pages ``HostKVCache.get_data_page`` addresses.
_PAGE_LAYOUTS = ("layer_first", "page_first", "page_first_direct", "page_head")
#: SGLang's page calls on a host pool, which the ``_v2`` calls move pages of other pools with.
_PAGE_CALLS = ("get_data_page", "get_dummy_flat_data_page", "set_from_flat_data_page")
#: Pools of SGLang's ``PoolName`` not served: DeepSeek V4's compressed pools go with the
#: ``block_groups`` hit policy, which none of SGLang 0.5.23's own backends serves either.
_UNSERVED_POOL_PREFIX = "deepseek_v4_"


@dataclass(frozen=True, slots=True)
class _Pool:
    """A host pool the ``_v2`` calls move pages of (``register_mem_host_pool_v2``)."""

    name: str
    host: Any
    page_bytes: int  # one flat page (``get_dummy_flat_data_page``), taken once
    page_shape: tuple[int, ...]  # ... and its shape and dtype, which the pool's page copy takes
    page_dtype: torch.dtype
    page_size: int  # tokens per page: ``host_indices`` holds this many per key
    namespace: str  # its namespace's name, checked at registration


@dataclass(frozen=True, slots=True)
class StorageStatistics:
    """Counters of one backend since it was created, and the daemon's per-tier figures."""

    pages_read: int
    pages_missed: int
    pages_written: int
    errors: int
    tiers: tuple[dict[str, Any], ...]


class KvtierdHiCacheStorage(HiCacheStorage):  # type: ignore[misc]
    """SGLang's L3 storage on a kvtierd daemon (see the module docstring)."""

    def __init__(self, storage_config: Any, kwargs: dict[str, Any] | None = None) -> None:
        extra = dict(storage_config.extra_config or {})
        self.storage_config = storage_config
        self.identity: StorageIdentity = identity_of(storage_config)
        self.socket_path: str | None = extra.get("socket") or (kwargs or {}).get("socket")
        self.tenant = str(extra.get("tenant", "default"))
        self.mem_pool_host: Any = None
        self._pool_page_bytes = 0  # a host-pool page's bytes, taken once at registration
        self._page_runs = HostRuns()  # the host pool's pages as byte runs
        self._lock = threading.Lock()
        self._link = EngineLink(
            self.socket_path, client_name="kvtierd-sglang", tenant=self.tenant, log=log
        )
        self._read = self._missed = self._written = 0
        self._pools: dict[str, _Pool] = {}
        namespace_name(self.identity, layout="layer_first", dtype="bfloat16")  # fails early

    # -- session ---------------------------------------------------------------------------

    def _namespace(
        self, session: Session, layout: str, dtype: torch.dtype, block_bytes: int
    ) -> Namespace:
        dtype_str = str(dtype).removeprefix("torch.")
        name = namespace_name(self.identity, layout=layout, dtype=dtype_str)
        return session.namespace(NamespaceSpec(name, block_bytes=block_bytes))

    def _page_namespace(self, session: Session, first: torch.Tensor) -> Namespace:
        """The namespace of pages like ``first`` (the tensor calls')."""
        block_bytes = first.numel() * first.element_size()
        return self._namespace(session, self._layout(), first.dtype, block_bytes)

    def _layout(self) -> str:
        if self.mem_pool_host is not None:
            return str(self.mem_pool_host.layout)
        return "page_first" if self.identity.page_first else "layer_first"

    def _keys(self, keys: Sequence[str], extra_info: Any = None) -> list[bytes]:
        salt = cache_salt_of(extra_info)
        return [page_key(k, salt) for k in keys]

    def _count(self, read: int = 0, missed: int = 0, written: int = 0) -> None:
        with self._lock:
            self._read += read
            self._missed += missed
            self._written += written

    # -- the host pool -----------------------------------------------------------------------

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """Keep SGLang's host pool for the ``_v1`` calls. A layout whose pages
        ``get_data_page`` cannot address, or a namespace name past kvtierd's bound (a long
        model name), raises ``ValueError`` here, when SGLang attaches the backend, not later in
        its prefetch thread."""
        layout = str(getattr(mem_pool_host, "layout", ""))
        if layout not in _PAGE_LAYOUTS:
            raise ValueError(
                f"kvtierd's SGLang backend moves pages of the host layouts {_PAGE_LAYOUTS}, "
                f"not {layout!r} (--hicache-mem-layout)"
            )
        # Sized once: the pool's dummy page is a fresh zeroed tensor on every call (0.3-19 ms
        # under load here, up to a third of a warm batch_get_v1 of 64 pages).
        page = mem_pool_host.get_dummy_flat_data_page()
        dtype = str(mem_pool_host.dtype).removeprefix("torch.")
        namespace_name(self.identity, layout=layout, dtype=dtype)  # ValueError now, not later
        self._pool_page_bytes = page.numel() * page.element_size()
        self.mem_pool_host = mem_pool_host

    def _require_pool(self) -> None:
        """SGLang's bug, raised: a ``_v1`` call before the host pool was registered."""
        if self.mem_pool_host is None:
            raise InvalidRequestError("the _v1 calls need register_mem_pool_host first")

    def _pool_namespace(self, session: Session) -> Namespace:
        """The host pool's namespace on ``session``."""
        self._require_pool()
        pool = self.mem_pool_host
        return self._namespace(session, self._layout(), pool.dtype, self._pool_page_bytes)

    def _host_pages(self, host_indices: torch.Tensor, count: int) -> list[torch.Tensor]:
        pool = self.mem_pool_host
        step = int(pool.page_size)
        return [pool.get_data_page(int(host_indices[i * step]), flat=False) for i in range(count)]

    def batch_get_v1(
        self, keys: list[str], host_indices: torch.Tensor, extra_info: Any = None
    ) -> list[bool]:
        """Load the leading stored pages into the host pool at ``host_indices``: ``True`` per
        page loaded, ``False`` from the first page that was not."""
        self._require_pool()
        block_keys = self._keys(keys, extra_info)

        def load(session: Session) -> int:
            ns = self._pool_namespace(session)
            try:  # SGLang asked batch_exists first: all hits is the usual case, one READ
                return self._load_pages(ns, block_keys, host_indices)
            except BlockNotFoundError:
                hits = ns.lookup(block_keys)
            try:
                return self._load_pages(ns, block_keys[:hits], host_indices) if hits else 0
            except BlockNotFoundError:  # gone since the lookup: counted as a miss
                return 0

        loaded = self._link.call("batch_get_v1", load, 0)
        self._count(read=loaded, missed=len(keys) - loaded)
        return [True] * loaded + [False] * (len(keys) - loaded)

    def _load_pages(self, ns: Namespace, keys: list[bytes], host_indices: torch.Tensor) -> int:
        """Lease ``keys`` (all stored, else ``BlockNotFoundError``) and copy each block into
        its host-pool page, verified in the pass that copies it (the page's contiguous runs
        filled in order); returns how many: the pages before the first block that failed its
        checksum (changed after COMMIT), which is a miss, like those after it."""
        pages = self._host_pages(host_indices, len(keys))
        with ns.lease(keys, verify_on_copy=True) as lease, warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*not writable.*")
            for i, page in enumerate(pages):
                try:
                    lease.copy_into(i, self._page_runs.byte_runs(page))
                except CorruptBlockError as exc:
                    log.warning("kvtierd batch_get_v1: %s", exc)
                    ns.client.corrupt_reads += 1
                    return i
        return len(keys)

    def batch_set_v1(
        self, keys: list[str], host_indices: torch.Tensor, extra_info: Any = None
    ) -> list[bool]:
        """Store the host pool's pages at ``host_indices`` (one ALLOC, copy, COMMIT; pages
        already stored are skipped): all ``True``, or all ``False`` if the write failed."""
        self._require_pool()
        block_keys = self._keys(keys, extra_info)

        def store(session: Session) -> bool:
            ns = self._pool_namespace(session)
            pages = self._host_pages(host_indices, len(keys))
            session.with_room(lambda: self._write_pages(ns, block_keys, pages))
            return True

        ok = self._link.call("batch_set_v1", store, False)
        self._count(written=len(keys) if ok else 0)
        return [ok] * len(keys)

    def _write_pages(self, ns: Namespace, keys: list[bytes], pages: list[torch.Tensor]) -> None:
        with ns.write(keys) as block:
            for slot, page in zip(block.views, pages, strict=True):
                if slot is not None:
                    dst = torch.frombuffer(slot, dtype=torch.uint8).view(page.dtype)
                    dst.view(page.shape).copy_(page)

    # -- the v2 calls: a hybrid model's pools ------------------------------------------------

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        """Keep one of a hybrid model's host pools (the KV anchor, Mamba, sliding-window,
        indexer, draft...) for the ``_v2`` calls: its pages go to a namespace of their own.
        A pool this backend cannot serve raises ``ValueError`` here, when SGLang attaches the
        backend, not in its prefetch thread: DeepSeek V4's compressed pools, a host pool
        without SGLang's page calls, a namespace name past kvtierd's bound."""
        name = _pool_name(host_pool_name)
        if name.startswith(_UNSERVED_POOL_PREFIX):
            raise ValueError(
                f"kvtierd's SGLang backend does not serve the pool {name!r}: DeepSeek V4's "
                "compressed pools need the 'block_groups' hit policy, which it does not "
                "implement (nor do SGLang's own backends); run DeepSeek V4 without "
                "--hicache-storage-backend kvtierd"
            )
        lacking = [call for call in _PAGE_CALLS if not callable(getattr(host_pool, call, None))]
        if lacking:
            raise ValueError(
                f"kvtierd's SGLang backend moves a pool's pages with SGLang's page calls; the "
                f"host pool of {name!r} ({type(host_pool).__name__}) lacks {', '.join(lacking)}"
            )
        page = host_pool.get_dummy_flat_data_page()
        layout = str(getattr(host_pool, "layout", "flat"))
        dtype = str(getattr(host_pool, "dtype", page.dtype)).removeprefix("torch.")
        self._pools[name] = _Pool(
            name=name,
            host=host_pool,
            page_bytes=page.numel() * page.element_size(),
            page_shape=tuple(page.shape),
            page_dtype=page.dtype,
            page_size=int(getattr(host_pool, "page_size", 1) or 1),
            # ValueError here, at attach, for a name past kvtierd's bound (a long model name)
            namespace=namespace_name(self.identity, layout=layout, dtype=dtype, pool=name),
        )
        super().register_mem_host_pool_v2(host_pool, host_pool_name)

    def _v2_pool(self, transfer: Any) -> _Pool:
        """The registered pool ``transfer`` names; SGLang's bug, raised: an unregistered one."""
        name = _pool_name(transfer.name)
        pool = self._pools.get(name)
        if pool is None:
            raise InvalidRequestError(
                f"pool {name!r} was not registered (register_mem_host_pool_v2)"
            )
        return pool

    def _is_anchor(self, pool: _Pool) -> bool:
        """``pool`` is the host pool of the ``_v1`` calls: its pages are those calls' pages."""
        return pool.host is self.mem_pool_host

    def _v2_namespace(self, session: Session, pool: _Pool) -> Namespace:
        if self._is_anchor(pool):
            return self._pool_namespace(session)
        return session.namespace(NamespaceSpec(pool.namespace, block_bytes=pool.page_bytes))

    def batch_exists_v2(
        self, keys: list[str], pool_transfers: Any = None, extra_info: Any = None
    ) -> PoolTransferResult:
        """The longest prefix of ``keys`` whose KV pages and the pages of every pool in
        ``pool_transfers`` (by each one's hit policy) are stored: all or nothing
        (:mod:`kvtierd.engines.sglang_hits`). One LOOKUP for the KV pages and one per pool,
        which also start promoting the NVMe hits."""
        transfers = [(t, self._v2_pool(t), hit_policy(t.hit_policy)) for t in pool_transfers or ()]
        block_keys = self._keys(keys, extra_info)

        def look(session: Session) -> tuple[int, dict[str, PoolHits]]:
            kv_pages = self._kv_pages(session, block_keys)
            verdicts: dict[str, PoolHits] = {}
            for transfer, pool, policy in transfers:
                if not usable_prefix(kv_pages, verdicts.values())[0]:
                    break  # nothing left to restore: the other pools are not asked
                span = block_keys[:kv_pages]
                ns = self._v2_namespace(session, pool)
                if policy == ALL_PAGES:
                    hits = ns.lookup(span)
                    present = [i < hits for i in range(kv_pages)]
                else:
                    present = ns.present(span)
                window = len(transfer.keys) if transfer.keys else 1
                verdicts[transfer.name] = pool_hits(policy, present, window)
            return kv_pages, verdicts

        nothing: tuple[int, dict[str, PoolHits]] = (0, {})
        kv_pages, verdicts = self._link.call("batch_exists_v2", look, nothing)
        final, restorable = usable_prefix(kv_pages, verdicts.values())
        hit_pages = {KV_POOL: kv_pages} if kv_pages else {}
        hit_pages.update({name: v.boundary for name, v in verdicts.items() if v.boundary})
        return PoolTransferResult(final, hit_pages, restorable)

    def _kv_pages(self, session: Session, block_keys: list[bytes]) -> int:
        """How many leading KV pages are stored; all of them for a logical anchor (an anchor
        pool without KV, whose prefix the other pools decide alone)."""
        if self.mem_pool_host is not None and getattr(self.mem_pool_host, "kv_buffer", 0) is None:
            return len(block_keys)
        ns = self._any_namespace(session)
        return ns.lookup(block_keys) if ns is not None and block_keys else 0

    def batch_get_v2(self, transfers: list[Any], extra_info: Any = None) -> dict[str, list[bool]]:
        """Load each transfer's stored pages into its pool at its ``host_indices``: per pool,
        ``True`` per page loaded, ``False`` from the first page that was not."""
        return {t.name: self._pool_io(t, extra_info, write=False) for t in transfers}

    def batch_set_v2(self, transfers: list[Any], extra_info: Any = None) -> dict[str, list[bool]]:
        """Store each transfer's pages (its pool's pages at its ``host_indices``) under its
        keys in the pool's namespace: per pool, all ``True`` or all ``False``."""
        return {t.name: self._pool_io(t, extra_info, write=True) for t in transfers}

    def _pool_io(self, transfer: Any, extra_info: Any, *, write: bool) -> list[bool]:
        pool = self._v2_pool(transfer)
        keys = list(transfer.keys or ())
        host_indices = transfer.host_indices
        if host_indices is None or int(host_indices.numel()) != len(keys) * pool.page_size:
            got = 0 if host_indices is None else int(host_indices.numel())
            raise InvalidRequestError(
                f"pool {pool.name!r}: {len(keys)} keys of {pool.page_size} tokens need "
                f"{len(keys) * pool.page_size} host indices, not {got}"
            )
        if self._is_anchor(pool):
            if write:
                return self.batch_set_v1(keys, host_indices, extra_info)
            return self.batch_get_v1(keys, host_indices, extra_info)
        offsets = [int(host_indices[i * pool.page_size]) for i in range(len(keys))]
        block_keys = self._keys(keys, extra_info)
        if write:
            return self._store_pool_pages(pool, block_keys, offsets)
        return self._load_pool_pages(pool, block_keys, offsets)

    def _load_pool_pages(
        self, pool: _Pool, block_keys: list[bytes], offsets: list[int]
    ) -> list[bool]:
        def load(session: Session) -> int:
            ns = self._v2_namespace(session, pool)
            hits = len(block_keys)
            for _ in range(2):  # all hits is the usual case; else the leading ones, once
                try:
                    return self._copy_into_pool(ns, pool, block_keys[:hits], offsets) if hits else 0
                except BlockNotFoundError:
                    hits = ns.lookup(block_keys)
            return 0  # gone since the lookup: counted as a miss

        loaded = self._link.call("batch_get_v2", load, 0)
        self._count(read=loaded, missed=len(block_keys) - loaded)
        return [True] * loaded + [False] * (len(block_keys) - loaded)

    def _copy_into_pool(
        self, ns: Namespace, pool: _Pool, keys: list[bytes], offsets: list[int]
    ) -> int:
        """Lease ``keys`` and hand each block to the pool's own page copy
        (``set_from_flat_data_page``), verified as it is copied out of the arena; returns how
        many: the pages before the first that failed its checksum, which is a miss. One
        scratch page serves every block: the pool's page call copies out of it."""
        flat = torch.empty(pool.page_shape, dtype=pool.page_dtype)
        with ns.lease(keys, verify_on_copy=True) as lease:
            for i, offset in enumerate(offsets[: len(keys)]):
                try:
                    lease.copy_into(i, flat.view(torch.uint8).numpy())
                except CorruptBlockError as exc:
                    log.warning("kvtierd batch_get_v2 (%s): %s", pool.name, exc)
                    ns.client.corrupt_reads += 1
                    return i
                pool.host.set_from_flat_data_page(offset, flat)
        return len(keys)

    def _store_pool_pages(
        self, pool: _Pool, block_keys: list[bytes], offsets: list[int]
    ) -> list[bool]:
        def store(session: Session) -> bool:
            ns = self._v2_namespace(session, pool)
            pages = [pool.host.get_data_page(offset, flat=True) for offset in offsets]
            for page in pages:
                if page.numel() * page.element_size() != pool.page_bytes:
                    raise InvalidRequestError(
                        f"pool {pool.name!r} gave a page of {page.numel() * page.element_size()}"
                        f" bytes, not its {pool.page_bytes}"
                    )
            session.with_room(lambda: self._write_pages(ns, block_keys, pages))
            return True

        ok = self._link.call("batch_set_v2", store, False)
        self._count(written=len(block_keys) if ok else 0)
        return [ok] * len(block_keys)

    # -- the tensor calls --------------------------------------------------------------------

    def get(
        self, key: str, target_location: Any = None, target_sizes: Any = None
    ) -> torch.Tensor | None:
        """Read page ``key`` into ``target_location`` (a CPU tensor of one page; without one, a
        new page of the registered host pool): the tensor, or ``None`` if not stored."""
        targets = None if target_location is None else [target_location]
        return self.batch_get([key], targets)[0]

    def batch_get(
        self, keys: list[str], target_locations: Any = None, target_sizes: Any = None
    ) -> list[torch.Tensor | None]:
        """Read the leading stored pages into ``target_locations``: one tensor per page read,
        ``None`` from the first page that was not."""
        if target_locations is None:
            if self.mem_pool_host is None:
                raise InvalidRequestError("batch_get needs target_locations or a host pool")
            target_locations = [self.mem_pool_host.get_dummy_flat_data_page() for _ in keys]
        targets = [_as_contiguous_cpu(t) for t in target_locations]
        block_keys = self._keys(keys)

        def read(session: Session) -> int:
            if not targets:
                return 0
            ns = self._page_namespace(session, targets[0])
            buffers = [t.view(torch.uint8).numpy() for t in targets]
            try:  # all hits is the usual case: one READ
                ns.read_into(block_keys, buffers)
                return len(block_keys)
            except BlockNotFoundError:
                hits = ns.lookup(block_keys)
            try:
                if hits:
                    ns.read_into(block_keys[:hits], buffers[:hits])
                return hits
            except BlockNotFoundError:  # gone since the lookup: counted as a miss
                return 0

        hits = self._link.call("batch_get", read, 0)
        self._count(read=hits, missed=len(keys) - hits)
        return [*targets[:hits], *([None] * (len(keys) - hits))]

    def set(
        self,
        key: str,
        value: Any = None,
        target_location: Any = None,
        target_sizes: Any = None,
    ) -> bool:
        return self.batch_set([key], [value])

    def batch_set(
        self,
        keys: list[str],
        values: Any = None,
        target_locations: Any = None,
        target_sizes: Any = None,
    ) -> bool:
        """Store ``values[i]`` (CPU tensors of one page each, of one size) under ``keys[i]``."""
        if values is None or len(values) != len(keys):
            raise InvalidRequestError("batch_set needs one value per key")
        pages = [_as_contiguous_cpu(v) for v in values]
        block_keys = self._keys(keys)

        def store(session: Session) -> bool:
            if not pages:
                return True
            ns = self._page_namespace(session, pages[0])
            blocks = [p.view(torch.uint8).numpy() for p in pages]
            session.with_room(lambda: ns.put(block_keys, blocks))
            return True

        ok = self._link.call("batch_set", store, False)
        self._count(written=len(keys) if ok else 0)
        return ok

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    def batch_exists(self, keys: list[str], extra_info: Any = None) -> int:
        """How many leading pages are stored (one LOOKUP; it starts promoting NVMe hits)."""
        block_keys = self._keys(keys, extra_info)

        def look(session: Session) -> int:
            ns = self._any_namespace(session)
            return ns.lookup(block_keys) if ns is not None and block_keys else 0

        return self._link.call("batch_exists", look, 0)

    def _any_namespace(self, session: Session) -> Namespace | None:
        """The namespace pages go to: the host pool's, else the one the tensor calls opened
        (``None`` before either: nothing can be stored yet)."""
        if self.mem_pool_host is not None:
            return self._pool_namespace(session)
        opened = session.namespaces()
        return opened[0] if opened else None

    # -- housekeeping ------------------------------------------------------------------------

    def clear(self) -> None:
        """Forget every page this backend's namespaces hold."""

        def forget_all(session: Session) -> None:
            for ns in session.namespaces():
                while keys := _listed_keys(session.client, ns):
                    ns.forget(keys)

        self._link.call("clear", forget_all, None)

    def statistics(self) -> StorageStatistics:
        def tiers(session: Session) -> tuple[dict[str, Any], ...]:
            return tuple(session.client.stats().get("tiers", ()))

        no_tiers: tuple[dict[str, Any], ...] = ()
        figures = self._link.call("stats", tiers, no_tiers)
        with self._lock:
            counts = self._read, self._missed, self._written
        return StorageStatistics(*counts, self._link.failures, figures)

    def get_stats(self) -> Any:
        """SGLang's ``StorageMetrics`` with ``.kvtierd`` (:meth:`statistics`) attached, or the
        statistics alone where SGLang's metrics module cannot be imported."""
        figures = self.statistics()
        try:
            from sglang.srt.observability.metrics_collector import StorageMetrics
        except ImportError:
            return figures
        metrics = StorageMetrics()
        metrics.kvtierd = figures
        return metrics

    def close(self) -> None:
        self._link.close()


def _pool_name(name: Any) -> str:
    """SGLang's ``PoolName`` (a ``str`` enum) or a plain name, as its value."""
    return str(getattr(name, "value", name))


def _as_contiguous_cpu(tensor: Any) -> torch.Tensor:
    if not isinstance(tensor, torch.Tensor) or tensor.device.type != "cpu":
        raise InvalidRequestError("kvtierd's SGLang backend takes CPU tensors")
    if not tensor.is_contiguous():
        raise InvalidRequestError("kvtierd's SGLang backend takes contiguous tensors")
    return tensor


def _listed_keys(client: Client, ns: Namespace) -> list[bytes]:
    reply = client.list_keys(ns.handle.ns, limit=1024)
    return [bytes(entry["key"]) for entry in reply["keys"]]
