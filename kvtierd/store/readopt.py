"""The store's side of DRAM kept across a restart (:mod:`kvtierd.store.kept`): the image a
stopping store leaves, and taking a stopped store's blocks back into DRAM, verified.

Taking back, in three steps. Every block of the image is checked against what this start is:
its region taken again (same tenant, same size), its namespace known and living in that region,
its slot inside the region, apart from the others, and large enough. The bytes of those that
pass are hashed in a worker thread against the checksum they were committed with (a tenant's
client may have written into its region while no daemon ran). The slots of those whose bytes
match are then taken in their regions' allocators, before anything else allocates, and the
blocks indexed as if just promoted: known to the DRAM policy, in commit order, and queued for
write-back when the local lower tier has no copy. A block the lower tier recovered with
another sequence number keeps the lower tier's copy only (a key is committed again only
after its last copy was dropped, so the two disagree only after a damaged tier).
"""

from __future__ import annotations

import logging
import os
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import anyio

from kvtierd.store.index import Block
from kvtierd.store.kept import (
    IMAGE_VERSION,
    MAX_SEQ,
    DramImage,
    KeptBlock,
    KeptRegion,
    verify_blocks,
)
from kvtierd.store.namespaces import Namespace
from kvtierd.store.refs import BlockRef
from kvtierd.store.regions import TenantRegion
from kvtierd.store.residency import Residency
from kvtierd.store.slots import Slot

__all__ = ["KeptOutcome", "adopt_kept", "image_of"]

log = logging.getLogger("kvtierd.store")


@dataclass(frozen=True, slots=True)
class KeptOutcome:
    """What became of an image's blocks."""

    adopted: int = 0
    adopted_bytes: int = 0
    #: Not taken: their bytes no longer match their checksum.
    damaged: int = 0
    #: Not taken: their region was not taken again, their namespace is unknown or elsewhere,
    #: their slot is out of place, or the lower tier holds another version.
    refused: int = 0
    seconds: float = 0.0


def image_of(residency: Residency) -> DramImage:
    """What ``residency``'s DRAM holds, for the next start: call it once nothing changes the
    index any more (every task of the store ended)."""
    regions = [_kept_region(region) for region in residency.regions]
    resident = [b for b in residency.index.blocks() if b.dram is not None and not b.forgotten]
    blocks = []
    for block in sorted(resident, key=lambda b: b.ref.seq):
        assert block.dram is not None
        region = residency.region(block.ns)
        ref = block.ref
        blocks.append(
            KeptBlock(
                region.id,
                region.relative(block.dram.offset),
                block.dram.size,
                ref.ns_digest,
                ref.key,
                ref.raw_bytes,
                ref.checksum,
                ref.seq,
                ref.compress,
            )
        )
    return DramImage(IMAGE_VERSION, time.time(), os.getpid(), regions, blocks)


def _kept_region(region: TenantRegion) -> KeptRegion:
    info = os.fstat(region.fd)
    before = region.mapping.kept
    return KeptRegion(
        region.id,
        region.tenant,
        region.size_bytes,
        region.mapping.hugepages,
        info.st_ino,
        info.st_dev,
        before.restarts + 1 if before is not None else 0,
    )


#: A block of the image whose place is sound, with the region and namespace it lives in.
_Placed = tuple[KeptBlock, TenantRegion, Namespace]


