"""Rate-limited reports: at most one log record per key (a peer's address, a listener) per
period, saying how many of the same kind were held back since the last one.

A port scanner or a flood of junk connections fails thousands of TLS handshakes a second, and
a process out of descriptors fails every accept; a WARNING for each fills the journal and hides
everything else (issue 31 counted 10,247 lines in 20 s). :meth:`Throttle.admit` is the decision
alone (the caller passes the time), :meth:`Throttle.report` logs through it. A throttle
remembers at most ``max_keys`` keys (an attacker controls how many addresses it connects from):
when that many were reported within the period, the others share the key ``"others"``.

One throttle serves one thread: the event loop's, or the metrics listener's.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping

__all__ = ["Throttle"]

#: The key events share once ``max_keys`` keys are remembered.
OTHERS = "others"


class Throttle:
    """One report per key per ``period_s``; the events held back are counted."""

    def __init__(self, period_s: float = 60.0, max_keys: int = 1024) -> None:
        if period_s <= 0 or max_keys < 1:
            raise ValueError(f"period_s {period_s} and max_keys {max_keys} must be positive")
        self.period_s = period_s
        self.max_keys = max_keys
        #: key -> (when it was last reported, events held back since)
        self._last: dict[str, tuple[float, int]] = {}

    def admit(self, key: str, now_s: float) -> int | None:
        """Whether an event of ``key`` at ``now_s`` is reported: ``None`` to hold it back (one
        of ``key`` was reported less than ``period_s`` ago), else how many were held back
        since the last report of ``key`` (0 for its first)."""
        if key not in self._last and len(self._last) >= self.max_keys:
            self._forget_before(now_s - self.period_s)
            if len(self._last) >= self.max_keys:
                key = OTHERS
        reported_s, held = self._last.get(key, (-self.period_s, 0))
        if now_s - reported_s < self.period_s:
            self._last[key] = (reported_s, held + 1)
            return None
        self._last[key] = (now_s, 0)
        return held

    def report(
        self,
        logger: logging.Logger,
        level: int,
        key: str,
        message: str,
        *args: object,
        exc_info: BaseException | None = None,
        extra: Mapping[str, object] | None = None,
    ) -> None:
        """Log ``message % args`` at ``level`` unless :meth:`admit` holds it back; the record
        says how many of ``key`` were held back before it (and carries ``extra``'s fields and
        ``held``, for the structured log formats)."""
        held = self.admit(key, time.monotonic())
        if held is None:
            return
        if held:
            message += " (and %d more from %s since its last report, not logged)"
            args = (*args, held, key)
        fields = {**(extra or {}), "held": held}
        logger.log(level, message, *args, exc_info=exc_info, extra=fields)

    def _forget_before(self, cutoff_s: float) -> None:
        """Drop the keys reported before ``cutoff_s``: their period is over."""
        self._last = {k: v for k, v in self._last.items() if v[0] >= cutoff_s or k == OTHERS}
