"""Candidate binding: the PyPI ``liburing`` 2026.3.x wheel (C liburing 2.15, built with Zig).

This is how kvtierd's backend drove io_uring until the wheel was replaced (``git show
08ed047:kvtierd/io/ring.py``, ``uring.py``, ``buffers.py``): ``Ring``/``io_uring_get_sqe``,
``Iovec`` arrays built from :class:`~uring_candidates.segments.SegmentCache` segments (the wheel
leaks an export of every buffer an ``Iovec`` is given), ``io_uring_prep_readv_fixed``/
``writev_fixed`` for the registered arena, and one ``peek_cqe``/``cqe_seen`` pair per completion
(``peek_batch_cqe`` and ``Cqe(n)`` are not implemented).

**The wheel contains AVX-512 instructions**: on a CPU without AVX-512 the first ``Ring()`` kills
the process with SIGILL. Run it only behind :func:`kvtierd.io.probe.probe_binding` (as
``bench_io.py`` does), and measure it only on a machine that has AVX-512.

The wheel's package is named ``liburing``, as is the 2024.5.3 build
(:mod:`uring_candidates.liburing_2024`), so that both can be measured in one process this
module loads the wheel's single extension module privately, from the first ``liburing``
directory on ``sys.path`` that holds ``liburing.so`` (the 2026 wheels' layout), without
registering it as ``liburing``.
"""

from __future__ import annotations

import errno
import importlib.machinery
import importlib.util
import sys
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

from uring_candidates.package_ring import PackageRing
from uring_candidates.segments import SegmentCache

from kvtierd.io.binding import Completion, RingOp, Span

__all__ = ["PypiRing", "describe", "open_ring"]


def _load_wheel() -> tuple[ModuleType, Path]:
    for entry in sys.path:
        so = Path(entry or ".") / "liburing" / "liburing.so"
        if so.is_file():
            name = f"{__name__}._wheel.liburing"  # PyInit_liburing is found by the last part
            loader = importlib.machinery.ExtensionFileLoader(name, str(so))
            spec = importlib.util.spec_from_file_location(name, so, loader=loader)
            assert spec is not None
            module = importlib.util.module_from_spec(spec)
            loader.exec_module(module)
            return module, so
    raise ImportError("no PyPI liburing 2026 wheel (liburing/liburing.so) on sys.path")


_lu: Any
_lu, _WHEEL = _load_wheel()


def _version() -> str:
    infos = sorted(_WHEEL.parent.parent.glob("liburing-*.dist-info"))
    return infos[-1].name.removeprefix("liburing-").removesuffix(".dist-info") if infos else "?"


def _oserror(exc: Exception, call: str) -> OSError:
    if isinstance(exc, OSError):
        return exc
    return OSError(errno.EIO, f"{call}: {exc}")  # the wheel raises RuntimeError for some refusals


class PypiRing(PackageRing):
    """A :class:`kvtierd.io.binding.RawRing` over ``liburing.Ring``."""

    def __init__(self, entries: int) -> None:
        ring = _lu.Ring()
        try:
            _lu.io_uring_queue_init(entries, ring)
        except Exception as exc:
            raise _oserror(exc, "io_uring_queue_init") from exc
        super().__init__(_lu, ring)
        self._cqe = _lu.Cqe()
        self._segments = SegmentCache()

    def register_buffers(self, spans: Sequence[Span]) -> None:
        # Segments of their own, outside the request cache: the wheel keeps these exported.
        iovec = _lu.Iovec(SegmentCache(len(spans)).segments(spans))
        _lu.io_uring_register_buffers(self._ring, iovec)

    def prep_rw(
        self, op: RingOp, fd: int, spans: Sequence[Span], offset: int, buf_index: int, tag: int
    ) -> object:
        # Kept referenced by the caller until the completion: the kernel reads it at issue.
        iovec = _lu.Iovec(self._segments.segments(spans))
        sqe = self._sqe()
        try:
            if op is RingOp.READV:
                _lu.io_uring_prep_readv(sqe, fd, iovec, offset, 0)
            elif op is RingOp.WRITEV:
                _lu.io_uring_prep_writev(sqe, fd, iovec, offset, 0)
            elif op is RingOp.READV_FIXED:
                _lu.io_uring_prep_readv_fixed(sqe, fd, iovec, buf_index, offset, 0)
            else:
                _lu.io_uring_prep_writev_fixed(sqe, fd, iovec, buf_index, offset, 0)
        except BaseException:
            # The SQE is claimed and will be submitted: never with stale contents.
            _lu.io_uring_prep_nop(sqe)
            _lu.io_uring_sqe_set_data64(sqe, 0)
            raise
        _lu.io_uring_sqe_set_data64(sqe, tag)
        return iovec

    def reap(self) -> list[Completion]:
        completions: list[Completion] = []
        for _ in range(_lu.io_uring_cq_ready(self._ring)):
            _lu.io_uring_peek_cqe(self._ring, self._cqe)
            entry = self._cqe[0]
            try:
                result = entry.res or 0
            except OSError as exc:  # the wheel raises for a negative result
                result = -(exc.errno or errno.EIO)
            completions.append((entry.user_data, result))
            _lu.io_uring_cqe_seen(self._ring, entry)
        return completions


def open_ring(entries: int) -> PypiRing:
    """A ring of ``entries`` submission entries; raises ``OSError``."""
    return PypiRing(entries)


def describe() -> str:
    """``PyPI liburing 2026.3.30 (C liburing 2.15, <path of liburing.so>)``."""
    c_version = f"{_lu.liburing_version_major()}.{_lu.liburing_version_minor()}"
    return f"PyPI liburing {_version()} (C liburing {c_version}, {_WHEEL})"
