"""When to start a dead exporter again (pure: times in, delays out).

An exporter that dies soon after it started (a tenant's client that makes it fault again and
again, or a host where it cannot start) is started again after a delay that doubles with each
such death, up to :attr:`RestartBackoff.max_s`; one that served for
:attr:`RestartBackoff.healthy_s` or longer before dying counts as healthy, and starts the
count again.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["RestartBackoff"]


@dataclass
class RestartBackoff:
    """The delay before each restart; :meth:`died` records a death and returns it."""

    first_s: float = 0.5
    max_s: float = 30.0
    healthy_s: float = 30.0
    #: Deaths in a row, each within ``healthy_s`` of its start.
    streak: int = 0

    def __post_init__(self) -> None:
        if not 0 < self.first_s <= self.max_s or self.healthy_s <= 0:
            raise ValueError(f"a back-off of {self.first_s} to {self.max_s} s is not one")

    def died(self, lived_s: float) -> float:
        """A process that ``lived_s`` seconds died: how long to wait before the next start."""
        self.streak = 1 if lived_s >= self.healthy_s else self.streak + 1
        return min(self.max_s, self.first_s * 2.0 ** (self.streak - 1))
