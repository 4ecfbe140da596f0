"""Whether the disk tier can keep what it acknowledged: the health verdict, as a pure decision.

Theory of operation. What is observed (a block's write-back failed, a sync failed, the data
file is no longer the one the daemon has open) is carried out by
:mod:`kvtierd.store.diskwatch`; this module only decides what each observation means. A
*condition* is one fault seen at one place (:class:`FaultSource`):

* ``WRITE``: a block's write-back failed (``ENOSPC``: the file system or the tier is full;
  ``EIO``: the device refused the write). The block stays dirty in DRAM, nothing written is
  lost, and write-back retries; the condition clears once every block that failed is written.
* ``SYNC``: ``fdatasync`` failed. Linux may drop the pages a failed sync could not write and
  report success on the next one, so writes the kernel had accepted may be gone without any
  later error saying so: this condition never clears (a restart re-reads every record header
  and drops torn ones).
* ``FILE``: the path no longer names the open data file (``replaced``: another file was
  renamed over it; ``removed``: unlinked). Everything written since, and everything
  acknowledged before, lives only in an inode that disappears when the daemon exits. Or it is
  still the file but no longer what the daemon wrote: ``truncated`` (shorter than the tier,
  by the path's or the descriptor's ``st_size``), ``damaged`` (its superblock, the first
  page, no longer reads back byte for byte as written: overwritten in place). It never
  clears: only a restart, which refuses a file it cannot recognise, ends it.
* ``CATALOG``: the namespace catalog (both copies, ``namespaces.catalog`` and ``.1``) was
  removed, replaced or changed under the daemon *and rewriting it from memory failed*
  (a rewrite that succeeds is only counted and logged as a warning). Without the catalog a
  restart drops every recovered block of the namespaces it named. It clears once a rewrite
  succeeds.

While any condition holds, acknowledged data is at risk: ``/health`` fails and ``/ready`` is
degraded. While one that never clears holds, or the catalog's, FSYNC acknowledges nothing
(:meth:`DiskHealth.refusal`). Each failure is counted by its :class:`DiskFault`; a change of
the verdict (healthy, failing for one reason, failing for another, healthy again) is returned
as a :class:`HealthChange` so that the caller logs once per change, not once per block.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from kvtierd.errors import KvtierError, NoSpaceError, StorageIOError

__all__ = [
    "DataFileLostError",
    "DiskCondition",
    "DiskFault",
    "DiskHealth",
    "FaultSource",
    "HealthChange",
    "fault_of",
]


class DiskFault(enum.StrEnum):
    """Why the disk tier failed: the ``reason`` label of ``kvtierd_disk_failures_total``."""

    ENOSPC = "enospc"
    EIO = "eio"
    REPLACED = "replaced"
    REMOVED = "removed"
    TRUNCATED = "truncated"
    DAMAGED = "damaged"
    CATALOG = "catalog"


class FaultSource(enum.Enum):
    """Where a fault was seen; it decides whether the condition can clear by itself."""

    WRITE = "write-back"
    SYNC = "sync"
    FILE = "data file"
    CATALOG = "namespace catalog"


class DataFileLostError(StorageIOError):
    """The data file path no longer names the file the tier has open (``EIO`` on the wire):
    nothing written to the open file will be found there after a restart."""

    def __init__(self, fault: DiskFault, message: str) -> None:
        super().__init__(message)
        self.fault = fault


def fault_of(exc: KvtierError) -> DiskFault:
    """The fault a disk tier error stands for."""
    if isinstance(exc, DataFileLostError):
        return exc.fault
    if isinstance(exc, NoSpaceError):
        return DiskFault.ENOSPC
    return DiskFault.EIO


_REMEDY = {
    (FaultSource.WRITE, DiskFault.ENOSPC): (
        "free space on the file system that holds {path} (a sparse data file, "
        "nvme.preallocate = false, takes space as it fills: preallocate, or lower nvme.size), "
        "or grow nvme.size if the tier itself is full; write-back retries by itself and health "
        "returns once every waiting block is written"
    ),
    (FaultSource.WRITE, DiskFault.EIO): (
        "check the device under {path} (journalctl -k, smartctl -a); write-back retries by "
        "itself and health returns once every waiting block is written"
    ),
    (FaultSource.SYNC, DiskFault.ENOSPC): (
        "writes the kernel accepted may not be on the medium (a failed sync is not reported "
        "twice): restart kvtierd, whose recovery drops torn records, once the file system "
        "under {path} has room"
    ),
    (FaultSource.SYNC, DiskFault.EIO): (
        "writes the kernel accepted may not be on the medium (a failed sync is not reported "
        "twice): check the device under {path} (journalctl -k), then restart kvtierd, whose "
        "recovery drops torn records"
    ),
    (FaultSource.FILE, DiskFault.EIO): (
        "kvtierd cannot tell whether {path} is still its data file (the path cannot be looked "
        "up), so FSYNC answers EIO: check the directory and the device, then restart kvtierd"
    ),
    (FaultSource.FILE, DiskFault.REPLACED): (
        "another file was put at {path}: what kvtierd writes goes to a file that is gone when "
        "it exits, and FSYNC answers EIO; find what replaced it, then restart kvtierd (it "
        "opens the file at the path). To keep the old file's blocks, copy it back to {path} "
        "from the /proc path named above while kvtierd still runs, then restart (records "
        "torn by the copy are dropped at recovery); else they are lost"
    ),
    (FaultSource.FILE, DiskFault.TRUNCATED): (
        "{path} is shorter than the tier kvtierd wrote (something truncated it): the blocks "
        "past its end, and everything acknowledged there, are gone, and FSYNC answers EIO; "
        "find what truncated it, stop kvtierd, and move {path} aside (keep it for inspection; "
        "the next start refuses an existing file it cannot recognise, see "
        "nvme.reinitialize_unreadable)"
    ),
    (FaultSource.FILE, DiskFault.DAMAGED): (
        "the superblock of {path} no longer reads back as what kvtierd wrote (the file was "
        "overwritten in place): its blocks cannot be trusted, and FSYNC answers EIO; find "
        "what wrote to it, stop kvtierd, and move {path} aside (keep it for inspection; the "
        "next start refuses an existing file it cannot recognise, see "
        "nvme.reinitialize_unreadable)"
    ),
    (FaultSource.CATALOG, DiskFault.CATALOG): (
        "the namespace catalog beside {path} was removed or replaced and cannot be rewritten: "
        "without it a restart drops every block of the namespaces it named, so FSYNC answers "
        "EIO; make the data directory writable (free space, check the device), and kvtierd "
        "rewrites it at the next check or FSYNC and health returns"
    ),
    (FaultSource.FILE, DiskFault.REMOVED): (
        "{path} was deleted: what kvtierd writes goes to a file that is gone when it exits, "
        "and FSYNC answers EIO; find what removed it, then restart kvtierd (it creates a new "
        "data file). To keep the old file's blocks, copy it back to {path} from the /proc "
        "path named above while kvtierd still runs, then restart (records torn by the copy "
        "are dropped at recovery); else they are lost"
    ),
}


@dataclass(frozen=True, slots=True)
class DiskCondition:
    """One fault that holds now, where it was seen, and what the operator should do."""

    fault: DiskFault
    source: FaultSource
    detail: str
    path: str

    @property
    def clears(self) -> bool:
        """Whether it can end without a restart."""
        return self.source in (FaultSource.WRITE, FaultSource.CATALOG)

    @property
    def remedy(self) -> str:
        remedy = (
            _REMEDY.get((self.source, self.fault))
            or _REMEDY.get((self.source, DiskFault.EIO))
            or _REMEDY[(FaultSource.CATALOG, DiskFault.CATALOG)]
        )
        return remedy.format(path=self.path)

    def describe(self) -> str:
        """One line: what failed and why (no remedy)."""
        return f"disk tier {self.source.value} failing ({self.fault.value}): {self.detail}"


@dataclass(frozen=True, slots=True)
class HealthChange:
    """The verdict moved from ``before`` to ``after`` (``None``: healthy)."""

    before: DiskCondition | None
    after: DiskCondition | None

    def message(self) -> str:
        """The one log line for this change."""
        if self.after is None:
            assert self.before is not None
            return f"disk tier healthy again: {self.before.describe()} cleared"
        until = "until it clears" if self.after.clears else "until kvtierd is restarted"
        return (
            f"{self.after.describe()}; acknowledged data is at risk and health fails {until}. "
            f"Remedy: {self.after.remedy}"
        )


class DiskHealth:
    """The disk tier's conditions and failure counts. Touched only on the event loop, except
    :attr:`condition`, a frozen record replaced whole, which probe threads read."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._held: dict[FaultSource, DiskCondition] = {}
        #: Failures seen, by fault (the counter's value).
        self.failures = dict.fromkeys(DiskFault, 0)
        #: The condition that decides the verdict; ``None`` while healthy.
        self.condition: DiskCondition | None = None

    def failed(self, source: FaultSource, fault: DiskFault, detail: str) -> HealthChange | None:
        """Count a failure of ``fault`` seen at ``source``; the change of verdict, if any. A
        condition that never clears is kept as first seen (later ones are only counted)."""
        self.failures[fault] += 1
        held = self._held.get(source)
        if held is not None and not held.clears:
            return None
        if held is not None and held.fault is fault:
            return None
        self._held[source] = DiskCondition(fault, source, detail, self.path)
        return self._decide()

    def cleared(self, source: FaultSource) -> HealthChange | None:
        """Whatever failed at ``source`` works again (every failed block written); a condition
        that never clears stays."""
        held = self._held.get(source)
        if held is None or not held.clears:
            return None
        del self._held[source]
        return self._decide()

    def refusal(self) -> DiskCondition | None:
        """The condition for which FSYNC acknowledges nothing: one that never clears, or a
        catalog that could not be rewritten (the caller tries to rewrite it first)."""
        for source in (FaultSource.FILE, FaultSource.SYNC, FaultSource.CATALOG):
            if (held := self._held.get(source)) is not None:
                return held
        return None

    def holds(self, source: FaultSource) -> bool:
        return source in self._held

    def _decide(self) -> HealthChange | None:
        """The worst condition decides: the file's, the sync's, the catalog's, write-back's."""
        before = self.condition
        order = (FaultSource.FILE, FaultSource.SYNC, FaultSource.CATALOG, FaultSource.WRITE)
        after = next(
            (self._held[s] for s in order if s in self._held),
            None,
        )  # fmt: skip
        self.condition = after
        if before == after:
            return None
        return HealthChange(before, after)
