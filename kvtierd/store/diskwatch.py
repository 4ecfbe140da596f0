"""Watching the disk tier: the observations :mod:`kvtierd.store.diskhealth` judges.

Theory of operation. Four things are watched, none of them per block on the hot path:

* write-back's failures and its recovery, which :class:`~kvtierd.store.writeback.WriteBack`
  reports as they happen (its :class:`~kvtierd.store.writeback.WriteObserver`);
* every FSYNC's sync, which :meth:`DiskWatch.sync` performs: it refuses at once while a
  condition that never clears holds, and otherwise syncs and checks that the data file is still
  the one the tier has open, no shorter than the tier, and that its superblock reads back as
  written (:meth:`NvmeTier.check_data_file`) before FSYNC may acknowledge;
* the namespace catalog, at every FSYNC and tick: a copy removed, replaced or changed under
  the daemon is rewritten from memory at once (counted, reason ``catalog``, one warning);
  only a rewrite that fails is a condition (FSYNC refused, health failing) until one succeeds;
* a timer (``nvme.health_check_interval_s``) that checks the data file too, so that a daemon
  nobody FSYNCs still notices, and queues the oldest failed block again: once it is written
  write-back queues the others (:meth:`WriteBack.retry`), so health returns after space is
  freed even if no FSYNC comes, and a disk that stays full costs one attempt per tick, not
  one per waiting block. It also zeroes what dropped records and failed writes left
  (:mod:`kvtierd.store.leftovers`: a FORGET that a crash could undo, write-back's condition
  until done).

Each failure is counted by its fault; a change of verdict is logged once, as an error with its
remedy (a return to health as a warning). The verdict itself is :attr:`DiskHealth.condition`,
which ``/health`` and ``/ready`` read from their threads.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Protocol

import anyio

from kvtierd.errors import KvtierError
from kvtierd.store.diskhealth import (
    DataFileLostError,
    DiskFault,
    DiskHealth,
    FaultSource,
    HealthChange,
    fault_of,
)
from kvtierd.store.nvme import NvmeTier
from kvtierd.store.writeback import WriteBack

__all__ = ["CatalogKeeper", "DiskWatch", "open_disk_watch"]

log = logging.getLogger("kvtierd.disk")


class CatalogKeeper(Protocol):
    """What keeps the namespace catalog (the registry): rewrites a copy that changed under the
    daemon, off the event loop (:meth:`NamespaceRegistry.restore_catalog`)."""

    def restore_catalog(self) -> str | None: ...


class DiskWatch:
    """The disk tier's health, fed by write-back, FSYNC and a timer (:func:`open_disk_watch`)."""

    def __init__(
        self, tier: NvmeTier, writeback: WriteBack, catalog: CatalogKeeper | None = None
    ) -> None:
        self.tier = tier
        self.writeback = writeback
        self.catalog = catalog
        self.health = DiskHealth(str(tier.path))
        writeback.observer = self

    # -- WriteObserver ------------------------------------------------------------------------

    def write_failed(self, exc: KvtierError) -> None:
        self._record(self.health.failed(FaultSource.WRITE, fault_of(exc), str(exc)))

    def writes_recovered(self) -> None:
        self._clear_write_when_settled()

    def _clear_write_when_settled(self) -> None:
        """Write-back's condition clears once no block waits for its write and nothing
        waits to be zeroed (:mod:`kvtierd.store.leftovers`)."""
        if not self.tier.leftovers.pending and not self.writeback.failed:
            self._record(self.health.cleared(FaultSource.WRITE))

    # -- FSYNC and the timer ------------------------------------------------------------------

    async def sync(self) -> None:
        """Make every completed write durable in the data file, or raise: ``EIO``
        (:class:`DataFileLostError`) while the data file is lost or a sync failed before, or
        while the namespace catalog is gone and cannot be rewritten; the sync's own error when
        it fails now."""
        await self._keep_catalog()
        refusal = self.health.refusal()
        if refusal is not None:
            self.health.failed(refusal.source, refusal.fault, refusal.detail)  # counted only
            raise DataFileLostError(
                refusal.fault,
                f"FSYNC refused, nothing is durable: {refusal.detail}; {refusal.remedy}",
            )
        await self._zero_leftovers()  # a write's fault, which clears
        try:
            await self.tier.sync()
        except DataFileLostError as exc:
            self._record(self.health.failed(FaultSource.FILE, exc.fault, str(exc)))
            raise
        except KvtierError as exc:
            self._record(self.health.failed(FaultSource.SYNC, fault_of(exc), str(exc)))
            raise

    async def check(self) -> None:
        """One tick: the catalog (rewritten if it changed), the data file (until it is found
        lost), and the oldest failed block queued again while write-back is failing."""
        await self._keep_catalog()
        if not self.health.holds(FaultSource.FILE):
            try:
                await self.tier.check_data_file()
            except DataFileLostError as exc:
                self._record(self.health.failed(FaultSource.FILE, exc.fault, str(exc)))
        if self.writeback.failed:
            self.writeback.retry(limit=1)
        if self.tier.leftovers.pending:
            with contextlib.suppress(KvtierError):  # filed as it failed
                await self._zero_leftovers()

    async def _zero_leftovers(self) -> None:
        """Zero what dropped records and failed writes left (:meth:`Leftovers.zero`). A
        failure is write-back's condition (health fails, FSYNC raises it but is not refused
        for good); it clears once nothing waits to be zeroed or written."""
        try:
            unread = await self.tier.leftovers.zero()
        except KvtierError as exc:
            self._record(self.health.failed(FaultSource.WRITE, fault_of(exc), str(exc)))
            raise
        if unread:  # a leftover that could not be read: tried again later
            detail = f"what {unread} failed write(s) left cannot be read to be zeroed"
            self._record(self.health.failed(FaultSource.WRITE, DiskFault.EIO, detail))
        else:
            self._clear_write_when_settled()

    async def _keep_catalog(self) -> None:
        """Rewrite a namespace catalog that changed under the daemon (counted with reason
        ``catalog`` and logged as a warning); a rewrite that fails is the ``catalog``
        condition, which clears once one succeeds."""
        if self.catalog is None:
            return
        try:
            restored = await anyio.to_thread.run_sync(self.catalog.restore_catalog)
        except KvtierError as exc:
            self._record(self.health.failed(FaultSource.CATALOG, DiskFault.CATALOG, str(exc)))
            return
        if restored is not None:
            self.health.failures[DiskFault.CATALOG] += 1
            log.warning("%s: acknowledged blocks stay recoverable", restored)
        self._record(self.health.cleared(FaultSource.CATALOG))

    def _record(self, change: HealthChange | None) -> None:
        if change is None:
            return
        if change.after is None:
            log.warning("%s", change.message())
        else:
            log.error("%s", change.message())


@contextlib.asynccontextmanager
async def open_disk_watch(watch: DiskWatch, interval_s: float) -> AsyncIterator[DiskWatch]:
    """Run ``watch``'s timer every ``interval_s`` in a task of its own until the block exits."""

    async def tick() -> None:
        while True:
            await anyio.sleep(interval_s)
            await watch.check()

    async with anyio.create_task_group() as tg:
        tg.start_soon(tick)
        try:
            yield watch
        finally:
            tg.cancel_scope.cancel()
