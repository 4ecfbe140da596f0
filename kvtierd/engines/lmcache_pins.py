"""LMCache's lookup pins, backed by kvtierd leases (for :mod:`kvtierd.engines.lmcache`).

LMCache's engine pins what its lookup found until it has retrieved it: ``contains(pin=True)``,
then one ``unpin`` per key the lookup reported as a hit. The plug-in backs the pin of a chunk
already in DRAM with a READ_RESIDENT lease, so that the retrieve makes its memory object with no
request to the daemon and no eviction can take it first. A hit that is not leased (on NVMe, or
past the budget) still gets a pin, an empty one, so that its ``unpin`` never takes a lease that
another lookup's pin of the same key holds.

A lease is shared (:class:`SharedLease`) by the pins made with it and by the memory objects made
from it (whose "allocator" it is), and RELEASEd when the last of them lets go: an unpin before
LMCache has freed the objects of a retrieve never pulls the bytes from under them. At most
``budget_blocks`` blocks are held by pin leases, counted until each lease is released, so that
pins LMCache never undoes cannot fill the arena.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from kvtierd.client import BlockLease
from kvtierd.errors import KvtierError
from kvtierd.protocol.messages import Extent

__all__ = ["PinTable", "SharedLease"]


class SharedLease:
    """A lease with several holders, RELEASEd (``release``) when the last one lets go; then
    ``on_released`` runs. ``release`` must not wait for the connection (the last holder can be
    a finalizer inside a call): the client's ``release_soon``."""

    def __init__(
        self,
        release: Callable[[], object],
        holders: int,
        on_released: Callable[[], object] | None = None,
    ) -> None:
        self._release = release
        self._holders = holders
        self._on_released = on_released
        # Re-entrant: LMCache frees memory objects from __del__, which the garbage collector
        # may run on a thread that holds this lock already.
        self._lock = threading.RLock()

    def hold(self) -> None:
        with self._lock:
            self._holders += 1

    def let_go(self) -> None:
        with self._lock:
            self._holders -= 1
            if self._holders:
                return
        try:
            with contextlib.suppress(KvtierError):  # a closed connection released it already
                self._release()
        finally:
            if self._on_released is not None:
                self._on_released()

    def free(self, memory_obj: Any) -> None:
        """LMCache's allocator interface: a memory object made from this lease is freed."""
        with self._lock:
            if not memory_obj.is_valid():  # freed already (LMCache's __del__ frees again)
                return
            memory_obj.invalidate()
        self.let_go()


@dataclass(frozen=True, slots=True)
class _Pin:
    lease: SharedLease | None
    extent: Extent | None


PinKey = tuple[int, bytes]
"""(namespace handle, block key)."""


class PinTable:
    """The pins held on one connection; thread-safe (LMCache calls from several threads)."""

    def __init__(self, budget_blocks: int) -> None:
        self.budget_blocks = budget_blocks
        self.held_blocks = 0
        """Blocks of pin leases not released yet (reserved ones included)."""
        self._pins: dict[PinKey, list[_Pin]] = {}
        self._lock = threading.RLock()  # re-entrant, as SharedLease's (a finalizer may unreserve)

    def reserve(self, wanted: int) -> int:
        """Room for up to ``wanted`` leased blocks within the budget; give back what goes
        unused through :meth:`add` (or :meth:`unreserve`)."""
        with self._lock:
            granted = max(0, min(wanted, self.budget_blocks - self.held_blocks))
            self.held_blocks += granted
            return granted

    def unreserve(self, count: int) -> None:
        with self._lock:
            self.held_blocks -= count

    def add(
        self, handle: int, keys: Sequence[bytes], lease: BlockLease | None, reserved: int
    ) -> list[tuple[PinKey, _Pin]]:
        """One pin per key of a lookup's hits: the first ``len(lease.extents)`` backed by
        ``lease`` (taken within ``reserved``), the others empty. Returns them, for :meth:`undo`."""
        extents = lease.extents if lease is not None else []
        self.unreserve(reserved - len(extents))
        shared = None
        if lease is not None and extents:
            count = len(extents)
            shared = SharedLease(lease.release, count, lambda: self.unreserve(count))
        added = [
            ((handle, key), _Pin(shared, extents[i]) if i < len(extents) else _Pin(None, None))
            for i, key in enumerate(keys)
        ]
        with self._lock:
            for pin_key, pin in added:
                self._pins.setdefault(pin_key, []).append(pin)
        return added

    def undo(self, added: list[tuple[PinKey, _Pin]]) -> None:
        """Take back pins from :meth:`add` (a lookup that failed after pinning)."""
        for pin_key, pin in added:
            with self._lock:
                pins = self._pins.get(pin_key, [])
                if pin not in pins:
                    continue
                pins.remove(pin)
                if not pins:
                    del self._pins[pin_key]
            if pin.lease is not None:
                pin.lease.let_go()

    def unpin(self, handle: int, key: bytes) -> None:
        """One pin of ``key`` undone: an empty one first, so that leases last longest."""
        with self._lock:
            pins = self._pins.get((handle, key))
            if not pins:
                return
            empty = next((i for i, p in enumerate(pins) if p.lease is None), None)
            pin = pins.pop(len(pins) - 1 if empty is None else empty)
            if not pins:
                del self._pins[(handle, key)]
        if pin.lease is not None:
            pin.lease.let_go()

    def take(self, handle: int, keys: Sequence[bytes]) -> list[tuple[SharedLease, Extent]]:
        """The leased pins of the leading ``keys`` that have one (the newest of each key), each
        held once more for the memory object the caller makes from it."""
        taken: list[tuple[SharedLease, Extent]] = []
        with self._lock:
            for key in keys:
                pins = self._pins.get((handle, key), [])
                pin = next((p for p in reversed(pins) if p.lease is not None), None)
                if pin is None or pin.lease is None or pin.extent is None:
                    break
                pin.lease.hold()
                taken.append((pin.lease, pin.extent))
        return taken
