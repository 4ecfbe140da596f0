"""The daemon's side of NIXL: each tenant region exported by a process of its own.

Theory of operation
-------------------
NIXL over UCX bounds nothing on the owner's side: a peer that edits the metadata it was given
can READ any address of the process running the agent it reads from (``docs/nixl.md``, "What a
NIXL peer can reach"). So the daemon's process never loads NIXL. :func:`open_region_export`
proves NIXL in a child (:func:`~kvtierd.nixl.probe.probe_nixl`, in a worker thread: it takes
seconds), then starts one exporter process per tenant region
(:class:`~kvtierd.nixl.exporters.RegionExporter`), each mapping its region's memory file and
nothing else of the daemon's, and supervises them in a task group it owns until the daemon
stops. :class:`RegionExport` is what the request handlers and the peer restores use: by region,
the grant (NIXL_GRANT), the descriptors of leased extents (READ_NIXL), a lease to keep the
exporter's progress going for, and pulls from peer daemons into a slot of the region. An
exporter that dies takes only its own region's NIXL reads down, until it is restarted.

:class:`NixlReads` is what the handlers see: the export, or why there is none.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
from collections.abc import AsyncIterator, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

import anyio
import anyio.to_thread

from kvtierd.errors import InvalidRequestError, NotSupportedError
from kvtierd.io.buffers import buffer_address
from kvtierd.nixl.agent import Extent, TransferError
from kvtierd.nixl.exporter import LINGER_S
from kvtierd.nixl.exporters import RegionExporter, RegionGrant, check_extents
from kvtierd.nixl.probe import PROBE_TIMEOUT_S, NixlVerdict, probe_nixl
from kvtierd.store.regions import TenantRegion

__all__ = [
    "LINGER_S",
    "NIXL_OFF",
    "NixlReads",
    "RegionExport",
    "RegionGrant",
    "open_region_export",
]

log = logging.getLogger("kvtierd.nixl")

#: The landing slot of a daemon that says no size: the default ``limits.max_block_bytes``.
LANDING_SLOT_BYTES = 64 << 20


class RegionExport:
    """Every tenant region's exporter, by region id; ``arena_address`` is the address of arena
    offset 0 in the daemon (to find the region of a slot a peer restore fills)."""

    def __init__(self, arena_address: int, exporters: Mapping[int, RegionExporter]) -> None:
        if arena_address <= 0:
            raise InvalidRequestError(f"no arena at {arena_address:#x}")
        self.arena_address = arena_address
        self.exporters = dict(exporters)

    @property
    def region_ids(self) -> frozenset[int]:
        return frozenset(self.exporters)

    def grant(self, region: TenantRegion) -> RegionGrant:
        """What a client of ``region``'s tenant loads: its exporter's agent and metadata.
        Raises :class:`~kvtierd.nixl.exporters.ExporterUnavailableError` while that exporter
        is restarting."""
        return self._exporter(region).grant()

    def describe(self, region: TenantRegion, extents: Sequence[Extent]) -> bytes:
        """Descriptors of ``extents`` (arena offsets and lengths, as the store's slots give
        them) for a client of ``region``'s tenant, in the addresses of that region's exporter;
        :class:`~kvtierd.errors.InvalidRequestError` for any extent not wholly inside
        ``region``."""
        return self._exporter(region).describe(check_extents(region, list(extents)))

    def hold(self, region: TenantRegion, lease: object) -> None:
        """Keep ``region``'s exporter driving UCX's progress while ``lease`` exists."""
        self._exporter(region).hold(lease)

    async def pull_into(
        self, target: memoryview, *, agent: str, metadata: bytes, remote: bytes, timeout_s: float
    ) -> int:
        """Fill ``target`` (a slot of the arena, inside one region) with ``remote``, the
        descriptors of peer agent ``agent`` (loaded from ``metadata``): pulled by the exporter
        of ``target``'s region into its landing buffer (the region is read-only there), then
        copied into ``target`` by the daemon. Returns the xxh3-64 of the bytes now in
        ``target``, which the caller compares with the checksum it expects; raises what the
        pull raised."""
        offset = buffer_address(target) - self.arena_address
        for exporter in self.exporters.values():
            region = exporter.region
            if region.mapping.base <= offset < region.mapping.base + region.size_bytes:
                check_extents(region, [(offset, len(target))])
                return await exporter.pull_into(
                    target, agent, metadata, remote, timeout_s=timeout_s
                )
        raise InvalidRequestError(f"arena offset {offset} lies in no exported region")

    def _exporter(self, region: TenantRegion) -> RegionExporter:
        try:
            return self.exporters[region.id]
        except KeyError:
            raise InvalidRequestError(f"region {region.id} is not exported over NIXL") from None


@dataclass(frozen=True, slots=True)
class NixlReads:
    """The daemon's NIXL reads: its :class:`RegionExport`, or ``None`` and why there is none."""

    export: RegionExport | None
    why_not: str = ""

    def require(self) -> RegionExport:
        """The export; raises :class:`~kvtierd.errors.NotSupportedError` saying why there is
        none."""
        if self.export is None:
            raise NotSupportedError(f"this daemon serves no NIXL reads: {self.why_not}")
        return self.export


