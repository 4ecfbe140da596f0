"""Lossless block compression (zstd) and checksums off the event loop, shared by every tier.

One compressor and decompressor per thread: a ``ZstdCompressor`` shared between threads crashes
the process. Large blocks are hashed in a worker thread so the loop keeps serving.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import anyio
import zstandard

from kvtierd.store.copyhash import copy_checksum
from kvtierd.store.records import checksum

__all__ = [
    "THREAD_CHECKSUM_BYTES",
    "checksum_off_loop",
    "checksums_off_loop",
    "compress",
    "copy_checksum_off_loop",
    "decompress_into",
]

#: Below this many bytes hashing is cheaper than a hop to a worker thread: xxh3 runs at 20-50
#: GB/s here (1 MiB in 20-50 us, the event loop held that long), a ``to_thread`` hop costs
#: 130-220 us and, with a READ's blocks hashed at once, starts dozens of threads.
THREAD_CHECKSUM_BYTES = 1 << 20
_local = threading.local()


def _codec() -> tuple[zstandard.ZstdCompressor, zstandard.ZstdDecompressor]:
    if not hasattr(_local, "codec"):
        _local.codec = (zstandard.ZstdCompressor(level=1), zstandard.ZstdDecompressor())
    return _local.codec  # type: ignore[no-any-return]


def compress(data: bytes | memoryview) -> bytes:
    """A zstd frame of ``data`` (call from a worker thread for large blocks)."""
    return _codec()[0].compress(data)


def decompress_into(data: bytes | memoryview, dest: memoryview) -> int:
    """Decompress a frame into ``dest``; the number of bytes written. Raises
    ``zstandard.ZstdError`` for a damaged frame or one larger than ``dest``."""
    raw = _codec()[1].decompress(data, max_output_size=len(dest))
    dest[: len(raw)] = raw
    return len(raw)


async def checksum_off_loop(view: bytes | memoryview) -> int:
    if len(view) < THREAD_CHECKSUM_BYTES:
        return checksum(view)
    return await anyio.to_thread.run_sync(checksum, view)


def _checksums(views: Sequence[memoryview]) -> list[int]:
    return [checksum(view) for view in views]


async def checksums_off_loop(views: Sequence[memoryview]) -> list[int]:
    """The xxh3-64 of each of ``views``: in one worker thread hop for them all once they
    pass :data:`THREAD_CHECKSUM_BYTES` together (a run of blocks read in one request), so
    the hop is paid once per run, not once per block. A batch of exactly that much (16 cold
    64 KiB blocks, one staging run) is hashed on the loop: about 90-100 us there, a tenth of
    a loop slice, where the hop cost about 70 us more CPU per batch (8 % of a 64 KiB READ)."""
    if sum(len(view) for view in views) <= THREAD_CHECKSUM_BYTES:
        return _checksums(views)
    return await anyio.to_thread.run_sync(_checksums, views)


async def copy_checksum_off_loop(dest: memoryview, source: memoryview) -> int:
    """Copy ``source`` into ``dest`` (same length) and hash the copy in the same pass
    (:mod:`kvtierd.store.copyhash`): the checksum describes exactly the bytes now in ``dest``,
    whatever happens to ``source`` meanwhile, for what the copy alone costs."""
    if len(source) < THREAD_CHECKSUM_BYTES:
        return copy_checksum(dest, source)
    return await anyio.to_thread.run_sync(copy_checksum, dest, source)
