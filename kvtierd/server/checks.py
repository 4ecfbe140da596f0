"""The vocabulary of the host report: one :class:`HostCheck` per subject, its status, who must
act on a failure, and the report as text. :mod:`kvtierd.server.preflight` makes the start-up
checks, :mod:`kvtierd.server.doctor` the running daemon's; ``kvtierd --check`` and
``kvtierctl doctor`` print them.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass

__all__ = ["CheckStatus", "Fault", "HostCheck", "exit_status", "render", "size_text"]


class CheckStatus(enum.StrEnum):
    OK = "ok"
    #: The daemon runs, without something it would use.
    FALLBACK = "fallback"
    #: The daemon would not start.
    FAIL = "fail"
    #: Not checked, because what it depends on failed.
    SKIPPED = "skipped"


class Fault(enum.IntEnum):
    """Who must act on a failure, as the exit status says it."""

    ENVIRONMENT = 1
    CONFIGURATION = 2


@dataclass(frozen=True, slots=True)
class HostCheck:
    """One line of the report: ``subject`` (``memory``, ``socket``, ...) and what was found."""

    subject: str
    status: CheckStatus
    detail: str
    fault: Fault | None = None


def size_text(nbytes: int) -> str:
    """``1.5 GiB``, ``512 MiB``, ``8 KiB``."""
    for unit, shift in (("TiB", 40), ("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if nbytes >= 1 << shift:
            value = nbytes / (1 << shift)
            exact = value == int(value) or value >= 100
            return f"{value:.0f} {unit}" if exact else f"{value:.1f} {unit}"
    return f"{nbytes} B"


def exit_status(checks: Iterable[HostCheck]) -> int:
    """2 if the configuration must change, 1 if the environment must, else 0."""
    return max(
        (int(c.fault) for c in checks if c.status is CheckStatus.FAIL and c.fault), default=0
    )


def render(checks: Iterable[HostCheck]) -> str:
    """The report, one aligned line per check."""
    return "\n".join(f"{c.status.value:<9} {c.subject:<9} {c.detail}" for c in checks)
