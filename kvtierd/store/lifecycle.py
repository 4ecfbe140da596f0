"""Assembling the store from its configuration, and taking it apart in the right order.

Opening, in two steps. The base (:func:`open_store_base`): the key secret is read (or made),
the I/O backend opened, the arena created and pre-faulted (its private staging memory and one
sealed region per tenant; io_uring registers it all as fixed buffers, which is fast only on
faulted memory) and the namespace registry loaded; the composition root exports the regions
(NIXL) before the store exists. Then the store on it (:func:`open_store`, which opens its own
base when given none): the NVMe tier recovers its index before anything is served, and the
store adopts what was recovered.

Progress. A large arena takes seconds to pre-fault and a large data file minutes to scan, so
the opening reports where it is in an :class:`OpenProgress` that the daemon shows to whoever
asks meanwhile (``"pre-faulting the arena, 3.0 of 8.0 GiB"``): the pre-fault thread after each
chunk, the NVMe recovery after each run of headers.

What is running while the store is open, each under an async context manager that owns its
tasks, entered in this order and left in the reverse one: the write-back workers, the disk
watch's timer (:mod:`kvtierd.store.diskwatch`; only with an NVMe tier), the replica
link (its membership, writers and restores; only when the composition root,
:mod:`kvtierd.server.assembly`, passes a :class:`~kvtierd.store.ports.Replica`), the store's
background promotions, the prefetcher's ticks. Nothing here imports the pool.

Closing, whatever happened: the prefetcher stops, running promotions end, the link gives queued
blocks its grace to reach the pool, no new write-back is queued and the workers finish the queue
(every committed block reaches the disk when time allows), the NVMe tier writes its index
snapshot. The base closes after the store, and after whatever its opener put on it (the NIXL
exporters that map the regions): the arena goes away, then the backend.
"""

from __future__ import annotations

import contextlib
import enum
import logging
import os
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import anyio
from humanfriendly import format_size

from kvtierd.config import Config, NvmePolicyKind, PolicyKind
from kvtierd.errors import ConfigError, StorageIOError
from kvtierd.io import BindingVerdict, IoBackend, open_io_backend
from kvtierd.io.buffers import MAX_FIXED_CHUNK_BYTES as FIXED_BUFFER_BYTES
from kvtierd.policy import CachePolicy
from kvtierd.slsap.policy import SlsapPolicy
from kvtierd.store.arena import HUGE_PAGE_BYTES, Arena, usable_kind
from kvtierd.store.clock import ClockPolicy
from kvtierd.store.coldindex import ColdIndex
from kvtierd.store.diskwatch import DiskWatch, open_disk_watch
from kvtierd.store.kept import DramImage, DramKeeper, Handed, encode_image, image_bound
from kvtierd.store.namespaces import NamespaceRegistry
from kvtierd.store.nvme import NvmeTier, open_nvme_tier
from kvtierd.store.policy import LruPolicy
from kvtierd.store.ports import Replica
from kvtierd.store.prefetch import open_prefetcher
from kvtierd.store.readopt import KeptOutcome, adopt_kept, image_of
from kvtierd.store.records import PAGE_BYTES
from kvtierd.store.regions import Regions
from kvtierd.store.residency import Residency
from kvtierd.store.secret import load_secret
from kvtierd.store.staging import StagedCopies, StagingPages
from kvtierd.store.store import BlockStore
from kvtierd.store.writeback import WriteBack, open_writeback
from kvtierd.store.writer import LowerWriter

__all__ = [
    "OpenPhase",
    "OpenProgress",
    "StoreBase",
    "arena_bytes",
    "make_policy",
    "nvme_data_path",
    "open_store",
    "open_store_base",
    "staging_bytes",
    "staging_pages",
]

log = logging.getLogger("kvtierd.store")


class OpenPhase(enum.StrEnum):
    """What :func:`open_store` (and the daemon's assembly around it) is doing, in the words a
    starting daemon says."""

    PREPARING = "preparing the data directory"
    CREATING_ARENA = "creating the arena"
    PREFAULTING = "pre-faulting the arena"
    #: The composition root's step between the base and the store (kvtierd.server.assembly).
    EXPORTING = "proving NIXL and starting its exporters"
    OPENING_NVME = "opening the NVMe tier"
    RECOVERING = "recovering the NVMe index"
    ADOPTING_DRAM = "checking the DRAM kept across the restart"
    JOINING_POOL = "waiting for the pool group's decision"
    OPEN = "open"


