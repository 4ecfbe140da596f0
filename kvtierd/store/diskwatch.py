"""Watching the disk tier: the observations :mod:`kvtierd.store.diskhealth` judges.

Theory of operation. Three things are watched, none of them per block on the hot path:

* write-back's failures and its recovery, which :class:`~kvtierd.store.writeback.WriteBack`
  reports as they happen (its :class:`~kvtierd.store.writeback.WriteObserver`);
* every FSYNC's sync, which :meth:`DiskWatch.sync` performs: it refuses at once while a
  condition that never clears holds, and otherwise syncs and checks that the data file is still
  the one the tier has open (:meth:`NvmeTier.check_data_file`) before FSYNC may acknowledge;
* a timer (``nvme.health_check_interval_s``) that checks the data file too, so that a daemon
  nobody FSYNCs still notices, and queues the oldest failed block again: once it is written
  write-back queues the others (:meth:`WriteBack.retry`), so health returns after space is
  freed even if no FSYNC comes, and a disk that stays full costs one attempt per tick, not
  one per waiting block.

Each failure is counted by its fault; a change of verdict is logged once, as an error with its
remedy (a return to health as a warning). The verdict itself is :attr:`DiskHealth.condition`,
which ``/health`` and ``/ready`` read from their threads.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator

import anyio

from kvtierd.errors import KvtierError
from kvtierd.store.diskhealth import (
    DataFileLostError,
    DiskHealth,
    FaultSource,
    HealthChange,
    fault_of,
)
from kvtierd.store.nvme import NvmeTier
from kvtierd.store.writeback import WriteBack

__all__ = ["DiskWatch", "open_disk_watch"]

log = logging.getLogger("kvtierd.disk")


class DiskWatch:
    """The disk tier's health, fed by write-back, FSYNC and a timer (:func:`open_disk_watch`)."""

    def __init__(self, tier: NvmeTier, writeback: WriteBack) -> None:
        self.tier = tier
        self.writeback = writeback
        self.health = DiskHealth(str(tier.path))
        writeback.observer = self

    # -- WriteObserver ------------------------------------------------------------------------

    def write_failed(self, exc: KvtierError) -> None:
        self._record(self.health.failed(FaultSource.WRITE, fault_of(exc), str(exc)))

    def writes_recovered(self) -> None:
        self._record(self.health.cleared(FaultSource.WRITE))

    # -- FSYNC and the timer ------------------------------------------------------------------

    async def sync(self) -> None:
        """Make every completed write durable in the data file, or raise: ``EIO``
        (:class:`DataFileLostError`) while the data file is lost or a sync failed before,
        the sync's own error when it fails now."""
        refusal = self.health.refusal()
        if refusal is not None:
            self.health.failed(refusal.source, refusal.fault, refusal.detail)  # counted only
            raise DataFileLostError(
                refusal.fault,
                f"FSYNC refused, nothing is durable: {refusal.detail}; restart kvtierd",
            )
        try:
            await self.tier.sync()
        except DataFileLostError as exc:
            self._record(self.health.failed(FaultSource.FILE, exc.fault, str(exc)))
            raise
        except KvtierError as exc:
            self._record(self.health.failed(FaultSource.SYNC, fault_of(exc), str(exc)))
            raise

    def check(self) -> None:
        """One tick: check the data file (until it is found lost), and queue the oldest failed
        block again while write-back is failing."""
        if not self.health.holds(FaultSource.FILE):
            try:
                self.tier.check_data_file()
            except DataFileLostError as exc:
                self._record(self.health.failed(FaultSource.FILE, exc.fault, str(exc)))
        if self.writeback.failed:
            self.writeback.retry(limit=1)

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
            watch.check()

    async with anyio.create_task_group() as tg:
        tg.start_soon(tick)
        try:
            yield watch
        finally:
            tg.cancel_scope.cancel()
