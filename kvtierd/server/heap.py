"""Handing the memory a start-up freed back to the kernel (glibc's allocator).

A restart builds the cold index from millions of records: the scan's and the snapshot's
temporary numpy arrays (hundreds of MB at 10M blocks) are freed once the index is built. glibc
serves a large allocation from its own ``mmap`` and returns it on free only while the request
is above its mmap threshold, and that threshold *rises* to the size of each such block freed
(the dynamic threshold, up to 32 MB on 64-bit): after the first large frees, later arrays of
the same sizes come from the heap, and what they leave there stays in the process's resident
set (measured: 215-320 B a block at 1M blocks where the index itself holds about 125).
:func:`trim` asks glibc to return the free pages its heaps hold (``malloc_trim``), once, when
the store is open. Pinning the threshold instead (``mallopt(M_MMAP_THRESHOLD)``) saved the same
at a start but would make every large temporary buffer while serving (a pool copy's bytes of
a block) a fresh mapping faulted in page by page: not done. ``malloc_trim`` is the C library's
own entry point, in the library the interpreter already runs on: no foreign native code is
loaded. On another C library (no such symbol) it does nothing.
"""

from __future__ import annotations

import ctypes

__all__ = ["trim"]


def trim() -> bool:
    """Return the free pages of glibc's heaps to the kernel; whether any were. Walks the
    heaps (milliseconds at a few GB): call it from a worker thread, never on the loop."""
    try:
        libc = ctypes.CDLL(None)
    except OSError:  # pragma: no cover - a static interpreter
        return False
    malloc_trim = getattr(libc, "malloc_trim", None)
    if malloc_trim is None:
        return False
    malloc_trim.argtypes = (ctypes.c_size_t,)
    malloc_trim.restype = ctypes.c_int
    return bool(malloc_trim(0))
