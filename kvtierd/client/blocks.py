"""Zero-copy access to blocks in the shared arena: a lease to read, a write to fill.

``Namespace.lease(keys)`` and ``Namespace.write(keys)`` hand out views straight into the arena
that the daemon shares with every client, so an engine can copy between the arena and its own
KV cache exactly once (for example one strided ``copy_`` per layer into a torch cache). The views
are only valid while the lease is held or until the write is committed: after that the daemon
may give those bytes to another block.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from kvtierd.protocol.messages import Extent

__all__ = ["BlockLease", "BlockWrite", "release_views"]


@dataclass
class BlockLease:
    """Leased blocks: ``views[i]`` (read-only) and ``extents[i]`` (offset, length, xxh3-64 of
    the committed bytes) for ``keys[i]``. ``release()`` ends the lease; it is idempotent."""

    keys: Sequence[bytes]
    extents: list[Extent]
    views: list[memoryview]
    _release: Callable[[], object] | None = field(default=None, repr=False)

    def release(self) -> None:
        if self._release is None:
            return
        release, self._release = self._release, None
        release_views(self.views)
        release()

    def __enter__(self) -> BlockLease:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


@dataclass
class BlockWrite:
    """Slots being written: ``views[i]`` is a writable view for ``keys[i]``, or ``None`` where
    that key is already stored (skip it). Committed when the ``with`` block ends normally,
    abandoned (never visible) when it raises."""

    keys: Sequence[bytes]
    views: list[memoryview | None]


def release_views(views: Sequence[memoryview | None]) -> None:
    """Invalidate arena views. A caller's array may still wrap one (it then keeps pointing at
    the arena, which the docs warn about); the lease or write ends regardless."""
    for view in views:
        if view is not None:
            with contextlib.suppress(BufferError):
                view.release()
