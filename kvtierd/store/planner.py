"""Residency planned by a pure function: which DRAM copies to evict so that a block fits.

:func:`reserve` decides against the region's :class:`~kvtierd.store.slots.SlotAllocator` (itself
pure: it decides where bytes go and never touches memory) and the policy's victims, and returns
a :class:`Reservation`: the slot, and the blocks whose slots it freed to make room, in the order
it chose them. It touches no block and does no I/O;
:class:`~kvtierd.store.residency.Residency` carries the evictions out (drops the copies, tells
the policy, counts them). The tests check it with hypothesis against a dict model of the region.

The rule, as the store has always applied it: take a free slot when there is one; else evict
up to a batch of victims of the same size class (their slots are reused as they are), else one
victim of any class (its slot merges with free neighbours), and try again, until the slot fits
or no candidate is left.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Generic, TypeVar

from kvtierd.store.slots import Slot, SlotAllocator

__all__ = ["Reservation", "reserve"]

T = TypeVar("T", bound=Hashable)

#: ``victims(n, eligible)``: up to ``n`` candidates the policy would evict first, of those
#: ``eligible`` accepts.
Victims = Callable[[int, Callable[[T], bool]], list[T]]


@dataclass(frozen=True, slots=True)
class Reservation(Generic[T]):
    #: The slot reserved, or ``None`` when no room could be made.
    slot: Slot | None
    #: The candidates whose slots were freed to make room (evicted even when ``slot`` is
    #: ``None``: the room they left stays free for the next request).
    evictions: tuple[T, ...]


def reserve(
    allocator: SlotAllocator,
    nbytes: int,
    victims: Victims[T],
    slot_of: Callable[[T], Slot],
    *,
    batch: int = 16,
) -> Reservation[T]:
    """A slot of ``nbytes`` in ``allocator``, freeing the slots of ``victims`` as needed
    (``slot_of``: a candidate's slot)."""
    size = allocator.size_class(nbytes)
    chosen: list[T] = []
    taken: set[T] = set()
    slot = allocator.allocate(nbytes)
    while slot is None:
        fresh = [
            v
            for v in victims(batch, lambda c: c not in taken and slot_of(c).size == size)
            or victims(1, lambda c: c not in taken)
            if v not in taken
        ]
        if not fresh:
            break
        for victim in fresh:
            allocator.free(slot_of(victim))
            taken.add(victim)
            chosen.append(victim)
        slot = allocator.allocate(nbytes)
    return Reservation(slot, tuple(chosen))
