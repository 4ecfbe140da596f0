"""Zero-copy access to blocks in the shared arena: a lease to read, a write to fill.

``Namespace.lease(keys)`` and ``Namespace.write(keys)`` hand out views straight into the arena
that the daemon shares with every client, so an engine can copy between the arena and its own
KV cache exactly once (for example one strided ``copy_`` per layer into a torch cache). The views
are only valid while the lease is held or until the write is committed: after that the daemon
may give those bytes to another block.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

from kvtierd.client.arena import copy_verified, scatter_views, target_bytes
from kvtierd.errors import CorruptBlockError, InvalidRequestError, KvtierError
from kvtierd.protocol.messages import Extent
from kvtierd.store.records import checksum

__all__ = ["BlockLease", "BlockWrite", "HeldBlocks", "release_views"]


@dataclass(repr=False, eq=False)  # held by identity (a client keeps a weak set)
class BlockLease:
    """Leased blocks: ``views[i]`` (read-only) and ``extents[i]`` (offset, length, xxh3-64 of
    the committed bytes) for ``keys[i]``. ``release()`` ends the lease; it is idempotent. A
    lease ends with its connection: once the client reconnected to a restarted daemon,
    ``views`` raises ``BrokenConnectionError`` (the new daemon never granted it), and once the
    client is closed, ``ClosedError``.

    ``verified`` is false for a lease taken with ``verify_on_copy``: its blocks were not hashed
    when leased, and :meth:`copy_into` verifies each copy instead, in the pass that makes it
    (an engine that copies every block out pays one pass over memory, not two)."""

    keys: Sequence[bytes]
    extents: list[Extent]
    _views: list[memoryview]
    _release: Callable[[], object] | None = field(default=None)
    #: Why the lease is gone with its connection (replaced or closed), else ``None``.
    lost: KvtierError | None = field(default=None)
    _ended: bool = field(default=False)
    verified: bool = field(default=True)

    @property
    def views(self) -> list[memoryview]:
        if self.lost is not None:
            raise type(self.lost)(*self.lost.args)
        return self._views

    def copy_into(self, i: int, target: object) -> None:
        """Copy block ``i`` into ``target`` (a buffer, a list of buffers it fills in order, or
        :class:`~kvtierd.client.arena.ByteRuns`) and check the copy against the block's
        committed checksum, hashed as it is copied: raises ``CorruptBlockError`` (a miss) when
        a client of the tenant changed the block after COMMIT, ``InvalidRequestError`` when
        ``target`` is too small."""
        targets = scatter_views(target)
        if not copy_verified(self.views[i], targets, self.extents[i].checksum):
            if target_bytes(targets) < self.extents[i].length:
                raise InvalidRequestError(
                    f"block {i} is {self.extents[i].length} bytes: the target is too small"
                )
            raise self._corrupt(i)

    def verify(self, i: int) -> None:
        """Hash block ``i`` where it lies (for a caller whose own copy follows while the block
        is still in cache); raises ``CorruptBlockError`` as :meth:`copy_into` does."""
        if checksum(self.views[i]) != self.extents[i].checksum:
            raise self._corrupt(i)

    def _corrupt(self, i: int) -> CorruptBlockError:
        return CorruptBlockError(
            f"block {bytes(self.keys[i]).hex()} failed its checksum in DRAM (changed after "
            "commit by a client of its tenant): a miss"
        )

    def __repr__(self) -> str:
        state = "lost" if self.lost else "released" if self._ended else "held"
        return f"<BlockLease of {len(self.keys)} blocks, {state}>"

    @property
    def held(self) -> bool:
        """Whether the lease has neither been released nor lost with its connection."""
        return not self._ended

    def release(self) -> None:
        if self._ended:
            return
        self._ended = True
        release, self._release = self._release, None
        release_views(self._views)
        if release is not None:
            release()

    def lose(self, why: KvtierError) -> None:
        """The connection the lease was taken on is gone (``why``), and the daemon released the
        lease with it: invalidate the views and forget the release, which could name a lease
        of another connection."""
        if self._ended:
            return
        self._ended = True
        self.lost = why
        self._release = None
        release_views(self._views)

    def __enter__(self) -> BlockLease:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


@dataclass(repr=False, eq=False)
class BlockWrite:
    """Slots being written: ``views[i]`` is a writable view for ``keys[i]``, or ``None`` where
    that key is already stored (skip it). Committed when the ``with`` block ends normally,
    abandoned (never visible) when it raises; or, from ``Namespace.allocate``, by its
    namespace's ``commit(write)`` or ``abort(write)``."""

    keys: Sequence[bytes]
    views: list[memoryview | None]
    #: The daemon's write ids (ALLOC's) and the connection that granted them (``reconnects``).
    writes: list[int] = field(default_factory=list)
    connection: int = 0
    #: "committed" or "aborted" once ended; a write ends once.
    ended: str = ""

    def __repr__(self) -> str:
        fill = sum(v is not None for v in self.views)
        state = f", {self.ended}" if self.ended else ""
        return f"<BlockWrite of {len(self.keys)} blocks, {fill} to fill{state}>"

    def end(self, how: str) -> None:
        """Mark the write ended (``how``: committed or aborted) and invalidate its views;
        raises ``InvalidRequestError`` if it ended already."""
        if self.ended:
            raise InvalidRequestError(f"this write was {self.ended} already")
        self.ended = how
        release_views(self.views)

    def lose(self, why: KvtierError) -> None:
        """The connection the slots were allocated on is gone (``why``): the daemon may give
        them to other blocks, so the views stop working."""
        release_views(self.views)


def release_views(views: Sequence[memoryview | None]) -> None:
    """Invalidate arena views. A caller's array may still wrap one (it then keeps pointing at
    the arena, which the docs warn about); the lease or write ends regardless."""
    for view in views:
        if view is not None:
            with contextlib.suppress(BufferError):
                view.release()


HeldT = TypeVar("HeldT", BlockLease, BlockWrite)


class HeldBlocks:
    """The leases and writes a client granted on its current connection, held weakly (one the
    caller dropped needs no invalidating), so that a reconnect or a close ends them all."""

    def __init__(self) -> None:
        self._held: weakref.WeakSet[BlockLease | BlockWrite] = weakref.WeakSet()

    def track(self, held: HeldT) -> HeldT:
        """Keep ``held`` to invalidate its views when its connection goes; returns it."""
        self._held.add(held)
        return held

    def lose_all(self, why: KvtierError) -> None:
        """The connection that granted them is gone: their views must not show, or write,
        bytes the daemon may already have given to another block."""
        for held in list(self._held):
            held.lose(why)
        self._held.clear()
