"""Changing a committed block in DRAM, as a client of its tenant can: every engine path that
copies blocks out of the arena must then answer that block as a miss, never serve it."""

from __future__ import annotations

import mmap
from collections.abc import Sequence

from kvtierd.client import Namespace


def scribble(ns: Namespace, keys: Sequence[bytes], at: int = 12345) -> None:
    """Flip one byte (``at``, modulo the block's length) of each of ``keys``' DRAM copies
    through a mapping of the region of ``ns``, after their COMMIT. The keys must be in DRAM."""
    with ns.lease(list(keys), verify_on_copy=True) as lease:
        assert len(lease.extents) == len(keys), "scribble needs the blocks in DRAM"
        with mmap.mmap(ns.arena.fd, ns.arena.size_bytes) as region:
            for extent in lease.extents:
                region[extent.offset + at % extent.length] ^= 0xFF
