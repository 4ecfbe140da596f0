"""What writing one block back to the local lower tier does (the write-back workers' ``write``).

What reaches the tier is a private copy that hashes to the checksum taken at COMMIT
(:class:`~kvtierd.store.staging.StagedCopies`): the one made at COMMIT while there was room, or
one made now and verified. A block its tenant changed before write-back could copy it is
dropped, never written. A full size class is made room in by evicting the tier's blocks of that
class; a full medium is not (evicting would only throw durable blocks away).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Hashable

from kvtierd.errors import NoSpaceError
from kvtierd.store.index import Block
from kvtierd.store.residency import Residency
from kvtierd.store.staging import ChangedAfterCommit
from kvtierd.store.tier import ClassFullError, MediumFullError

__all__ = ["LowerWriter"]

log = logging.getLogger("kvtierd.store")


class LowerWriter:
    def __init__(self, residency: Residency) -> None:
        self._r = residency

    async def write_back(self, block: Block) -> None:
        """Write ``block`` (dirty, in DRAM) to the lower tier and mark it clean."""
        r = self._r
        assert r.lower is not None
        assert block.dram is not None
        block.pins += 1
        try:
            location = await self._store_lower(block)
        except ChangedAfterCommit:
            r.unpin(block)
            self._drop_changed(block)
            return
        except BaseException:
            r.unpin(block)
            # a retry (FSYNC's) copies again, verified: a failed block holds no staging
            r.drop_staged(block)
            raise
        r.unpin(block)
        r.drop_staged(block)
        if block.forgotten:
            await r.lower.discard(block.ref, location)
            return
        block.copies[r.lower.kind] = location
        block.dirty = False
        r.dram_policy_of(block.ns).release(block)
        block.ns.nvme_blocks += 1
        r.counters["written_back"] += 1
        r.lower_policy.inserted(block, time.monotonic())

    def _drop_changed(self, block: Block) -> None:
        """``block``'s slot no longer holds what was committed (its tenant wrote to it after
        COMMIT): drop it, never write it."""
        r = self._r
        log.warning(
            "a block of namespace %r (tenant %r) changed after it was committed; dropped, "
            "not written back",
            block.ns.spec.name,
            block.ns.spec.tenant,
        )
        r.count(block.ns, "corrupt_writebacks")
        r.counters["lost"] += 1
        r.index.remove(block)
        block.dirty = False
        if block.dram is not None and block.pins == 0:
            r.drop_dram(block)

    async def _store_lower(self, block: Block) -> Hashable:
        """Write ``block``'s private copy to the lower tier: the one made at COMMIT, or one made
        now and verified (:class:`ChangedAfterCommit` when its slot no longer hashes to its
        checksum)."""
        staged = self._r.staged
        assert staged is not None
        assert block.dram is not None
        if block.staged is not None:
            return await self._store_copy(block, staged.view(block.staged, block.ref.raw_bytes))
        source = self._r.slot_view(block.dram)[: block.ref.raw_bytes]
        async with staged.copy_of(source, block.ref.checksum) as view:
            return await self._store_copy(block, view)

    async def _store_copy(self, block: Block, view: memoryview) -> Hashable:
        lower = self._r.lower
        assert lower is not None
        own_class = lower.slot_class(block.ref)
        while True:
            seen = self._r.lower_evictions_made(own_class)  # read before the write can fail
            try:
                return await lower.store(block.ref, view)
            except MediumFullError:
                raise  # evicting would only throw durable blocks away; FSYNC reports it
            except NoSpaceError as exc:  # (a compressed record's class is its smaller size's)
                full = exc.slot_class if isinstance(exc, ClassFullError) else None
                slot_class = full or own_class
                if not await self._r.evict_lower(
                    slot_class, seen if slot_class == own_class else None
                ):
                    raise
