"""The disk tier's health as a decision table: which observation makes which verdict, which
conditions clear, what FSYNC refuses, and what ``/health`` and ``/ready`` say for it."""

from __future__ import annotations

import pytest

from kvtierd.errors import NoSpaceError, StorageIOError
from kvtierd.server.readiness import DaemonPhase, Readiness
from kvtierd.store.diskhealth import (
    DataFileLostError,
    DiskFault,
    DiskHealth,
    FaultSource,
    fault_of,
)
from kvtierd.store.tier import MediumFullError

PATH = "/var/lib/kvtierd/nvme.data"


def test_a_write_failure_fails_once_per_change_and_clears() -> None:
    health = DiskHealth(PATH)
    assert health.condition is None
    change = health.failed(FaultSource.WRITE, DiskFault.ENOSPC, "the file system is full")
    assert change is not None
    assert change.before is None
    assert change.after is health.condition
    assert health.condition is not None
    assert health.condition.fault is DiskFault.ENOSPC
    assert health.condition.clears
    message = change.message()
    assert "enospc" in message
    assert "until it clears" in message
    assert f"free space on the file system that holds {PATH}" in message
    # the same fault again (block after block) is counted, not a change
    for _ in range(99):
        assert health.failed(FaultSource.WRITE, DiskFault.ENOSPC, "again") is None
    assert health.failures[DiskFault.ENOSPC] == 100
    assert health.refusal() is None  # FSYNC still answers for itself (ENOSPC per block)
    back = health.cleared(FaultSource.WRITE)
    assert back is not None
    assert back.after is None
    assert health.condition is None
    assert back.message().startswith("disk tier healthy again")
    assert health.cleared(FaultSource.WRITE) is None  # nothing left to clear
    assert health.failures[DiskFault.ENOSPC] == 100  # a counter never goes back


def test_another_write_fault_is_a_change() -> None:
    health = DiskHealth(PATH)
    health.failed(FaultSource.WRITE, DiskFault.ENOSPC, "full")
    change = health.failed(FaultSource.WRITE, DiskFault.EIO, "the device refused")
    assert change is not None
    assert change.before is not None
    assert change.before.fault is DiskFault.ENOSPC
    assert change.after is not None
    assert change.after.fault is DiskFault.EIO
    assert "smartctl" in change.message()


@pytest.mark.parametrize("fault", [DiskFault.REPLACED, DiskFault.REMOVED])
def test_a_lost_data_file_never_clears_and_refuses_fsync(fault: DiskFault) -> None:
    health = DiskHealth(PATH)
    change = health.failed(FaultSource.FILE, fault, "gone")
    assert change is not None
    assert change.after is not None
    assert not change.after.clears
    assert "until kvtierd is restarted" in change.message()
    assert "restart kvtierd" in change.message()
    assert health.cleared(FaultSource.FILE) is None
    assert health.condition is not None
    assert health.condition.fault is fault
    refusal = health.refusal()
    assert refusal is not None
    assert refusal.fault is fault
    # another fault of the file later is counted, the first stays the verdict
    other = DiskFault.REMOVED if fault is DiskFault.REPLACED else DiskFault.REPLACED
    assert health.failed(FaultSource.FILE, other, "later") is None
    assert health.condition.fault is fault
    assert health.failures[other] == 1


def test_a_failed_sync_never_clears() -> None:
    health = DiskHealth(PATH)
    change = health.failed(FaultSource.SYNC, DiskFault.EIO, "fdatasync: [Errno 5]")
    assert change is not None
    assert health.cleared(FaultSource.SYNC) is None
    refusal = health.refusal()
    assert refusal is not None
    assert refusal.source is FaultSource.SYNC
    assert "restart kvtierd" in change.message()


def test_the_worst_condition_decides_and_outlives_a_cleared_one() -> None:
    health = DiskHealth(PATH)
    health.failed(FaultSource.WRITE, DiskFault.ENOSPC, "full")
    change = health.failed(FaultSource.FILE, DiskFault.REPLACED, "replaced")
    assert change is not None
    assert change.after is not None
    assert change.after.fault is DiskFault.REPLACED
    # write-back recovering does not make a lost file healthy
    assert health.cleared(FaultSource.WRITE) is None
    assert health.condition is not None
    assert health.condition.fault is DiskFault.REPLACED
    # and a write fault under a lost file changes nothing that is logged
    assert health.failed(FaultSource.WRITE, DiskFault.EIO, "refused") is None


