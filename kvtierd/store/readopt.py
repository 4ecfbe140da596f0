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
import anyio.lowlevel

from kvtierd.store.index import Block
from kvtierd.store.kept import (
    IMAGE_VERSION,
    MAX_SEQ,
    DramImage,
    KeptBlock,
    KeptRegion,
    verify_blocks,
)
from kvtierd.store.refs import BlockRef
from kvtierd.store.regions import TenantRegion
from kvtierd.store.residency import Residency
from kvtierd.store.slots import Slot

__all__ = ["KeptOutcome", "adopt_kept", "image_of"]

log = logging.getLogger("kvtierd.store")
#: Blocks indexed between two turns of the event loop.
_SLICE = 4096


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
    blocks = []
    for block in sorted(residency.index.blocks(), key=lambda b: b.ref.seq):
        slot = block.dram
        if slot is None or block.forgotten:
            continue
        region = residency.region(block.ns)
        ref = block.ref
        blocks.append(
            KeptBlock(
                region.id,
                region.relative(slot.offset),
                slot.size,
                ref.ns_digest,
                ref.key,
                ref.raw_bytes,
                ref.checksum,
                ref.seq,
                ref.compress,
                block.dirty,
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

    def check() -> tuple[list[tuple[KeptBlock, TenantRegion]], list[bool]]:
        """In a worker thread (it reads the index and the registry, which nothing changes
        before the store serves): the place of each block, then its bytes."""
        candidates = _in_place(residency, image.blocks, taken)
        spans = [
            (region.mapping.base + kept.offset, kept.raw_bytes, kept.checksum)
            for kept, region in candidates
        ]
        return candidates, verify_blocks(residency.arena.view, spans, progress)

    candidates, ok = await anyio.to_thread.run_sync(check)
    refused = len(image.blocks) - len(candidates)
    good = [pair for pair, fine in zip(candidates, ok, strict=True) if fine]
    adopted = adopted_bytes = 0
    now = time.monotonic()
    by_region: dict[int, list[tuple[KeptBlock, TenantRegion]]] = {}
    for kept, region in good:
        by_region.setdefault(region.id, []).append((kept, region))
    installed: list[Block] = []
    for rows in by_region.values():
        rows.sort(key=lambda pair: pair[0].offset)
        region = rows[0][1]
        slots = region.allocator.adopt(
            [(region.mapping.base + kept.offset, kept.slot_bytes) for kept, _ in rows]
        )
        for (kept, _), slot in zip(rows, slots, strict=True):
            if adopted % _SLICE == _SLICE - 1:
                await anyio.lowlevel.checkpoint()  # the start's progress is told meanwhile
            block = _install(residency, kept, slot)
            if block is None:
                region.allocator.free(slot)
                refused += 1
                continue
            installed.append(block)
            adopted += 1
            adopted_bytes += kept.raw_bytes
    for i, block in enumerate(sorted(installed, key=lambda b: b.ref.seq)):  # commit order
        if i % _SLICE == _SLICE - 1:
            await anyio.lowlevel.checkpoint()
        residency.dram_policy_of(block.ns).inserted(block, now)
        if block.dirty:
            residency.writeback.enqueue(block)
    await _summarise(residency, installed)
    return KeptOutcome(
        adopted,
        adopted_bytes,
        len(candidates) - len(good),
        refused,
        time.monotonic() - started,
    )


def _in_place(
    residency: Residency, blocks: list[KeptBlock], taken: dict[int, TenantRegion]
) -> list[tuple[KeptBlock, TenantRegion]]:
    """The blocks whose place is sound: region taken, namespace known and living there, slot
    aligned, inside the region, large enough and apart from every other block's."""
    placed: list[tuple[KeptBlock, TenantRegion]] = []
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
        placed.append((kept, region))
    # A daemon gives each commit a sequence number of its own (write-back knows blocks by it):
    # blocks that share one are none of them taken.
    seqs = Counter(kept.seq for kept, _ in placed)
    placed = [pair for pair in placed if seqs[pair[0].seq] == 1]
    placed.sort(key=lambda pair: (pair[1].id, pair[0].offset))
    apart: list[tuple[KeptBlock, TenantRegion]] = []
    for kept, region in placed:
        if apart and apart[-1][1] is region:
            before = apart[-1][0]
            if before.offset + before.slot_bytes > kept.offset:
                continue  # two blocks in one place: neither image nor memory can say which
        apart.append((kept, region))
    return apart


def _crosses(boundary: int | None, offset: int, size: int) -> bool:
    """Whether ``[offset, offset + size)`` spans a multiple of ``boundary`` (io_uring's
    fixed-buffer chunks: the allocator never carves such a slot)."""
    if not boundary or size > boundary:
        return False
    return offset // boundary != (offset + size - 1) // boundary


def _install(residency: Residency, kept: KeptBlock, slot: Slot) -> Block | None:
    """Index ``kept`` in DRAM at ``slot``; ``None`` when the lower tier holds another
    version of its key (another sequence number, checksum, size or compression), or it is in
    DRAM already."""
    ns = residency.registry.by_digest(kept.ns_digest)
    assert ns is not None  # checked by _in_place
    block = residency.index.peek(ns, kept.key)  # not made live unless taken
    if block is not None:
        ref = block.ref
        same = (ref.seq, ref.checksum, ref.raw_bytes, ref.compress) == (
            kept.seq,
            kept.checksum,
            kept.raw_bytes,
            kept.compress,
        )
        if not same or block.dram is not None:
            return None
        block = residency.index.get(ns, kept.key)
        assert block is not None
    else:
        ref = BlockRef(
            kept.ns_digest, kept.key, kept.raw_bytes, kept.checksum, kept.seq, kept.compress
        )
        block = Block(ns, ref)
        residency.index.add(block)
        block.dirty = residency.lower is not None
    block.dram = slot
    ns.dram_blocks += 1
    residency.saw_seq(kept.seq)
    return block


async def _summarise(residency: Residency, blocks: list[Block]) -> None:
    """Sparse namespaces' summaries are made at COMMIT and live in memory: make them again."""
    by_ns: dict[int, list[Block]] = {}
    for block in blocks:
        if block.ns.spec.sparse:
            by_ns.setdefault(id(block.ns), []).append(block)
    for group in by_ns.values():
        ns = group[0].ns
        await residency.sparse.summarise(
            ns,
            [
                (block.key, residency.slot_view(block.dram)[: ns.spec.block_bytes])
                for block in group
                if block.dram is not None
            ],
        )
