"""ALLOC and COMMIT: arena slots for new blocks, then publishing them.

A key is visible only after COMMIT, and an abandoned ALLOC is never visible: ALLOC takes slots
(counted against the connection's share of its tenant's region), COMMIT hashes what the client
wrote (making write-back's private copy in the same pass while the staging memory has room),
checks the client's checksums, and only then indexes the blocks, queues them for write-back and
hands them to the replica link. A racing writer that committed the same key first wins; the
loser's slot is freed.
"""

from __future__ import annotations

import time

from kvtierd.errors import InvalidRequestError, NoSpaceError, QuotaError
from kvtierd.store.codec import THREAD_CHECKSUM_BYTES, checksum_off_loop
from kvtierd.store.index import Block, BlockIndex, Owner, PendingWrite
from kvtierd.store.namespaces import Namespace
from kvtierd.store.ports import ReplicaLink
from kvtierd.store.quota import hold_pinned
from kvtierd.store.residency import Residency
from kvtierd.store.slots import Slot
from kvtierd.store.tier import BlockRef

__all__ = ["Writes"]


class Writes:
    def __init__(self, residency: Residency, link: ReplicaLink | None) -> None:
        self._r = residency
        self._link = link

    async def alloc(self, owner: Owner, ns: Namespace, keys: list[bytes]) -> PendingWrite:
        """Arena slots for the keys not stored yet (``None`` for those already stored)."""
        r = self._r
        if len(set(keys)) != len(keys):
            raise InvalidRequestError("ALLOC names a key twice")
        region = r.region(ns)
        if len(owner.writes) >= r.limits.max_pending_writes_per_connection:
            raise QuotaError(
                f"this connection has {len(owner.writes)} writes pending "
                "(limits.max_pending_writes_per_connection): commit or abort some first"
            )
        # stored now (the rows probed together); a key stored later is live (a commit), or
        # cold once let go since (then probed again)
        stored, cooled = r.index.contains_many(ns, keys), r.index.cooled
        new = [key for key, there in zip(keys, stored, strict=True) if not there]
        if len(new) * region.allocator.size_class(ns.spec.block_bytes) > region.allocator.capacity:
            raise NoSpaceError(  # can never fit: refused before anything is evicted
                f"{len(new)} blocks of {ns.spec.block_bytes} bytes exceed the tenant's "
                f"{region.allocator.capacity}-byte DRAM region"
            )
        held = hold_pinned(r.limits, owner, ns, len(new) * ns.spec.block_bytes)
        slots: list[Slot | None] = []
        policy = r.dram_policies[region.id]
        try:
            async with r.lane.walk(len(keys)) as walk:
                for key, there in zip(keys, stored, strict=True):
                    await walk.pause()
                    if there or _stored_since(r.index, ns, key, cooled):
                        slots.append(None)
                        continue
                    if policy.backlog > r.lane.inline_items:  # else evicting applies it all
                        walk.release()
                        await policy.settle(r.lane)
                    slot = r.allocate_dram_nowait(region, ns.spec.block_bytes)
                    if slot is None:  # waits for write-back to free room: not on the lane
                        walk.release()
                        slot = await r.allocate_dram(region, ns.spec.block_bytes, wait=True)
                    slots.append(slot)
        except BaseException:
            owner.hold(region, -held)
            for slot in slots:
                if slot is not None:
                    region.allocator.free(slot)
            raise
        write = PendingWrite(Owner.next_id(), ns, list(keys), slots)
        owner.writes[write.id] = write
        # what the quota counted: a key stored meanwhile got a slot anyway, count that instead
        owner.hold(region, _write_bytes(write) - held)
        return write

    async def commit(self, owner: Owner, write_id: int, checksums: list[int], abort: bool) -> int:
        """Publish the blocks of ALLOC ``write_id`` (or drop them with ``abort``)."""
        write = owner.writes.pop(write_id, None)
        if write is None:
            raise InvalidRequestError(f"write {write_id} is not pending on this connection")
        owner.hold(write.ns.region, -_write_bytes(write))
        if checksums and len(checksums) != len(write.keys):
            self.abandon(write)
            raise InvalidRequestError("COMMIT must carry one checksum per key, or none")
        if abort:
            self.abandon(write)
            return 0
        staged: list[Slot | None] = []
        try:
            sums: list[int] = []
            async with self._r.lane.walk(len(write.slots)) as walk:
                for slot in write.slots:
                    await walk.pause()
                    if write.ns.spec.block_bytes >= THREAD_CHECKSUM_BYTES:
                        walk.release()  # hashed in a worker thread: not on the lane
                    sums.append(await self._seal(slot, write.ns, staged))
            for i, (given, actual) in enumerate(zip(checksums, sums, strict=False)):
                if write.slots[i] is not None and given != actual:
                    raise InvalidRequestError(f"block {i}: checksum mismatch (torn client write)")
        except BaseException:
            self._unstage(staged)
            self.abandon(write)
            raise
        if write.ns.spec.sparse:
            try:
                await self._r.sparse.summarise(
                    write.ns,
                    [
                        (key, self._r.slot_view(slot)[: write.ns.spec.block_bytes])
                        for key, slot in zip(write.keys, write.slots, strict=True)
                        if slot is not None
                    ],
                )
            except BaseException:
                self._unstage(staged)
                self.abandon(write)
                raise
        committed, new = await self._publish(write, sums, staged)
        if self._link is not None:
            await self._link.committed(new)
        return committed

    async def _seal(self, slot: Slot | None, ns: Namespace, staged: list[Slot | None]) -> int:
        """The checksum of a block being committed; appends its private copy to ``staged``
        (made now, in the same pass, when there is room and a lower tier to write it to)."""
        r = self._r
        copy = None
        digest = 0
        if slot is not None:
            source = r.slot_view(slot)[: ns.spec.block_bytes]
            copy = (
                r.staged.take(len(source)) if r.staged is not None and r.lower is not None else None
            )
            if copy is not None:
                assert r.staged is not None
                staged.append(copy)  # before the await: an abandoned commit frees it
                return await r.staged.stage(copy, source)
            digest = await checksum_off_loop(source)
        staged.append(None)
        return digest

    def _unstage(self, staged: list[Slot | None]) -> None:
        for copy in staged:
            if copy is not None and self._r.staged is not None:
                self._r.staged.free(copy)

    async def _publish(
        self, write: PendingWrite, sums: list[int], staged: list[Slot | None]
    ) -> tuple[int, list[Block]]:
        """Index the written blocks, in slices when many; (how many keys are stored now, the
        new blocks). Cut short, the blocks not indexed yet are dropped (their slots freed)."""
        r = self._r
        now = time.monotonic()
        committed = 0
        new: list[Block] = []
        rows = list(zip(write.keys, write.slots, sums, staged, strict=True))
        stored, cooled = r.index.contains_many(write.ns, write.keys), r.index.cooled
        done = 0
        try:
            async with r.lane.walk(len(rows)) as walk:
                for key, slot, digest, copy in rows:
                    await walk.pause()
                    done += 1
                    committed += 1
                    if slot is None:
                        continue
                    # a racing writer won: stored when this commit began, or live since
                    if stored[done - 1] or _stored_since(r.index, write.ns, key, cooled):
                        r.region(write.ns).allocator.free(slot)
                        self._unstage([copy])
                        continue
                    new.append(self._index(write.ns, key, slot, digest, copy, now))
        except BaseException:
            for _, slot, _, copy in rows[done:]:
                if slot is not None:
                    r.region(write.ns).allocator.free(slot)
                self._unstage([copy])
            raise
        return committed, new

    def _index(
        self, ns: Namespace, key: bytes, slot: Slot, digest: int, copy: Slot | None, now: float
    ) -> Block:
        """Make one committed block visible, and queue it for write-back."""
        r = self._r
        r.seq += 1
        ref = BlockRef(ns.digest, key, ns.spec.block_bytes, digest, r.seq, ns.compress)
        block = Block(ns, ref, dram=slot, dirty=r.lower is not None, staged=copy)
        r.index.add(block)
        ns.dram_blocks += 1
        r.dram_policy_of(block.ns).inserted(block, now)
        r.count(ns, "bytes_committed", ref.raw_bytes)
        if block.dirty:
            r.writeback.enqueue(block)
        return block

    def abandon(self, write: PendingWrite) -> None:
        for slot in write.slots:
            if slot is not None:
                self._r.region(write.ns).allocator.free(slot)


def _write_bytes(write: PendingWrite) -> int:
    return sum(write.ns.spec.block_bytes for slot in write.slots if slot is not None)


def _stored_since(index: BlockIndex, ns: Namespace, key: bytes, cooled: int) -> bool:
    """Whether ``key``, not stored when the rows were probed (``cooled``: the index's count of
    blocks let go then), is stored now: live (a commit since), or cold when a block was let go
    since."""
    if index.live(ns, key) is not None:
        return True
    return index.cooled != cooled and index.contains(ns, key)