class OpenProgress:
    """How far an opening has come. Written by :func:`open_store` (on the event loop, and from
    the pre-fault thread), read by anyone: the state is one tuple, replaced whole, so a reader
    never sees a phase with another phase's figures."""

    def __init__(self) -> None:
        self.state: tuple[OpenPhase, int, int] = (OpenPhase.PREPARING, 0, 0)
        #: Bumped by every :meth:`advance`: a reader can tell that something moved.
        self.steps = 0

    def advance(self, phase: OpenPhase, done: int = 0, total: int = 0) -> None:
        """Now in ``phase``, ``done`` of ``total`` (bytes pre-faulted, records recovered)."""
        self.state = (phase, done, total)
        self.steps += 1

    @property
    def phase(self) -> OpenPhase:
        return self.state[0]

    def describe(self) -> str:
        """One line: ``"pre-faulting the arena, 3.0 of 8.0 GiB"``,
        ``"recovering the NVMe index, 12000 records"``."""
        phase, done, total = self.state
        if phase is OpenPhase.PREFAULTING:
            unit, scale = ("GiB", 1 << 30) if total >= 1 << 30 else ("MiB", 1 << 20)
            return f"{phase.value}, {done / scale:.1f} of {total / scale:.1f} {unit}"
        if phase is OpenPhase.RECOVERING:
            return f"{phase.value}, {done} records"
        return phase.value


def staging_pages(config: Config) -> int:
    """How many NVMe staging pages the arena holds ahead of its block slots."""
    return 2 * config.nvme.queue_depth + 64


def staging_bytes(config: Config) -> int:
    """The write-back staging memory (lazy: touched only while blocks await write-back)."""
    return config.nvme.staging_bytes if config.nvme.size else 0


def nvme_data_path(config: Config) -> Path:
    """The NVMe tier's data file (or raw device): ``nvme.path``, else ``nvme.data`` in the
    data directory."""
    return Path(config.nvme.path) if config.nvme.path else config.data_path / "nvme.data"