async def adopt_kept(
    residency: Residency,
    image: DramImage,
    progress: Callable[[int, int], None] = lambda done, total: None,
) -> KeptOutcome:
    """Take ``image``'s blocks back into DRAM (the module docstring says how); ``progress``
    is told how many bytes are verified, from a worker thread."""
    started = time.monotonic()
    taken = {
        region.mapping.kept.id: region
        for region in residency.regions
        if region.mapping.kept is not None
    }

    def check() -> tuple[list[_Placed], list[bool]]:
        """In a worker thread (it reads the index and the registry, which nothing changes
        before the store serves): the place of each block, then its bytes."""
        candidates = _in_place(residency, image.blocks, taken)
        spans = [
            (region.mapping.base + kept.offset, kept.raw_bytes, kept.checksum)
            for kept, region, _ in candidates
        ]
        return candidates, verify_blocks(residency.arena.view, spans, progress)

    candidates, ok = await anyio.to_thread.run_sync(check)
    good = [placed for placed, fine in zip(candidates, ok, strict=True) if fine]
    by_region: dict[int, list[_Placed]] = {}
    for placed in good:  # in offset order: _in_place sorted them
        by_region.setdefault(placed[1].id, []).append(placed)
    installed: list[Block] = []
    for rows in by_region.values():
        region = rows[0][1]
        slots = region.allocator.adopt(
            [(region.mapping.base + kept.offset, kept.slot_bytes) for kept, _, _ in rows]
        )
        pairs = list(zip(rows, slots, strict=True))
        blocks = await residency.lane.map(pairs, lambda pair: _install(residency, *pair))
        for (_, slot), block in zip(pairs, blocks, strict=True):
            if block is None:
                region.allocator.free(slot)
            else:
                installed.append(block)
    now = time.monotonic()
    await residency.lane.map(
        sorted(installed, key=lambda b: b.ref.seq),  # the policy learns commit order
        lambda block: _known(residency, block, now),
    )
    await residency.summarise_missing(installed)  # summaries live in memory: make them again
    return KeptOutcome(
        len(installed),
        sum(block.ref.raw_bytes for block in installed),
        len(candidates) - len(good),
        len(image.blocks) - len(candidates) + len(good) - len(installed),
        time.monotonic() - started,
    )


def _in_place(
    residency: Residency, blocks: list[KeptBlock], taken: dict[int, TenantRegion]
) -> list[_Placed]:
    """The blocks whose place is sound, by region and offset: region taken, namespace known
    and living there, slot aligned, inside the region, of the size the block takes and apart
    from every other block's."""
    placed: list[_Placed] = []
    for kept in blocks:
        region = taken.get(kept.region)
        ns = residency.registry.by_digest(kept.ns_digest)
        if region is None or ns is None or residency.region(ns) is not region:
            continue
        allocator = region.allocator
        if (
            kept.raw_bytes != ns.spec.block_bytes
            or kept.slot_bytes != allocator.size_class(kept.raw_bytes)  # what it would carve
            or kept.offset < 0
            or kept.offset % allocator.align
            or kept.offset + kept.slot_bytes > allocator.capacity
            or _crosses(allocator.boundary, region.mapping.base + kept.offset, kept.slot_bytes)
            or not 0 < kept.seq <= MAX_SEQ
        ):
            continue
        placed.append((kept, region, ns))
    # A daemon gives each commit a sequence number of its own (write-back knows blocks by it):
    # blocks that share one are none of them taken.
    seqs = Counter(kept.seq for kept, _, _ in placed)
    placed = [row for row in placed if seqs[row[0].seq] == 1]
    placed.sort(key=lambda row: (row[1].id, row[0].offset))
    apart: list[_Placed] = []
    for row in placed:
        kept, region, _ = row
        if apart and apart[-1][1] is region:
            before = apart[-1][0]
            if before.offset + before.slot_bytes > kept.offset:
                continue  # two blocks in one place: neither image nor memory can say which
        apart.append(row)
    return apart


def _crosses(boundary: int | None, offset: int, size: int) -> bool:
    """Whether ``[offset, offset + size)`` spans a multiple of ``boundary`` (io_uring's
    fixed-buffer chunks: the allocator never carves such a slot)."""
    if not boundary or size > boundary:
        return False
    return offset // boundary != (offset + size - 1) // boundary


def _install(residency: Residency, placed: _Placed, slot: Slot) -> Block | None:
    """Index ``placed``'s block in DRAM at ``slot``; ``None`` when the lower tier holds
    another version of its key (another sequence number, checksum, size or compression), or
    it is in DRAM already."""
    kept, _, ns = placed
    ref = BlockRef(kept.ns_digest, kept.key, kept.raw_bytes, kept.checksum, kept.seq, kept.compress)
    block = residency.index.get(ns, kept.key)
    if block is not None and (block.ref != ref or block.dram is not None):
        residency.cool(block)  # one made from its row just now is let go again
        return None
    if block is None:
        block = Block(ns, ref, dirty=residency.lower is not None)  # the lower tier lacks it
        residency.index.add(block)
    block.dram = slot
    ns.dram_blocks += 1
    residency.saw_seq(kept.seq)
    return block


def _known(residency: Residency, block: Block, now: float) -> None:
    """Tell ``block``'s DRAM policy of it, and queue its write-back if the lower tier lacks
    it."""
    residency.dram_policy_of(block.ns).inserted(block, now)
    if block.dirty:
        residency.writeback.enqueue(block)
