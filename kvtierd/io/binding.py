"""The io_uring binding port: what the io_uring backend needs from a binding of liburing.

A binding is a module with two functions, ``open_ring(entries) -> RawRing`` and
``describe() -> str``; the backend never imports liburing itself. The one shipped binding is
:mod:`kvtierd.io.liburing_cffi` (the system's liburing through cffi). A binding is native code
that can take its process down (an instruction the CPU lacks, a bad pointer), so the daemon
loads one only after :mod:`kvtierd.io.probe` ran it in a child process and it survived; tests
use stand-in bindings that crash or hang on purpose, benchmarks other candidates.

Every ``prep_*`` call claims a submission queue entry, fills it and tags it with ``user_data``
in one step, so a failed preparation never leaves a half-written entry in the ring. Buffers are
``(address, length)`` spans: the caller keeps the memory alive and mapped until the request's
completion has been reaped.
"""

from __future__ import annotations

import enum
import importlib
import os
from collections.abc import Sequence
from typing import Protocol, cast

__all__ = [
    "BINDING_ENV",
    "DEFAULT_BINDING",
    "FSYNC_DATASYNC",
    "Completion",
    "RawRing",
    "RingOp",
    "Span",
    "UringBinding",
    "configured_binding",
    "load_binding",
]

#: The module the daemon drives io_uring through unless told otherwise.
DEFAULT_BINDING = "kvtierd.io.liburing_cffi"
#: The environment variable that names another binding module (tests point it at stand-ins that
#: crash or hang; the daemon probes whatever it names like any other binding).
BINDING_ENV = "KVTIERD_IO_URING_BINDING"

#: A buffer as the kernel sees it: (address, length in bytes).
Span = tuple[int, int]

#: One reaped completion: (user_data, result), the result ``-errno`` on failure.
Completion = tuple[int, int]

#: ``IORING_FSYNC_DATASYNC``: ``fdatasync`` rather than ``fsync``.
FSYNC_DATASYNC = 1


class RingOp(enum.IntEnum):
    """The opcodes the backend uses, by their numbers in the kernel's UAPI
    (``include/uapi/linux/io_uring.h``); the vectored fixed forms arrived in Linux 6.15."""

    READV = 1
    WRITEV = 2
    READV_FIXED = 60
    WRITEV_FIXED = 61


class RawRing(Protocol):
    """One io_uring instance. Methods raise ``OSError`` with the kernel's errno."""

    def register_eventfd(self, fd: int) -> None:
        """Have the kernel bump eventfd ``fd`` for every completion it posts."""

    def register_buffers(self, spans: Sequence[Span]) -> None:
        """Register ``spans`` as fixed buffers 0..n-1 (each at most 1 GiB)."""

    def supports(self, op: RingOp) -> bool:
        """Whether the running kernel implements ``op``."""

    def prep_rw(
        self, op: RingOp, fd: int, spans: Sequence[Span], offset: int, buf_index: int, tag: int
    ) -> object:
        """Queue a vectored read or write; ``buf_index`` is the fixed buffer for the fixed forms
        and -1 otherwise. Returns what must stay referenced until the completion (the iovec
        array)."""

    def prep_fsync(self, fd: int, flags: int, tag: int) -> None:
        """Queue an fsync (``flags`` 0 or :data:`FSYNC_DATASYNC`)."""

    def prep_nop(self, tag: int) -> None:
        """Queue a request that completes at once with result 0."""

    def prep_cancel_all(self, tag: int) -> None:
        """Queue a request that asks the kernel to cancel every request of this ring."""

    def submit(self) -> int:
        """Hand the queued entries to the kernel; return how many it consumed."""

    def ready(self) -> int:
        """How many completions wait to be reaped."""

    def reap(self) -> list[Completion]:
        """Take every completion posted so far, oldest first."""

    def close(self) -> None:
        """Tear the ring down (the kernel then drops its registered buffers); idempotent."""


class UringBinding(Protocol):
    """What a binding module provides."""

    def open_ring(self, entries: int) -> RawRing:
        """A new ring with ``entries`` submission entries and twice as many completion slots."""

    def describe(self) -> str:
        """One line naming the binding and the liburing it runs on, for logs."""


def configured_binding() -> str:
    """The binding module's name: ``$KVTIERD_IO_URING_BINDING``, else :data:`DEFAULT_BINDING`."""
    return os.environ.get(BINDING_ENV) or DEFAULT_BINDING


def load_binding(name: str | None = None) -> UringBinding:
    """Import the binding module ``name`` (default :func:`configured_binding`). Only after
    :func:`kvtierd.io.probe.probe_binding` said it survives: importing runs its native code.
    Raises ``ImportError``."""
    return cast(UringBinding, importlib.import_module(name or configured_binding()))
