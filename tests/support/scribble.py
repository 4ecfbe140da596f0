"""Changing a committed block in DRAM, as a client of its tenant can: every engine path that
copies blocks out of the arena must then answer that block as a miss, never serve it."""

from __future__ import annotations

import mmap
from collections.abc import Sequence

from kvtierd.client import Namespace


def scribble(ns: Namespace, keys: Sequence[bytes], at: int = 12345, count: int = 1) -> None:
    """Flip every bit of ``count`` bytes from ``at`` (modulo the block's length; to its end at
    most) of each of ``keys``' DRAM copies, through a mapping of the region of ``ns``, after
    their COMMIT. The keys must be in DRAM (a READ brings them there)."""
    with ns.lease(list(keys), verify_on_copy=True) as lease:
        assert len(lease.extents) == len(keys), "scribble needs the blocks in DRAM"
        with mmap.mmap(ns.arena.fd, ns.arena.size_bytes) as region:
            for extent in lease.extents:
                start = extent.offset + at % extent.length
                stop = min(start + count, extent.offset + extent.length)
                region[start:stop] = bytes(b ^ 0xFF for b in region[start:stop])
