"""The contract between the store and its cache policies: what a policy implements, what it is told.

A policy is the pure decision-maker behind admission and eviction of a tier. It never touches
memory, disks or clocks. The store tells it what happened (a block was inserted, read, removed)
with the time as an argument, and asks it what to do (admit this block? which blocks to evict?).
The store then carries the decision out. This keeps each policy testable against hand-made
sequences and replayable on traces, and lets the SLSAP reuse model replace plain LRU without the
store changing.

This module sits below both sides: the store (``kvtierd.store``), the pure engines that implement
policies (``kvtierd.slsap``) and trace replay (``kvtierd.replay``) import it, and it imports none
of them.

Blocks are identified by any hashable value (the store uses its index entries' ids). Sizes are
not a policy concern: the store asks for victims among blocks of one size class.
"""

from __future__ import annotations

import abc
import enum
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import ClassVar

__all__ = ["PROMOTED_REQUEST", "PROMOTION", "AccessContext", "CachePolicy", "ServedBy"]


class ServedBy(enum.IntEnum):
    """The tier that served an access (or ``MISS``)."""

    DRAM = 0
    NVME = 1
    POOL = 2
    MISS = 3


@dataclass(frozen=True, slots=True)
class AccessContext:
    """What the store knows about an access beyond the block itself (telemetry for SLSAP).

    ``request_id`` groups the blocks one LOOKUP/READ named, ``session`` is the engine's session id
    from HINT (empty when unknown), ``position`` the block's index in its prefix.
    """

    request_id: int = 0
    session: bytes = b""
    position: int = 0
    served_by: ServedBy = ServedBy.DRAM


#: ``request_id`` of an insertion that is no access: the block was promoted into the tier
#: (prefetch, a LOOKUP's or HINT's promotion, a reuse guess) and nobody has read it yet.
PROMOTED_REQUEST = -2
PROMOTION = AccessContext(PROMOTED_REQUEST)


class CachePolicy(abc.ABC):
    """The contract every admission/eviction policy meets. All methods are synchronous and pure."""

    #: Whether it keeps state per block and so must be told of every block a tier recovers
    #: (:func:`~kvtierd.store.adoption.adopt_recovered`); a policy over a tier's own rows (CLOCK)
    #: reads them instead.
    recovers_by_insertion: ClassVar[bool] = True

    @abc.abstractmethod
    def admit(self, block: Hashable, now: float, context: AccessContext | None = None) -> bool:
        """Whether ``block``, which is not cached, deserves a place (may displace others)."""

    @abc.abstractmethod
    def inserted(self, block: Hashable, now: float, context: AccessContext | None = None) -> None:
        """``block`` now occupies a place in the tier."""

    @abc.abstractmethod
    def accessed(self, block: Hashable, now: float, context: AccessContext | None = None) -> None:
        """``block``, which is cached, was read."""

    @abc.abstractmethod
    def removed(self, block: Hashable) -> None:
        """``block`` left the tier (evicted, forgotten or lost); forget its place."""

    def hold(self, block: Hashable) -> None:
        """``block``, cached, cannot be evicted until :meth:`release` (the store holds a block
        whose only copy is still to be written back). ``victims`` never offers what
        ``evictable`` refuses, so a policy may ignore this (the default); one that keeps held
        blocks out of its candidates instead finds a victim among many held blocks without
        asking about each of them in turn. A new :meth:`inserted` of ``block`` ends a hold."""
        return None

    def release(self, block: Hashable) -> None:
        """``block`` may be evicted again (it was written back); see :meth:`hold`."""
        return None

    @abc.abstractmethod
    def victims(self, count: int, evictable: Callable[[Hashable], bool]) -> list[Hashable]:
        """Up to ``count`` cached blocks to evict, best victim first, all satisfying ``evictable``.

        Returns fewer when fewer cached blocks are evictable. Does not remove them: the store
        calls :meth:`removed` once each is really gone.
        """

    @abc.abstractmethod
    def __len__(self) -> int:
        """How many blocks the policy tracks as cached."""