def arena_bytes(config: Config) -> int:
    """The memory the arena ``config`` asks for takes at start-up, pre-faulted and locked: the
    header pages and every tenant's region, in whole huge pages (what the start-up checks
    compare with the memory available). The write-back staging comes on top, only while used."""
    headers = -(-staging_pages(config) * PAGE_BYTES // HUGE_PAGE_BYTES) * HUGE_PAGE_BYTES
    return headers + sum(size for _, size in config.dram_regions())


def make_policy(kind: PolicyKind | NvmePolicyKind, tier: NvmeTier | None = None) -> CachePolicy:
    """The one place a policy is chosen by name. CLOCK sweeps the rows of ``tier`` (without
    a disk tier, an empty table: the lower tier's policy is then never asked)."""
    if kind == NvmePolicyKind.CLOCK:
        if tier is None:
            empty = ColdIndex(rows=16)
            return ClockPolicy(lambda: empty)
        disk = tier
        # read at each call: recovery may replace the rows
        return ClockPolicy(lambda: disk.cold, classes=disk.segment_classes)
    policies: dict[str, type[CachePolicy]] = {
        PolicyKind.LRU: LruPolicy,
        PolicyKind.SLSAP: SlsapPolicy,
    }
    return policies[kind]()


class _Abandoned(Exception):
    """Raised in the worker thread of an arena whose creation was cancelled."""


async def _create_arena(
    config: Config, progress: OpenProgress, backend: IoBackend, handed: Handed | None
) -> Arena:
    """:meth:`Arena.create` in a worker thread, its resident part registered with ``backend``
    as fixed buffers before anything touches it (see ``pin`` there). Pinning or pre-faulting
    a large arena takes seconds, so a cancelled start-up (Ctrl-C) does not wait for it: the
    thread stops at its next chunk and releases what it made."""
    abandoned = threading.Event()
    registered: list[StorageIOError | int] = []  # logged from the loop: never after a Ctrl-C

    def checkpoint(done_bytes: int, total_bytes: int) -> None:
        if abandoned.is_set():
            raise _Abandoned
        progress.advance(OpenPhase.PREFAULTING, done_bytes, total_bytes)

    def pin(view: memoryview) -> bool:
        """Register ``view`` (the resident part) as ``backend``'s fixed buffers; whether it
        did. Without them reads are still correct, only dearer."""
        try:
            backend.register_buffer(view)
        except StorageIOError as exc:
            registered.append(exc)
            return False
        registered.append(view.nbytes)
        return True

    create = partial(
        Arena.create,
        staging_pages(config) * PAGE_BYTES,
        config.dram_regions(),
        tenants_isolated=bool(config.tenants),
        lazy_bytes=staging_bytes(config),
        hugepages=config.dram.hugepages,
        mlock=config.dram.mlock,
        prefault=config.dram.prefault,
        checkpoint=checkpoint,
        pin=pin if backend.supports_fixed_buffers else None,
        handed=handed.regions if handed is not None else None,
    )
    try:
        arena = await anyio.to_thread.run_sync(create, abandon_on_cancel=True)
    finally:
        abandoned.set()  # after a return, too late to matter
    for outcome in registered:
        if isinstance(outcome, StorageIOError):
            log.warning("arena not registered as io_uring fixed buffers: %s", outcome)
        else:
            log.info("io_uring: the arena's %d MiB registered as fixed buffers", outcome >> 20)
    return arena


@dataclass(eq=False, slots=True)
class DramKeeping:
    """DRAM kept across restarts (:mod:`kvtierd.store.kept`): who keeps it (``None``: nobody,
    the DRAM starts empty), the image a stopped daemon left for this start, and whether this
    daemon's regions were handed on as it stopped (they must then be left whole)."""

    keeper: DramKeeper | None = None
    image: DramImage | None = None
    kept: bool = False

    def leave(self, residency: Residency) -> None:
        """Hand the regions and an image of what they hold to the keeper; never raises (a
        daemon that cannot keep its DRAM still stops cleanly, and the next start reads
        NVMe)."""
        if self.keeper is None:
            return
        try:
            image = image_of(residency)
            regions = [(r.id, r.fd) for r in residency.regions]
            self.kept = self.keeper.keep(regions, encode_image(image))
        except Exception:  # a stop must go on; the next start then reads NVMe
            log.exception("the DRAM could not be kept for the next start")
            return
        if self.kept:
            log.info(
                "DRAM handed to systemd's file-descriptor store for the next start: %d blocks "
                "(%s) in %d region(s)",
                len(image.blocks),
                format_size(sum(b.raw_bytes for b in image.blocks), binary=True),
                len(regions),
            )


async def _take_handed(config: Config, keeper: DramKeeper | None) -> Handed | None:
    """What ``keeper`` hands this start (read in a worker thread, an image no larger than
    this configuration's DRAM can describe), reduced to the regions this configuration has
    (same tenant, same size, pages of a kind it may use), now this process's; everything else
    is closed before the arena is made (a region it does not take would otherwise hold its
    memory beside the new one). Nothing is left in the keeper: after a crash from here on,
    nothing is handed."""
    if keeper is None:
        return None
    handed = await anyio.to_thread.run_sync(
        keeper.handed, image_bound(config.dram.size), abandon_on_cancel=True
    )
    wanted = set(config.dram_regions())  # whole 2 MiB pages, as the arena maps them
    isolated = bool(config.tenants)
    regions = {
        shape: region
        for shape, region in (handed.regions.items() if handed is not None else ())
        if shape in wanted and usable_kind(region.kept.hugepages, config.dram.hugepages, isolated)
    }
    keeper.settle(region.fd for region in regions.values())
    return Handed(handed.image, regions) if handed is not None else None


def _close_handed(handed: Handed | None) -> None:
    """Close the handed regions (an arena that failed did not take them)."""
    for region in handed.regions.values() if handed is not None else ():
        os.close(region.fd)


@dataclass(frozen=True, slots=True)
class StoreBase:
    """What a store is built on and what others may need before it opens: the I/O backend, the
    arena with its tenant regions, and the namespace registry. The composition root
    (:mod:`kvtierd.server.assembly`) opens it first so that the NIXL export of the regions and
    the peers asked before the pool exist when the store's tiers are put together."""

    backend: IoBackend
    arena: Arena
    regions: Regions
    registry: NamespaceRegistry
    keeping: DramKeeping


@contextlib.asynccontextmanager
async def open_store_base(
    config: Config,
    *,
    io_verdict: BindingVerdict | None = None,
    progress: OpenProgress | None = None,
    keeper: DramKeeper | None = None,
) -> AsyncIterator[StoreBase]:
    """The data directory, the key secret, the I/O backend and the arena (created and
    pre-faulted, ``progress`` told how far), for :func:`open_store`; the arena and then the
    backend go away on exit. ``io_verdict`` is the liburing binding's probe verdict, when the
    caller already has it. ``keeper``: who keeps the DRAM across restarts (the arena takes
    back the regions it hands, and the store their blocks; the store hands them on as it
    closes)."""
    progress = progress if progress is not None else OpenProgress()
    data_dir = config.data_path
    await anyio.to_thread.run_sync(lambda: data_dir.mkdir(parents=True, exist_ok=True))
    secret = await anyio.to_thread.run_sync(load_secret, config.key_secret_path)
    progress.advance(OpenPhase.CREATING_ARENA)
    async with contextlib.AsyncExitStack() as stack:
        backend = await stack.enter_async_context(
            open_io_backend(
                config.nvme.io_backend, queue_depth=config.nvme.queue_depth, verdict=io_verdict
            )
        )
        handed = await _take_handed(config, keeper)
        try:
            arena = await _create_arena(config, progress, backend, handed)
        except anyio.get_cancelled_exc_class():
            raise  # the abandoned worker may still map the handed regions: they go at exit
        except BaseException:
            _close_handed(handed)
            raise
        keeping = DramKeeping(keeper, handed.image if handed is not None else None)
        # after all that uses it, before the backend (whose pins keep the pages it may still
        # be reading into); whole where its regions were handed on
        stack.callback(lambda: arena.close(keep_regions=keeping.kept))
        regions = Regions(arena.regions, boundary=FIXED_BUFFER_BYTES)
        registry = NamespaceRegistry(
            data_dir / "namespaces.catalog",
            config.tenants,
            secret=secret,
            regions=regions,
            limits=config.limits,
        )
        yield StoreBase(backend, arena, regions, registry, keeping)


@contextlib.asynccontextmanager
async def open_store(
    config: Config,
    *,
    io_verdict: BindingVerdict | None = None,
    progress: OpenProgress | None = None,
    replica: Replica | None = None,
    base: StoreBase | None = None,
) -> AsyncIterator[BlockStore]:
    """Yield a running :class:`BlockStore` for ``config``; closes it on exit. ``progress`` is
    told where the opening is (and ends in :attr:`OpenPhase.OPEN`); ``replica``: the shared tier
    and its link (:func:`kvtierd.server.assembly.open_daemon_store` passes the pool's); ``base``:
    what the store is built on, when the caller opened it (:func:`open_store_base`, with
    ``io_verdict``), else the store opens its own."""
    if config.pool.url and replica is None:
        raise ConfigError(
            "pool.url is set but no pool was joined to the store: open it through "
            "kvtierd.server.assembly.open_daemon_store"
        )
    if base is not None and io_verdict is not None:
        raise TypeError("io_verdict is for the base open_store opens: pass it to open_store_base")
    progress = progress if progress is not None else OpenProgress()
    async with contextlib.AsyncExitStack() as stack:
        if base is None:
            base = await stack.enter_async_context(
                open_store_base(config, io_verdict=io_verdict, progress=progress)
            )
        yield await stack.enter_async_context(_open_store_on(config, base, progress, replica))


@contextlib.asynccontextmanager
async def _open_store_on(
    config: Config, base: StoreBase, progress: OpenProgress, replica: Replica | None
) -> AsyncIterator[BlockStore]:
    """:func:`open_store` on ``base``."""
    data_dir = config.data_path
    arena, backend, regions, registry = base.arena, base.backend, base.regions, base.registry
    staging_count = staging_pages(config)
    async with contextlib.AsyncExitStack() as stack:
        pages = StagingPages(arena.view[: staging_count * PAGE_BYTES], staging_count)
        tier = None
        if config.nvme.size:
            progress.advance(OpenPhase.OPENING_NVME)
            tier = await stack.enter_async_context(
                open_nvme_tier(
                    nvme_data_path(config),
                    config.nvme.size,
                    backend=backend,
                    pages=pages,
                    segment_bytes=config.nvme.segment_bytes,
                    preallocate=config.nvme.preallocate,
                    progress=partial(progress.advance, OpenPhase.RECOVERING),
                    snapshot_dir=data_dir,
                    reinitialize=config.nvme.reinitialize_unreadable,
                    checkpoint_every_bytes=config.nvme.checkpoint_every_bytes,
                )
            )
        staged = None
        if tier is not None:
            staged = StagedCopies(
                arena.lazy()[: staging_bytes(config)],  # (the arena rounds it to 2 MiB)
                arena.resident_bytes,
                reserve=config.limits.max_block_bytes,
            )
        writeback = WriteBack(config.nvme.writeback_concurrency)
        residency = Residency(
            arena,
            regions,
            registry,
            partial(make_policy, config.dram.policy),
            tier,
            make_policy(config.nvme.policy, tier),
            writeback=writeback,
            staged=staged,
            shared=replica.tier if replica is not None else None,
            limits=config.limits,
            read_batch=(config.nvme.read_batch_bytes, config.nvme.read_batch_blocks),
        )
        adopted = residency.adopt_recovered()
        log.info("store ready: %d blocks adopted from the NVMe tier", adopted)
        # Runs last on the way out (when nothing changes the index any more), before the
        # base closes the arena; only when the store closes cleanly: a daemon that dies of an
        # error keeps nothing (what it was handed might be what it died of).
        stack.push_async_exit(partial(_leave_if_clean, base.keeping, residency))
        if (image := base.keeping.image) is not None:
            progress.advance(OpenPhase.ADOPTING_DRAM)
            log.info(
                "DRAM kept across the restart: checking %d blocks that pid %d left %.1f s ago "
                "(in regions %d restarts old)",
                len(image.blocks),
                image.pid,
                time.time() - image.written_at,
                max((r.restarts for r in image.regions), default=0),
            )
            _log_kept(
                await adopt_kept(
                    residency, image, partial(progress.advance, OpenPhase.ADOPTING_DRAM)
                )
            )
            base.keeping.image = None  # its blocks are the store's now
        # Write-back before the link: on the way out the link gives queued blocks its grace
        # to reach the pool first, then write-back drains to disk (which has no deadline).
        await stack.enter_async_context(
            open_writeback(writeback, LowerWriter(residency).write_back)
        )
        disk = None
        if tier is not None:  # after write-back: its timer queues failed blocks again
            disk = await stack.enter_async_context(
                open_disk_watch(
                    DiskWatch(tier, writeback, registry), config.nvme.health_check_interval_s
                )
            )
        link = None
        if replica is not None:
            link = await stack.enter_async_context(replica.open_link(residency))
            residency.link = link  # what it holds stays live (Residency.cool)
        background = await stack.enter_async_context(anyio.create_task_group())
        # left before the task group waits for its tasks: a fit of a sparse index may take
        # seconds and keeps nothing worth waiting for
        stack.callback(residency.sparse.cancel_fits)
        store = BlockStore(
            residency,
            background,
            link=link,
            prefetch_bytes_per_s=config.dram.prefetch_bytes_per_s,
            io_backend=backend,
            disk=disk,
        )
        await stack.enter_async_context(open_prefetcher(store.prefetcher, store.prefetch))
        if link is not None:
            progress.advance(OpenPhase.JOINING_POOL)
            await link.settle()
        progress.advance(OpenPhase.OPEN)
        yield store


async def _leave_if_clean(
    keeping: DramKeeping,
    residency: Residency,
    exc_type: type[BaseException] | None,
    exc: BaseException | None,
    traceback: object,
) -> bool:
    """The store's last exit: hand the DRAM on when it closes without an exception, in a
    worker thread (the image of millions of blocks takes seconds; nothing else runs on the
    store any more, and the loop keeps the watchdog fed)."""
    if exc_type is None:
        await anyio.to_thread.run_sync(keeping.leave, residency)
    elif keeping.keeper is not None:
        log.warning("the DRAM is not kept for the next start: the store closed on %r", exc)
    return False


def _log_kept(outcome: KeptOutcome) -> None:
    if not outcome.adopted and not outcome.damaged:
        log.info(
            "DRAM kept across the restart: none of its %d blocks taken (the regions' tenants "
            "or sizes, or the namespaces, are not what they were): the DRAM starts empty",
            outcome.refused,
        )
        return
    log.info(
        "DRAM kept across the restart: %d blocks (%s) verified and adopted in %.3f s",
        outcome.adopted,
        format_size(outcome.adopted_bytes, binary=True),
        outcome.seconds,
    )
    if outcome.damaged:
        log.warning(
            "DRAM kept across the restart: %d blocks changed while no daemon ran (their "
            "tenant's clients can write into their region) and were dropped",
            outcome.damaged,
        )
    if outcome.refused:
        log.info(
            "DRAM kept across the restart: %d blocks not taken (their region or namespace "
            "is not what it was)",
            outcome.refused,
        )
