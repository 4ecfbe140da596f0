"""Control binding: kvtierd's cffi binding with the vectored fixed opcodes reported missing.

The backend then registers no buffer and runs plain ``READV``/``WRITEV``, so the kernel pins and
unpins the pages of every request: beside :mod:`kvtierd.io.liburing_cffi` in one run, this shows
what registered buffers save on the same binding, apart from the cost of the binding itself.
"""

from __future__ import annotations

from kvtierd.io import liburing_cffi
from kvtierd.io.binding import RingOp

__all__ = ["PlainRing", "describe", "open_ring"]


class PlainRing(liburing_cffi.CffiRing):
    """:class:`kvtierd.io.liburing_cffi.CffiRing` without the fixed forms."""

    def supports(self, op: RingOp) -> bool:
        if op in (RingOp.READV_FIXED, RingOp.WRITEV_FIXED):
            return False
        return super().supports(op)


def open_ring(entries: int) -> PlainRing:
    """A ring of ``entries`` submission entries; raises ``OSError``."""
    return PlainRing(entries)


def describe() -> str:
    """The cffi binding's line, marked as run without fixed buffers."""
    return f"{liburing_cffi.describe()}, fixed opcodes withheld"