def test_errors_map_to_faults() -> None:
    assert fault_of(NoSpaceError("no slot")) is DiskFault.ENOSPC
    assert fault_of(MediumFullError("full")) is DiskFault.ENOSPC
    assert fault_of(StorageIOError("[Errno 5]")) is DiskFault.EIO
    lost = DataFileLostError(DiskFault.REMOVED, "gone")
    assert fault_of(lost) is DiskFault.REMOVED
    assert lost.errno == StorageIOError.errno  # EIO on the wire


def test_probes_fail_while_the_disk_fails_and_recover() -> None:
    readiness = Readiness()
    readiness.phase = DaemonPhase.SERVING
    readiness.socket = "/run/kvtierd/kvtierd.sock"
    health = readiness.disk = DiskHealth(PATH)
    assert readiness.health().ok
    assert readiness.ready().ok
    health.failed(FaultSource.WRITE, DiskFault.ENOSPC, "the file system is full")
    verdict = readiness.health()
    assert (verdict.ok, verdict.status) == (False, "failing")
    assert "enospc" in verdict.reason
    assert "free space" in verdict.reason
    ready = readiness.ready()
    assert (ready.ok, ready.status) == (False, "degraded")
    assert ready.reason.startswith("serving on /run/kvtierd/kvtierd.sock; ")
    health.cleared(FaultSource.WRITE)
    assert readiness.health().ok
    assert readiness.ready() == readiness.ready()
    assert readiness.ready().status == "ready"
    # stopping still wins over a failing disk on /ready
    health.failed(FaultSource.FILE, DiskFault.REMOVED, "gone")
    readiness.stop()
    assert readiness.ready().status == "stopping"
    assert readiness.health().status == "failing"


@pytest.mark.parametrize("fault", [DiskFault.TRUNCATED, DiskFault.DAMAGED])
def test_a_file_changed_in_place_never_clears_and_says_move_it_aside(fault: DiskFault) -> None:
    health = DiskHealth(PATH)
    change = health.failed(FaultSource.FILE, fault, "changed in place")
    assert change is not None
    assert change.after is not None
    assert not change.after.clears
    message = change.message()
    assert f"({fault.value})" in message
    assert "until kvtierd is restarted" in message
    assert f"move {PATH} aside" in message
    assert "nvme.reinitialize_unreadable" in message
    assert health.cleared(FaultSource.FILE) is None
    refusal = health.refusal()
    assert refusal is not None
    assert refusal.fault is fault


def test_a_catalog_that_cannot_be_rewritten_refuses_fsync_until_one_can() -> None:
    health = DiskHealth(PATH)
    health.failed(FaultSource.WRITE, DiskFault.ENOSPC, "full")
    change = health.failed(FaultSource.CATALOG, DiskFault.CATALOG, "rewriting it failed")
    assert change is not None
    assert change.after is not None
    assert change.after.fault is DiskFault.CATALOG  # worse than a failing write-back
    assert change.after.clears
    assert "until it clears" in change.message()
    assert "rewrites it" in change.message()
    refusal = health.refusal()
    assert refusal is not None
    assert refusal.source is FaultSource.CATALOG
    back = health.cleared(FaultSource.CATALOG)
    assert back is not None
    assert back.after is not None
    assert back.after.fault is DiskFault.ENOSPC  # write-back's condition still holds
    assert health.refusal() is None
    # a lost data file outranks the catalog
    health.failed(FaultSource.CATALOG, DiskFault.CATALOG, "again")
    health.failed(FaultSource.FILE, DiskFault.DAMAGED, "overwritten")
    assert health.condition is not None
    assert health.condition.fault is DiskFault.DAMAGED
    refusal = health.refusal()
    assert refusal is not None
    assert refusal.fault is DiskFault.DAMAGED


def test_every_reason_is_a_label() -> None:
    assert {fault.value for fault in DiskFault} == {
        "enospc", "eio", "replaced", "removed", "truncated", "damaged", "catalog",
    }  # fmt: skip
