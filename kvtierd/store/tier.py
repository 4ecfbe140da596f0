"""The port every tier below DRAM implements (NVMe now, the shared pool later).

A lower tier stores a block's bytes under a :class:`BlockRef` and gives back an opaque
location; it loads them into an arena buffer, verifying them; it discards them. It never decides
what to keep: the store's policies do, and call :meth:`LowerTier.discard`. What the store may
rely on is declared, never inferred from the type (:class:`TierCapabilities`); the contract
suite skips, by capability, what a tier does not promise.
"""

from __future__ import annotations

import abc
import logging
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass
from typing import ClassVar

from kvtierd.errors import BlockNotFoundError, KvtierError, NoSpaceError, StorageIOError
from kvtierd.policy import ServedBy
from kvtierd.store.coldrefs import ColdRows
from kvtierd.store.counts import CheckpointFigures, TierFigures
from kvtierd.store.refs import BlockRef, Recovered

log = logging.getLogger("kvtierd.store")

__all__ = [
    "BlockRef",
    "ClassFullError",
    "LowerTier",
    "MediumFullError",
    "Recovered",
    "TierCapabilities",
    "TierUnavailableError",
]


class MediumFullError(NoSpaceError):
    """The medium itself ran out of space (a sparse data file on a full file system), as
    opposed to a full size class: evicting blocks of the class would not make room, it would only
    throw away durable blocks. On the wire it is ``ENOSPC`` like any :class:`NoSpaceError`."""


class ClassFullError(NoSpaceError):
    """The space class a record needs is full: evicting blocks stored in ``slot_class`` makes
    room. A compressed record's class is that of its compressed size, smaller than
    :meth:`LowerTier.slot_class` of its ref."""

    def __init__(self, message: str, slot_class: int) -> None:
        super().__init__(message)
        self.slot_class = slot_class


class TierUnavailableError(StorageIOError):
    """The tier cannot be reached now (a shared pool that is down or detached): a copy there
    is out of reach, a miss for the reader, not damage (``EIO`` on the wire)."""


@dataclass(frozen=True, slots=True)
class TierCapabilities:
    """What a tier promises."""

    #: A stored copy survives a crash of the daemon (once :meth:`LowerTier.sync` returned).
    durable: bool
    #: Opening the tier lists what it holds (:meth:`LowerTier.recovered`); a tier without it
    #: is indexed some other way (the pool: by its link's restore).
    recovers_on_open: bool
    #: Other hosts' daemons read and write the same copies.
    shared_across_hosts: bool
    #: The medium drops copies by itself (a pool's maxmemory policy) and never refuses a
    #: size class as full: the store does not evict it, and a load may find a copy gone.
    evicts_itself: bool


class LowerTier(abc.ABC):
    """A tier under the arena. Methods may be called concurrently for different blocks."""

    kind: ServedBy
    capabilities: ClassVar[TierCapabilities]

    @abc.abstractmethod
    def slot_class(self, ref: BlockRef) -> int:
        """The space class ``ref`` would occupy: blocks evicted from the same class make room."""

    def stored_class(self, ref: BlockRef, location: Hashable) -> int:
        """The space class of ``ref``'s copy at ``location``: what evicting it makes room in
        (its :meth:`slot_class` unless the tier stores some records smaller, compressed)."""
        return self.slot_class(ref)

    @abc.abstractmethod
    async def store(self, ref: BlockRef, payload: memoryview) -> Hashable:
        """Write the block from ``payload``, its arena slot (at least ``ref.raw_bytes`` long, a
        multiple of 4 KiB). Returns its location.

        Raises :class:`~kvtierd.errors.NoSpaceError` when the class is full (evict, then
        retry; a :class:`ClassFullError` names the class), :class:`MediumFullError` when the
        medium has no room left (do not evict), and :class:`~kvtierd.errors.StorageIOError`
        when the medium fails.
        """

    @abc.abstractmethod
    async def load(self, ref: BlockRef, location: Hashable, dest: memoryview) -> None:
        """Fill ``dest`` with the block's bytes, verified against ``ref``.

        Raises :class:`~kvtierd.errors.BlockNotFoundError` when the stored copy is torn or
        not this block (the caller drops it) and ``StorageIOError`` when the medium fails.
        """

    def follows(self, before: Hashable, after: Hashable) -> bool:
        """Whether the copy at ``after`` lies right behind the one at ``before`` on the medium,
        so that :meth:`load_run` reads them in one request. By default no copy does."""
        return False

    async def load_run(
        self, items: Sequence[tuple[BlockRef, Hashable, memoryview]]
    ) -> list[BlockNotFoundError | None]:
        """:meth:`load` of each ``(ref, location, dest)``, in as few requests as the tier can
        (copies that :meth:`follow <follows>` one another in one, for a tier that can). For
        each item, ``None``
        when its ``dest`` holds its verified bytes, else the :class:`~kvtierd.errors.
        BlockNotFoundError` its own :meth:`load` would have raised (the caller drops that
        copy). Raises what :meth:`load` raises for anything else. By default one load after
        another."""
        outcomes: list[BlockNotFoundError | None] = []
        for ref, location, dest in items:
            try:
                await self.load(ref, location, dest)
            except BlockNotFoundError as exc:
                outcomes.append(exc)
            else:
                outcomes.append(None)
        return outcomes

    @abc.abstractmethod
    async def discard(self, ref: BlockRef, location: Hashable) -> None:
        """Forget ``ref``'s copy at ``location`` so that no later recovery brings it back; a
        location that holds another block's copy now is left alone (a tier that reuses
        places checks whose copy is there)."""

    async def discard_quietly(self, ref: BlockRef, location: Hashable) -> None:
        """:meth:`discard` for a copy nothing indexes any more (FORGET dropped it): a failure
        is logged, and the copy stays until the medium evicts it, never restored."""
        try:
            await self.discard(ref, location)
        except KvtierError as exc:
            log.warning("a forgotten block stays in the %s tier until it is evicted: %s",
                        self.kind.name.lower(), exc)  # fmt: skip

    @abc.abstractmethod
    async def sync(self) -> None:
        """Return once every completed :meth:`store` is durable."""

    @abc.abstractmethod
    def recovered(self) -> Iterable[Recovered]:
        """The blocks found when the tier opened (newest copy of each key only)."""

    def cold_rows(self) -> ColdRows | None:
        """Its records as rows the store's index looks blocks up in, rather than a ``Block``
        per block (:mod:`kvtierd.store.coldrefs`); ``None`` (the default): the store indexes
        what :meth:`recovered` lists, a ``Block`` each."""
        return None

    @abc.abstractmethod
    def statistics(self) -> TierFigures:
        """Counters for STATFS."""

    def checkpoint_figures(self) -> CheckpointFigures | None:
        """Its index checkpoints in this run, for a tier that takes them (``None``, the default:
        a tier that never does)."""
        return None
