"""What the two PyPI ``liburing`` candidates share: both packages (2024.5.3 and the 2026 wheels)
mirror C liburing function by function, so a ring over either claims an SQE with
``io_uring_get_sqe``, prepares it with ``io_uring_prep_*`` and tags it with
``io_uring_sqe_set_data64``. Subclasses give the package module (``lu``) and what differs:
creating the ring, building iovecs, preparing reads and writes, and reaping."""

from __future__ import annotations

import errno
import os
from typing import Any

from kvtierd.io.binding import RingOp

__all__ = ["PackageRing"]

# UAPI values (the 2024 package's dynamic importer does not export its enum constants).
_IORING_ASYNC_CANCEL_ALL = 1 << 0
_IORING_ASYNC_CANCEL_ANY = 1 << 2


class PackageRing:
    """The part of a :class:`kvtierd.io.binding.RawRing` that reads the same on both packages."""

    def __init__(self, lu: Any, ring: Any) -> None:
        self.lu = lu
        self._ring = ring
        self._open = True
        self._supported: dict[int, bool] = {}

    def register_eventfd(self, fd: int) -> None:
        self.lu.io_uring_register_eventfd(self._ring, fd)

    def supports(self, op: RingOp) -> bool:
        if not self._supported:
            probe = self.lu.io_uring_get_probe_ring(self._ring)
            if probe is None:
                raise OSError(errno.ENOSYS, "io_uring_get_probe_ring failed")
            lu = self.lu
            self._supported = {o: bool(lu.io_uring_opcode_supported(probe, o)) for o in RingOp}
            lu.io_uring_free_probe(probe)
        return self._supported[op]

    def prep_fsync(self, fd: int, flags: int, tag: int) -> None:
        sqe = self._sqe()
        self.lu.io_uring_prep_fsync(sqe, fd, flags)
        self.lu.io_uring_sqe_set_data64(sqe, tag)

    def prep_nop(self, tag: int) -> None:
        sqe = self._sqe()
        self.lu.io_uring_prep_nop(sqe)
        self.lu.io_uring_sqe_set_data64(sqe, tag)

    def prep_cancel_all(self, tag: int) -> None:
        sqe = self._sqe()
        flags = _IORING_ASYNC_CANCEL_ALL | _IORING_ASYNC_CANCEL_ANY
        self.lu.io_uring_prep_cancel64(sqe, 0, flags)
        self.lu.io_uring_sqe_set_data64(sqe, tag)

    def submit(self) -> int:
        return int(self.lu.io_uring_submit(self._ring) or 0)

    def ready(self) -> int:
        return int(self.lu.io_uring_cq_ready(self._ring))

    def close(self) -> None:
        if self._open:
            self._open = False
            self.lu.io_uring_queue_exit(self._ring)

    def _sqe(self) -> Any:
        sqe = self.lu.io_uring_get_sqe(self._ring)
        if not sqe:
            raise OSError(errno.EBUSY, os.strerror(errno.EBUSY))
        return sqe
