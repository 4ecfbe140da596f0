"""Candidate binding: PyPI ``liburing`` 2024.5.3 (Cython over C liburing 2.6), built from source.

2024.5.3 is the last release with an sdist, so it can be compiled on the host with generic CPU
flags (``CFLAGS="-march=x86-64 -mtune=generic" pip wheel --no-deps liburing==2024.5.3``; it
needs ``dynamic-import`` beside it at run time). What its API lacks decides what this adapter
can do:

* no ``io_uring_prep_readv_fixed``/``writev_fixed``, and an SQE object that exposes only
  ``flags`` and ``user_data``, so the vectored fixed opcodes cannot be prepared at all;
  ``io_uring_prep_read_fixed`` (not vectored) takes only ``bytes``/``bytearray``, never memory
  of the arena. :meth:`Ring2024.supports` therefore says no to the fixed forms and the backend
  runs plain ``READV``/``WRITEV`` (the pages are pinned and unpinned on every request);
* ``io_uring_peek_batch_cqe`` writes ``count`` CQE pointers into the one pointer field of its
  ``io_uring_cqe`` object (memory corruption for ``count > 1``), so completions are reaped one
  ``peek_cqe``/``cqe_seen`` pair at a time;
* its ``iovec`` releases its buffer exports when freed (no leak), but takes only buffer objects:
  spans become :class:`~uring_candidates.segments.SegmentCache` segments here too.

The package is named ``liburing`` like the 2026 wheels: this module imports the first
``liburing`` on ``sys.path`` that is a directory of Cython modules (``queue.*.so``) and refuses
any other version.
"""

from __future__ import annotations

import errno
import importlib
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from uring_candidates.package_ring import PackageRing
from uring_candidates.segments import SegmentCache

from kvtierd.io.binding import Completion, RingOp, Span

__all__ = ["Ring2024", "describe", "open_ring"]

VERSION = "2024.5.3"


def _import() -> Any:
    if "liburing" not in sys.modules:
        for entry in sys.path:
            package = Path(entry or ".") / "liburing"
            if any(package.glob("queue.*.so")):
                sys.path.insert(0, str(package.parent))
                break
    module = importlib.import_module("liburing")
    if getattr(module, "__version__", None) != VERSION:
        found = getattr(module, "__version__", "?")
        raise ImportError(f"liburing {found} imported from {module.__file__}, not {VERSION}")
    return module


_lu: Any = _import()


class Ring2024(PackageRing):
    """A :class:`kvtierd.io.binding.RawRing` over ``liburing.io_uring`` (no fixed opcodes)."""

    def __init__(self, entries: int) -> None:
        ring = _lu.io_uring()
        _lu.io_uring_queue_init(entries, ring)
        super().__init__(_lu, ring)
        self._cqe = _lu.io_uring_cqe()
        self._segments = SegmentCache()

    def register_buffers(self, spans: Sequence[Span]) -> None:
        iovec = _lu.iovec(SegmentCache(len(spans)).segments(spans))
        _lu.io_uring_register_buffers(self._ring, iovec, len(spans))

    def supports(self, op: RingOp) -> bool:
        if op in (RingOp.READV_FIXED, RingOp.WRITEV_FIXED):
            return False  # the API cannot prepare them (module docstring)
        return super().supports(op)

    def prep_rw(
        self, op: RingOp, fd: int, spans: Sequence[Span], offset: int, buf_index: int, tag: int
    ) -> object:
        if op not in (RingOp.READV, RingOp.WRITEV):
            raise OSError(errno.EOPNOTSUPP, f"liburing {VERSION} cannot prepare {op.name}")
        iovec = _lu.iovec(self._segments.segments(spans))
        sqe = self._sqe()
        if op is RingOp.READV:
            _lu.io_uring_prep_readv(sqe, fd, iovec, offset)
        else:
            _lu.io_uring_prep_writev(sqe, fd, iovec, len(spans), offset)
        _lu.io_uring_sqe_set_data64(sqe, tag)
        return iovec

    def reap(self) -> list[Completion]:
        completions: list[Completion] = []
        for _ in range(_lu.io_uring_cq_ready(self._ring)):
            if _lu.io_uring_peek_cqe(self._ring, self._cqe) != 0:
                break
            completions.append((self._cqe.user_data, self._cqe.res))
            _lu.io_uring_cqe_seen(self._ring, self._cqe)
        return completions


def open_ring(entries: int) -> Ring2024:
    """A ring of ``entries`` submission entries; raises ``OSError``."""
    return Ring2024(entries)


def describe() -> str:
    """``PyPI liburing 2024.5.3 (C liburing 2.6, built here, <package directory>)``, and that
    it cannot prepare the fixed forms."""
    c_version = f"{_lu.liburing_version_major()}.{_lu.liburing_version_minor()}"
    where = Path(_lu.__file__).parent
    return (
        f"PyPI liburing {VERSION} (C liburing {c_version}, built here, {where}); "
        "its API cannot prepare READV_FIXED/WRITEV_FIXED"
    )