#: What a daemon without ``nixl.enabled`` serves.
NIXL_OFF = NixlReads(None, "nixl.enabled is false")


@contextlib.asynccontextmanager
async def open_region_export(
    name: str,
    arena_address: int,
    regions: Iterable[TenantRegion],
    *,
    start_timeout_s: float = PROBE_TIMEOUT_S,
    probe: Callable[[], NixlVerdict] = probe_nixl,
    landing_slot_bytes: int = LANDING_SLOT_BYTES,
    user: str = "nobody",
) -> AsyncIterator[RegionExport]:
    """Probe NIXL in a child (in a worker thread) and, if it works here, start an exporter of
    each of ``regions`` (agents ``{name}-r{id}-{generation}``; each dropping to ``user`` when
    the daemon is root, with a landing buffer of slots of ``landing_slot_bytes``, the largest
    block a peer restore pulls) and supervise them until the block ends, which kills them.
    Raises before the block, having started nothing that still
    runs: :class:`~kvtierd.errors.NotSupportedError` with the probe's reason when NIXL does not
    work here, :class:`~kvtierd.nixl.agent.TransferError` when an exporter could not start."""
    verdict = await anyio.to_thread.run_sync(probe)
    if not verdict.ok:
        raise NotSupportedError(f"NIXL failed its probe: {verdict.detail}")
    slot = -(-landing_slot_bytes // mmap.PAGESIZE) * mmap.PAGESIZE
    exporters = {
        region.id: RegionExporter(
            region, name, start_timeout_s=start_timeout_s, landing_slot_bytes=slot, user=user
        )
        for region in regions
    }
    try:
        async with _exported(name, verdict, arena_address, exporters) as export:
            yield export
    finally:
        for exporter in exporters.values():
            exporter.close_landing()


@contextlib.asynccontextmanager
async def _exported(
    name: str, verdict: NixlVerdict, arena_address: int, exporters: dict[int, RegionExporter]
) -> AsyncIterator[RegionExport]:
    failures: list[TransferError] = []

    async def start(exporter: RegionExporter) -> None:
        try:
            await exporter.start()
        except TransferError as exc:
            failures.append(exc)

    async with anyio.create_task_group() as starting:
        for exporter in exporters.values():
            starting.start_soon(start, exporter)
    if failures:
        for exporter in exporters.values():
            await exporter.aclose()
        raise failures[0]
    log.info("NIXL: %d region(s) exported by an exporter process each, agents %s-r* (%s)",
             len(exporters), name, verdict.detail)  # fmt: skip
    async with anyio.create_task_group() as tasks:
        for exporter in exporters.values():
            tasks.start_soon(exporter.supervise)  # it kills its exporter when cancelled
        try:
            yield RegionExport(arena_address, exporters)
        finally:
            tasks.cancel_scope.cancel()
