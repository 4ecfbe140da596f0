"""The client's mappings of its tenants' DRAM regions, and byte views of caller buffers.

The daemon passes a tenant's region (a sealed memfd) with every OPEN_NS reply that admits
the client to that tenant; the client maps it shared (pre-faulting the page tables, about 60 ms
per GiB, so that the first copies run at memory speed) and from then on moves blocks with plain
memory copies at the offsets the daemon names. On a CUDA host an engine can register a mapping
as pinned memory (``cudaHostRegister``) and copy straight to HBM.

Readers verify: every block copied or leased out of a region is hashed (xxh3-64) against the
checksum the daemon took at COMMIT, because any client of the same tenant can write to the
region; a block that does not match is a miss (:func:`verified_prefix`). A copy is hashed in
the same pass that makes it (:func:`copy_verified`), so verifying costs no second read.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvtierd.errors import ClosedError, InvalidRequestError, KvtierError, RemoteProtocolError
from kvtierd.protocol.messages import Extent
from kvtierd.store.arena import map_region
from kvtierd.store.copyhash import (
    copy_checksum,
    copy_checksum_runs,
    copy_checksum_scatter,
    default_hasher,
)
from kvtierd.store.records import checksum

__all__ = [
    "ByteRuns",
    "ClientArena",
    "as_bytes_view",
    "copy_verified",
    "scatter_views",
    "target_bytes",
    "verified_prefix",
]


def as_bytes_view(obj: Any, *, writable: bool = False) -> memoryview:
    """A flat byte view of a C-contiguous buffer (bytes, bytearray, memoryview, numpy array)."""
    try:
        view = memoryview(obj)
    except TypeError:
        raise InvalidRequestError(f"{type(obj).__name__} does not expose a buffer") from None
    if not view.c_contiguous:
        raise InvalidRequestError("blocks must be C-contiguous")
    if writable and view.readonly:
        raise InvalidRequestError("the destination buffer is read-only")
    return view.cast("B") if view.format != "B" or view.ndim != 1 else view


class ClientArena:
    """One tenant region as mapped in this process; owns the received descriptor."""

    def __init__(self, fd: int, size_bytes: int) -> None:
        self.fd = fd
        self.size_bytes = size_bytes
        try:
            self._mapping = map_region(fd, size_bytes)
        except (OSError, ValueError) as exc:
            os.close(fd)
            raise RemoteProtocolError(f"cannot map the region the daemon passed: {exc}") from exc
        self._view = memoryview(self._mapping)
        #: Why the mapping is closed (the client closed, or its connection was replaced).
        self._closed: KvtierError | None = None
        # Start the copy kernel's probe (a child, in the background) now that blocks will be
        # copied: started by the first copy instead, it had not settled under load when an
        # engine's first prefetch came, and those copies ran in Python at a third of the speed.
        default_hasher().verdict()

    def _check(self, offset: int, length: int) -> None:
        self._check_open()
        if offset < 0 or length < 0 or offset + length > self.size_bytes:
            raise RemoteProtocolError(f"extent [{offset}, {offset + length}) outside the arena")

    def write(self, offset: int, data: memoryview) -> None:
        self._check(offset, len(data))
        self._view[offset : offset + len(data)] = data

    def view(self, offset: int, length: int) -> memoryview:
        """A read-only view of arena bytes (valid while their lease is held)."""
        self._check(offset, length)
        return self._view[offset : offset + length].toreadonly()

    def writable(self, offset: int, length: int) -> memoryview:
        """A writable view of an allocated slot (valid until its write is committed)."""
        self._check(offset, length)
        return self._view[offset : offset + length]

    def buffer(self) -> memoryview:
        """The whole region, read-only: an engine may wrap it once (``torch.frombuffer``) and
        index it with the extents of its leases instead of making a view per block."""
        self._check_open()
        return self._view.toreadonly()

    def _check_open(self) -> None:
        if self._closed is not None:
            raise type(self._closed)(*self._closed.args)

    def close(self, why: KvtierError | None = None) -> None:
        """Unmap; every later use raises ``why`` (default ``ClosedError``)."""
        self._closed = why or ClosedError("the client is closed")
        self._view.release()
        with contextlib.suppress(BufferError):  # a caller's view keeps the mapping alive
            self._mapping.close()
        os.close(self.fd)


def verified_prefix(views: list[memoryview], extents: list[Extent]) -> int:
    """How many leading ``views`` hash to their extent's checksum (the rest are misses)."""
    for i, (view, extent) in enumerate(zip(views, extents, strict=True)):
        if checksum(view) != extent.checksum:
            return i
    return len(views)


@dataclass(frozen=True)
class ByteRuns:
    """Equal runs of one writable buffer that a block fills in order: ``storage[o : o +
    length]`` for each ``o`` in ``offsets`` (a strided page of an engine's host pool, one run
    per layer and K/V). Copied in one call into the native kernel however many runs there are,
    where a list of views costs a Python step per run (about 3 us each: 56 runs of 8 KiB took
    longer to describe than to copy)."""

    storage: memoryview
    offsets: Sequence[int]
    length: int


def scatter_views(target: Any) -> list[memoryview] | ByteRuns:
    """The writable byte views of a destination: one buffer, or a list or tuple of buffers that
    a block fills in order (the contiguous runs of a strided cache page); :class:`ByteRuns`
    are passed through (their storage made a writable byte view)."""
    if isinstance(target, ByteRuns):
        return ByteRuns(as_bytes_view(target.storage, writable=True), target.offsets, target.length)
    parts = target if isinstance(target, (list, tuple)) else [target]
    return [as_bytes_view(part, writable=True) for part in parts]


def target_bytes(targets: Sequence[memoryview] | ByteRuns) -> int:
    """How many bytes ``targets`` (from :func:`scatter_views`) hold."""
    if isinstance(targets, ByteRuns):
        return len(targets.offsets) * targets.length
    return sum(len(t) for t in targets)


def copy_verified(
    source: memoryview, targets: Sequence[memoryview] | ByteRuns, expected: int
) -> bool:
    """Copy ``source`` into ``targets`` in order (together at least as long) and tell whether
    the bytes now in them hash to ``expected``. The copy is hashed, not the source: what the
    check describes is exactly what the caller got, whatever a client of the same tenant
    writes to the arena meanwhile. One pass over memory (:mod:`kvtierd.store.copyhash`):
    each stripe is hashed from the registers it is stored from, as fast as a plain copy.
    Raises ``InvalidRequestError`` for runs outside their storage."""
    if isinstance(targets, ByteRuns):
        try:
            copied, digest = copy_checksum_runs(
                targets.storage, targets.offsets, targets.length, source
            )
        except ValueError as exc:
            raise InvalidRequestError(f"the destination's runs: {exc}") from None
        return copied == len(source) and digest == expected
    if len(targets) == 1:
        target = targets[0][: len(source)]
        return len(target) == len(source) and copy_checksum(target, source) == expected
    copied, digest = copy_checksum_scatter(targets, source)
    return copied == len(source) and digest == expected
