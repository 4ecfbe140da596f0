"""The default io_uring binding: the system's liburing through the cffi module
``kvtierd.io._liburing`` (built at install time by ``kvtierd/io/_liburing_build.py``).

Why this binding: it is compiled on the host, for the generic x86-64 target, against the
distribution's liburing, so it runs on every CPU that runs the distribution (see
``docs/io.md`` for the candidates measured). Iovec arrays are plain C memory holding raw
addresses, so nothing here ever holds an export of a caller's buffer: the arena can always be
unmapped once the ring is closed.

Importing this module loads native code: the daemon imports it only after
:mod:`kvtierd.io.probe` exercised it in a child process.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from kvtierd.io import _liburing  # type: ignore[attr-defined]
from kvtierd.io.binding import Completion, RingOp, Span

__all__ = ["CffiRing", "describe", "open_ring"]

_ffi = _liburing.ffi
_lib = _liburing.lib


def _check(result: int, call: str) -> int:
    if result < 0:
        raise OSError(-result, f"{call}: {os.strerror(-result)}")
    return result


class CffiRing:
    """A :class:`kvtierd.io.binding.RawRing` over ``struct io_uring``."""

    def __init__(self, entries: int) -> None:
        self._ring = _ffi.new("struct io_uring *")
        _check(_lib.io_uring_queue_init(entries, self._ring, 0), "io_uring_queue_init")
        self._open = True
        # The completion queue has twice the submission entries (rounded up): reap it whole.
        self._capacity = 4 * entries
        self._tags = _ffi.new("uint64_t[]", self._capacity)
        self._results = _ffi.new("int32_t[]", self._capacity)

    def register_eventfd(self, fd: int) -> None:
        _check(_lib.io_uring_register_eventfd(self._ring, fd), "io_uring_register_eventfd")

    def register_buffers(self, spans: Sequence[Span]) -> None:
        iovecs = _iovecs(spans)
        _check(
            _lib.io_uring_register_buffers(self._ring, iovecs, len(spans)),
            "io_uring_register_buffers",
        )

    def supports(self, op: RingOp) -> bool:
        return bool(_check(_lib.kvt_opcode_supported(self._ring, op), "io_uring probe"))

    def prep_rw(
        self, op: RingOp, fd: int, spans: Sequence[Span], offset: int, buf_index: int, tag: int
    ) -> object:
        iovecs = _iovecs(spans)
        _check(
            _lib.kvt_prep_rw(self._ring, op, fd, iovecs, len(spans), offset, buf_index, tag),
            "io_uring_get_sqe",
        )
        return iovecs

    def prep_fsync(self, fd: int, flags: int, tag: int) -> None:
        _check(_lib.kvt_prep_fsync(self._ring, fd, flags, tag), "io_uring_get_sqe")

    def prep_nop(self, tag: int) -> None:
        _check(_lib.kvt_prep_nop(self._ring, tag), "io_uring_get_sqe")

    def prep_cancel_all(self, tag: int) -> None:
        _check(_lib.kvt_prep_cancel_all(self._ring, tag), "io_uring_get_sqe")

    def submit(self) -> int:
        return _check(_lib.io_uring_submit(self._ring), "io_uring_submit")

    def ready(self) -> int:
        return int(_lib.io_uring_cq_ready(self._ring))

    def reap(self) -> list[Completion]:
        completions: list[Completion] = []
        while True:
            count = _lib.kvt_reap(self._ring, self._tags, self._results, self._capacity)
            completions.extend((self._tags[i], self._results[i]) for i in range(count))
            if count < self._capacity:
                return completions

    def close(self) -> None:
        if self._open:
            self._open = False
            _lib.io_uring_queue_exit(self._ring)


def _iovecs(spans: Sequence[Span]) -> object:
    return _ffi.new("struct iovec[]", [(_ffi.cast("void *", addr), size) for addr, size in spans])


def open_ring(entries: int) -> CffiRing:
    """A ring of ``entries`` submission entries; raises ``OSError`` (``EPERM`` where
    ``kernel.io_uring_disabled`` or seccomp forbids io_uring, ``ENOSYS`` on old kernels)."""
    return CffiRing(entries)


def describe() -> str:
    """``liburing 2.3 (/usr/lib/x86_64-linux-gnu/liburing.so.2.3) via kvtierd.io._liburing``."""
    major, minor = _ffi.new("int *"), _ffi.new("int *")
    library = _mapped_liburing()
    if _lib.kvt_version(major, minor) == 0:
        version = f"{major[0]}.{minor[0]}"
    else:  # headers before liburing 2.4 carry no version: the file name does
        version = library.name.partition(".so.")[2] or "unknown version"
    return f"liburing {version} ({library}) via {_liburing.__name__}"


def _mapped_liburing() -> Path:
    """The file liburing was loaded from (another liburing in the process cannot be mistaken
    for it: the dynamic linker is asked where this module's ``io_uring_queue_init`` lives)."""
    path = os.fsdecode(_ffi.string(_lib.kvt_library_path()))
    return Path(path).resolve() if path else Path("liburing (statically linked)")
