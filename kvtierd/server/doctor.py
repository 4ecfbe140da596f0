"""The running daemon's report on its host (``kvtierctl doctor``, the DOCTOR request).

It starts from the start-up checks (:mod:`kvtierd.server.preflight`, as they were when the
daemon started) and replaces what the daemon knows better now that it runs: which disk backend
it uses, how the arena ended up (huge pages, locked), the memory and disk space left, where it
serves metrics, where it stands with the pool, whether its disk tier keeps what it acknowledged
(a failing one fails the ``nvme`` line, with the remedy). :class:`RunningFacts` is taken on the
event loop; :func:`running_report` only reads host files, so it may run in a worker thread.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvtierd import host
from kvtierd.config import Config, TriState
from kvtierd.io import IoBackendKind
from kvtierd.server.checks import CheckStatus, HostCheck, size_text

__all__ = ["RunningFacts", "running_report"]


@dataclass(frozen=True, slots=True)
class RunningFacts:
    """What the daemon knows of itself, copied on the event loop."""

    config: Config
    startup: tuple[HostCheck, ...]
    io_kind: IoBackendKind | None
    fixed_ops: int
    io_ops: int
    arena_bytes: int
    nvme_used_bytes: int
    nvme_capacity_bytes: int
    hugepages: bool
    locked: bool
    pool_state: str
    pool_reason: str
    #: What puts acknowledged data at risk (its description and remedy); empty while healthy.
    disk_failing: str = ""
    #: Why the backend runs without the fixed buffers it supports (``IoBackend``'s
    #: ``fixed_buffers_fallback``); empty while it uses them.
    fixed_fallback: str = ""


def running_report(facts: RunningFacts) -> list[HostCheck]:
    """The start-up checks, with the live lines in place of their start-up counterparts; the
    backend in use follows the io_uring verdict."""
    live = {check.subject: check for check in _live(facts)}
    io = live.pop("io")
    report: list[HostCheck] = []
    for check in facts.startup:
        report.append(live.pop(check.subject, check))
        if check.subject == "io_uring":
            report.append(io)
    return report + list(live.values()) if facts.startup else [io, *live.values()]


def _live(facts: RunningFacts) -> Sequence[HostCheck]:
    config = facts.config
    dram = config.dram
    pages = _arena_feature(
        "hugepages", facts.hugepages, dram.hugepages, "dram.hugepages",
        yes="the arena is on hugetlb pages",
        no="the arena is on ordinary pages (vm.nr_hugepages)",
    )  # fmt: skip
    lock = _arena_feature(
        "mlock", facts.locked, dram.mlock, "dram.mlock",
        yes="the arena is locked in memory",
        no="the arena is not locked: it may be swapped (LimitMEMLOCK)",
    )  # fmt: skip
    checks = [_io(facts), pages, lock, _memory(facts)]
    free = host.free_disk_bytes(config.data_path)
    checks.append(
        HostCheck("data_dir", CheckStatus.OK, f"{config.data_path}: {size_text(free)} free now")
    )
    if facts.nvme_capacity_bytes:
        used, capacity = size_text(facts.nvme_used_bytes), size_text(facts.nvme_capacity_bytes)
        in_use = f"{used} of {capacity} in use"
        if facts.disk_failing:
            checks.append(HostCheck("nvme", CheckStatus.FAIL, f"{facts.disk_failing}; {in_use}"))
        else:
            checks.append(HostCheck("nvme", CheckStatus.OK, in_use))
    if port := config.daemon.metrics_port:
        where = f"http://{config.daemon.metrics_address}:{port}/metrics"
        checks.append(HostCheck("metrics", CheckStatus.OK, f"serving {where}"))
    if config.pool.url:
        status = CheckStatus.OK if facts.pool_state == "attached" else CheckStatus.FALLBACK
        reason = f" ({facts.pool_reason})" if facts.pool_reason else ""
        checks.append(HostCheck("pool", status, f"{facts.pool_state}{reason}"))
    return checks


def _io(facts: RunningFacts) -> HostCheck:
    kind = facts.io_kind
    if kind is None:
        return HostCheck("io", CheckStatus.OK, "no disk backend")
    share = f"{facts.fixed_ops} of {facts.io_ops} transfers used fixed buffers"
    if kind is IoBackendKind.IO_URING and facts.fixed_fallback:
        detail = f"io_uring in use without fixed buffers ({facts.fixed_fallback}); {share}"
        return HostCheck("io", CheckStatus.FALLBACK, detail)
    if kind is IoBackendKind.IO_URING:
        return HostCheck("io", CheckStatus.OK, f"io_uring in use; {share}")
    asked = facts.config.nvme.io_backend
    status = CheckStatus.OK if asked is IoBackendKind.THREADS else CheckStatus.FALLBACK
    return HostCheck("io", status, f"threads in use (nvme.io_backend = {asked.value})")


def _arena_feature(
    subject: str, got: bool, mode: TriState, field: str, *, yes: str, no: str
) -> HostCheck:
    """How the arena ended up on one of its optional features (huge pages, mlock)."""
    if got:
        return HostCheck(subject, CheckStatus.OK, yes)
    if mode is TriState.NEVER:
        return HostCheck(subject, CheckStatus.OK, f"off ({field} = never)")
    return HostCheck(subject, CheckStatus.FALLBACK, no)


def _memory(facts: RunningFacts) -> HostCheck:
    available = host.memory_available()
    shown = "unknown" if available is None else size_text(available)
    return HostCheck(
        "memory",
        CheckStatus.OK,
        f"the arena holds {size_text(facts.arena_bytes)}; {shown} available besides it",
    )
