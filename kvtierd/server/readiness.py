"""Whether the daemon is alive, and whether it serves: what ``/health``, ``/ready`` and a client
that connects too early are told.

Theory of operation. The daemon goes through three phases, :class:`DaemonPhase`: ``starting``
(the socket is bound, the store is opening: every connection gets the ``EAGAIN`` fatal frame of
:class:`~kvtierd.errors.StartingError` saying how far the opening has come), ``serving``, and
``stopping`` (from SIGTERM on). Only the event loop changes the phase; the probe endpoint's
threads read it (one attribute, replaced whole).

Liveness is a heartbeat: a task on the event loop calls :meth:`Readiness.beat` every
:data:`BEAT_S`; a thread that finds the last beat older than :data:`STALE_S` knows the loop is
blocked (or dead) without touching it. Being alive says nothing about serving: a daemon
pre-faulting its arena for a minute is alive and not ready.

Acknowledged data at risk is the other way to fail: while the disk tier's health
(:class:`~kvtierd.store.diskhealth.DiskHealth`, its ``condition`` replaced whole by the loop)
holds a condition (write-back failing with ENOSPC or EIO, a failed sync, the data file replaced
or removed), ``/health`` answers 503 ``failing`` and ``/ready`` 503 ``degraded``, each with the
condition and its remedy; they return to 200 when the condition clears, which a replaced or
removed data file or a failed sync never does before a restart.
"""

from __future__ import annotations

import enum
import json
import time
from dataclasses import dataclass

from kvtierd.errors import StartingError
from kvtierd.store.diskhealth import DiskCondition, DiskHealth
from kvtierd.store.lifecycle import OpenProgress

__all__ = ["BEAT_S", "STALE_S", "DaemonPhase", "PoolView", "Readiness", "Verdict"]

#: How often the event loop beats the heartbeat.
BEAT_S = 0.5
#: A heartbeat older than this means the event loop is blocked: ``/health`` answers 503.
STALE_S = 5.0


class DaemonPhase(enum.StrEnum):
    STARTING = "starting"
    SERVING = "serving"
    STOPPING = "stopping"


@dataclass(frozen=True, slots=True)
class PoolView:
    """The pool's state as the last snapshot saw it (``state`` as ``kvtierctl pool status``)."""

    state: str
    reason: str
    epoch: int


@dataclass(frozen=True, slots=True)
class Verdict:
    """One probe's answer: ``ok`` gives HTTP 200, else 503; :meth:`body` is its JSON line."""

    ok: bool
    status: str
    reason: str

    def body(self) -> bytes:
        return (json.dumps({"status": self.status, "reason": self.reason}) + "\n").encode()


class Readiness:
    """The daemon's phase, its store's opening progress, and the event loop's heartbeat."""

    def __init__(self, progress: OpenProgress | None = None) -> None:
        self.progress = progress if progress is not None else OpenProgress()
        self.phase = DaemonPhase.STARTING
        #: What the last metrics snapshot saw of the pool; ``None``: no pool configured.
        self.pool: PoolView | None = None
        #: The disk tier's health, once serving with an NVMe tier.
        self.disk: DiskHealth | None = None
        self.socket = ""
        self._last_beat_s = time.monotonic()

    # -- written by the event loop -----------------------------------------------------------

    def beat(self) -> None:
        self._last_beat_s = time.monotonic()

    def serve(self, socket: str, disk: DiskHealth | None) -> None:
        """Serving on ``socket``, its disk tier's health ``disk`` (``None``: no disk tier)."""
        self.disk = disk
        self.socket = socket
        self.phase = DaemonPhase.SERVING

    def stop(self) -> None:
        self.phase = DaemonPhase.STOPPING

    # -- read from anywhere ------------------------------------------------------------------

    def starting_error(self) -> StartingError:
        """What a connection made while starting is told (its fatal frame)."""
        return StartingError(f"starting: {self.progress.describe()}")

    def heartbeat_age_s(self) -> float:
        return max(0.0, time.monotonic() - self._last_beat_s)

    def disk_condition(self) -> DiskCondition | None:
        """What puts acknowledged data at risk now; ``None`` while the disk tier is healthy."""
        disk = self.disk
        return disk.condition if disk is not None else None

    def health(self) -> Verdict:
        """``/health``: the process and its event loop are alive, and the disk tier keeps what
        it acknowledged."""
        age_s = self.heartbeat_age_s()
        if age_s > STALE_S:
            return Verdict(False, "blocked", f"event loop blocked for {age_s:.0f} s")
        condition = self.disk_condition()
        if condition is not None:
            return Verdict(False, "failing", f"{condition.describe()}; {condition.remedy}")
        return Verdict(True, "ok", f"event loop alive ({self.phase.value})")

    def ready(self) -> Verdict:
        """``/ready``: start-up finished, serving, not stopping, acknowledged data safe. A pool
        that is configured and not attached leaves the daemon ready (it serves from its local
        tiers), degraded; a failing disk tier makes it degraded and not ready."""
        phase = self.phase
        if phase is DaemonPhase.STARTING:
            return Verdict(False, "starting", f"starting: {self.progress.describe()}")
        if phase is DaemonPhase.STOPPING:
            return Verdict(False, "stopping", "stopping: draining connections, writing back")
        condition = self.disk_condition()
        if condition is not None:
            return Verdict(False, "degraded", f"serving on {self.socket}; {condition.describe()}")
        pool = self.pool
        serving = f"serving on {self.socket}"
        if pool is None:
            return Verdict(True, "ready", serving)
        if pool.state == "attached":
            return Verdict(True, "ready", f"{serving}; pool attached (epoch {pool.epoch})")
        why = f" ({pool.reason})" if pool.reason else ""
        return Verdict(True, "degraded", f"{serving} from the local tiers; pool {pool.state}{why}")
