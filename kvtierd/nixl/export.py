"""The daemon's side of NIXL: each tenant region of the arena registered on its own.

Theory of operation
-------------------
The arena is one address range holding one sealed region per tenant, next to each other
(:mod:`kvtierd.store.arena`). :class:`RegionExport` registers every region as its own NIXL
registration, so that a client of one tenant can be handed the metadata of that registration
alone (:meth:`RegionExport.grant`) and descriptors of extents inside it
(:meth:`RegionExport.describe`, which takes the store's arena offsets and refuses any that leave
the region). NIXL itself does not bound or revoke a peer's access (``docs/nixl.md``): these
calls make sure kvtierd never *hands out* more than a tenant's own region; what a client may
read within it is decided by its lease, which it re-checks (with the block's generation) after
every transfer.

Progress. NIXL's progress thread spins a core for as long as the agent lives, so the daemon's
agent has none: :meth:`RegionExport.pump`, a task of the daemon's, drives UCX's progress on the
event loop (every :data:`PUMP_INTERVAL_S`, 1 ms) while a NIXL lease is held
(:meth:`RegionExport.hold`) and for :data:`LINGER_S` after the last grant or lease, and sleeps
otherwise. A peer reading
over RDMA or shared memory needs no progress from the daemon; one reading over TCP does.

Nothing is registered for the private memory (record headers, write-back staging): it is no
tenant's. Regions are never deregistered while the daemon runs, since deregistration ends no
one's access; :meth:`RegionExport.close` does it at teardown.

:func:`start_region_export` is what the daemon calls once at start, like the io backend's
choice (:func:`kvtierd.server.assembly.open_nixl_reads`): it proves NIXL in a child (in a
worker thread: the probe takes seconds) and only then loads it. :class:`NixlReads` is what the
request handlers see: the export, or why there is none.
"""

from __future__ import annotations

import logging
import time
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

import anyio
import anyio.to_thread

from kvtierd.errors import InvalidRequestError, NotSupportedError
from kvtierd.nixl.agent import Extent, NixlAgent, Registration, start_agent
from kvtierd.nixl.probe import NixlVerdict, probe_nixl
from kvtierd.store.regions import TenantRegion

__all__ = ["NIXL_OFF", "NixlReads", "RegionExport", "RegionGrant", "start_region_export"]

log = logging.getLogger("kvtierd.nixl")

#: How often the agent's progress is driven while peers may be reading. Not below 1 ms: uvloop
#: rounds a shorter timer down to 0, and the pump would then spin the event loop.
PUMP_INTERVAL_S = 0.001
#: How long progress goes on after the last grant or NIXL lease: a pull set up late (a client
#: that connects, then leases) or the last completions of a released lease still progress.
LINGER_S = 5.0


@dataclass(frozen=True, slots=True)
class RegionGrant:
    """What a client of one tenant gets once: the region it may pull from and the NIXL metadata
    that names that region's registration and nothing else of the daemon's."""

    region_id: int
    metadata: bytes


class RegionExport:
    """Every tenant region of one arena, registered with one agent; see the module docstring.

    ``arena_address`` is the address of arena offset 0 in this process. Construct with
    :meth:`register` (or :func:`start_region_export`); :meth:`close` deregisters and closes the
    agent.
    """

    def __init__(
        self, agent: NixlAgent, arena_address: int, registrations: Mapping[int, Registration]
    ) -> None:
        if arena_address <= 0:
            raise InvalidRequestError(f"no arena at {arena_address:#x}")
        self.agent = agent
        self.arena_address = arena_address
        self._registrations = dict(registrations)
        self._grants: dict[int, RegionGrant] = {}
        #: The leases whose blocks peers may be reading now (gone once released).
        self._held: weakref.WeakSet[object] = weakref.WeakSet()
        #: Progress continues until then after the last grant or lease (``LINGER_S``).
        self._linger_until = 0.0
        self._wake = anyio.Event()

    def hold(self, lease: object) -> None:
        """Keep UCX progressing while ``lease`` (handed out with descriptors) exists."""
        self._held.add(lease)
        self._stir()

    def _stir(self) -> None:
        self._linger_until = time.monotonic() + LINGER_S
        self._wake.set()

    async def pump(self) -> None:
        """Drive the agent's progress while peers may be reading (module docstring), idle
        otherwise; runs until cancelled, in the daemon's task group."""
        while True:
            await self._wake.wait()
            self._wake = anyio.Event()
            while self._held or time.monotonic() < self._linger_until:
                self.agent.progress()
                await anyio.sleep(PUMP_INTERVAL_S)

    @classmethod
    def register(
        cls, agent: NixlAgent, arena_address: int, regions: Iterable[TenantRegion]
    ) -> RegionExport:
        """Register each of ``regions`` with ``agent``; on a failure, what was registered is
        withdrawn and the error (:class:`~kvtierd.nixl.agent.TransferError`) raised."""
        registrations: dict[int, Registration] = {}
        try:
            for region in regions:
                address = arena_address + region.mapping.base
                registrations[region.id] = agent.register(address, region.size_bytes)
        except BaseException:
            for registration in registrations.values():
                agent.deregister(registration)
            raise
        return cls(agent, arena_address, registrations)

    @property
    def region_ids(self) -> frozenset[int]:
        return frozenset(self._registrations)

    def grant(self, region: TenantRegion) -> RegionGrant:
        """The metadata a client of ``region``'s tenant loads (the same bytes every time: a
        region's registration never changes while the daemon runs)."""
        self._stir()  # the pull that follows connects to this agent
        grant = self._grants.get(region.id)
        if grant is None:
            metadata = self.agent.metadata(self._registration(region))
            grant = self._grants[region.id] = RegionGrant(region.id, metadata)
        return grant

    def describe(self, region: TenantRegion, extents: Sequence[Extent]) -> bytes:
        """Descriptors of ``extents`` (arena offsets and lengths, as the store's slots give
        them) for a client of ``region``'s tenant; raises
        :class:`~kvtierd.errors.InvalidRequestError` for any extent not wholly inside
        ``region``."""
        addresses = [(self.arena_address + offset, length) for offset, length in extents]
        return self.agent.descriptors(addresses, within=self._registration(region))

    def close(self) -> None:
        """Deregister every region and close the agent; idempotent."""
        self._registrations.clear()
        self._grants.clear()
        self.agent.close()

    def _registration(self, region: TenantRegion) -> Registration:
        try:
            return self._registrations[region.id]
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


async def start_region_export(
    name: str,
    arena_address: int,
    regions: Iterable[TenantRegion],
    *,
    ucx_params: Mapping[str, str] | None = None,
    probe: Callable[[], NixlVerdict] = probe_nixl,
) -> RegionExport:
    """Probe NIXL in a child (in a worker thread) and, if it works here, export ``regions``.
    Raises :class:`~kvtierd.errors.NotSupportedError` with the probe's reason when it does not
    (NIXL is then never loaded in this process), and
    :class:`~kvtierd.nixl.agent.TransferError` when NIXL passed its probe but the agent or a
    registration then failed."""
    verdict = await anyio.to_thread.run_sync(probe)
    if not verdict.ok:
        raise NotSupportedError(f"NIXL failed its probe: {verdict.detail}")
    agent = start_agent(name, verdict, ucx_params=ucx_params, progress_thread=False)
    try:
        export = RegionExport.register(agent, arena_address, regions)
    except BaseException:
        agent.close()
        raise
    log.info("NIXL: %d region(s) exported by agent %s (%s)", len(export.region_ids), name,
             verdict.detail)  # fmt: skip
    return export
