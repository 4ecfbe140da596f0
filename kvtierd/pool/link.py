"""The store's link to the pool: what goes up, when, and what comes back after a restart or wipe.

Theory of operation. The link follows the group's consensus (:class:`GroupMembership`): only
while the group is ``attached`` does it hand the pool tier a client; otherwise every pool path is
skipped and the store serves from its local tiers, so no engine call fails because the pool is
down, only misses more.

Writes. Every committed block joins ``pending`` (in commit order). Under write-through, COMMIT
writes its blocks at once and returns after the pool has them (on failure they stay pending and
the commit still succeeds locally). Under write-back, a few writer tasks drain ``pending`` in
batches, first recording the blocks as *intents* in the pool (``P:{g}:i:<rank>``), then writing
the values and their manifest entries (which clears the intents). ``pending`` is bounded by
``writeback_bytes``; blocks past it stay local and are counted. Blocks committed while detached
wait in ``pending`` and are written once the group attaches again.

Restore. Each time the group attaches, the link publishes this daemon's namespaces, adopts the
pool's (so a wiped host knows them again), indexes every block of this rank's manifest that the
local tiers lack (a pool-only copy, read on demand), and compares the intents with the manifest:
an intent without a value whose block is still local is written again; one whose block is gone
everywhere is *unreached*: reported by ``kvtierctl pool status`` and in the log, never served.

Group-consistent lookups. For a namespace of a TP group (world size > 1) on an attached group, a
block counts only when every rank's share of it is in the pool: every rank asks the pool the same
question about the same keys, so every rank answers the same hit length.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Generic, TypeVar

import anyio
import anyio.lowlevel
from anyio.abc import TaskGroup

from kvtierd.config import PoolConfig, PoolWritePolicy
from kvtierd.errors import BlockNotFoundError, KvtierError
from kvtierd.pool.catalog import PoolCatalog
from kvtierd.pool.connect import connect_pool, pool_address, probe
from kvtierd.pool.group import GroupMembership, GroupState, GroupStatus
from kvtierd.pool.tier import PoolTier, StoreOutcome
from kvtierd.store.counts import zeroed
from kvtierd.store.namespaces import Namespace
from kvtierd.store.ports import Replicated, StoreForReplica
from kvtierd.store.tier import MediumFullError

__all__ = ["LinkCounts", "PoolLink", "open_pool_link"]

log = logging.getLogger("kvtierd.pool")
_BATCH_BLOCKS = 16
_BATCH_BYTES = 32 << 20
_WRITERS = 4


@dataclass(frozen=True, slots=True)
class LinkCounts:
    """What the link counted since the daemon started."""

    written: int = 0
    write_failures: int = 0
    #: Blocks not written (backlog full, a refusal that will not pass, changed after COMMIT).
    skipped: int = 0
    restored: int = 0
    #: Blocks whose last copy went before they reached the pool.
    lost: int = 0
    group_lookups: int = 0


H = TypeVar("H", bound=Replicated)


class PoolLink(Generic[H]):
    """Implements the store's :class:`~kvtierd.store.ports.ReplicaLink` port; it reaches the
    store only through ``store``, a :class:`~kvtierd.store.ports.StoreForReplica`, and holds its
    blocks only as read-only handles (``H``, :class:`~kvtierd.store.ports.Replicated`). Opened by
    :func:`open_pool_link`, which owns its tasks."""

    def __init__(
        self, config: PoolConfig, tier: PoolTier, store: StoreForReplica[H], tg: TaskGroup
    ) -> None:
        self.config = config
        self.tier = tier
        self.catalog = PoolCatalog(tier)
        self.store = store
        self.membership = GroupMembership(
            group_id=tier.names.group,
            rank=config.rank,
            world_size=config.world_size,
            address=pool_address(config),
            digest=config.digest(),
            connect=lambda: connect_pool(config),
            probe=lambda client: probe(client, config),
            vote_timeout_s=config.vote_timeout_s,
            heartbeat_s=config.heartbeat_s,
            on_change=self.on_status,
            key_prefix=config.key_prefix,
        )
        self.pending: dict[tuple[bytes, bytes], H] = {}
        self.pending_bytes = 0
        #: Blocks a writer took from ``pending`` and is writing now (FSYNC waits for them too).
        self._in_flight: set[H] = set()  # taken from ``pending``, being written
        #: Blocks a COMMIT is writing through to the pool now.
        self._through: set[H] = set()
        #: ids FORGET dropped while a restore runs (it must not index them again)
        self._restore_forgets: set[tuple[bytes, bytes]] | None = None
        self.unreached: list[tuple[bytes, bytes]] = []
        self.counters = zeroed(LinkCounts)
        #: Set once this rank knows where it stands after start-up: attached and restored, or
        #: refused or unreachable (the daemon waits for it, bounded, before it is ready).
        self.settled = anyio.Event()
        self._wake = anyio.Event()
        self._progress = anyio.Event()
        self._attached_round: tuple[int, str] | None = None
        self._published: set[bytes] = set()  # namespace digests the pool's catalog has
        self._tg = tg

    # -- state -------------------------------------------------------------------------------

    @property
    def in_flight(self) -> int:
        """Blocks being written to the pool now."""
        return len(self._in_flight)

    @property
    def attached(self) -> bool:
        return self.tier.client is not None

    def holds(self, block: H) -> bool:
        """Whether ``block`` waits for the pool or is being written there: the store keeps
        it live meanwhile (this handle must stay the block's), and is told when it stops."""
        return (
            self.pending.get(block.id) is block
            or block in self._in_flight
            or block in self._through
        )

    def _let_go(self, blocks: list[H]) -> None:
        """``blocks`` may have stopped waiting for the pool: the store may let go of those it
        no longer needs live."""
        for block in blocks:
            if not self.holds(block):
                self.store.cool(block)

    def statistics(self) -> LinkCounts:
        return LinkCounts(**self.counters)

    @property
    def fsync_waits(self) -> bool:
        return self.config.fsync_waits

    def on_status(self, status: GroupStatus) -> None:
        """The membership's ``on_change``: hand the tier a client only while attached."""
        if status.state is GroupState.ATTACHED:
            self.tier.client = self.membership.client
            # (epoch, nonce): a pool that lost its data counts epochs from 1 again
            attached_round = (status.epoch, status.nonce)
            if attached_round != self._attached_round:
                self._attached_round = attached_round
                self._tg.start_soon(self._restore_logged)
        else:
            self.tier.client = None
            if status.state is GroupState.LOCAL:  # refused or unreachable: an outcome too
                self.settled.set()
        self._kick()
        self._progressed()

    def _kick(self) -> None:
        """Wake the writers: there is work, or the pool may take it now."""
        self._wake.set()
        self._wake = anyio.Event()

    def _progressed(self) -> None:
        """Blocks stopped waiting for the pool (written, given up, or the group changed): what
        :meth:`drain` waits for. A failed attempt is not progress."""
        self._progress.set()
        self._progress = anyio.Event()

    async def settle(self) -> None:
        """Wait (bounded) until the group decided and a restore ran, so a restarted rank serves
        what the pool holds from its first request."""
        with anyio.move_on_after(self.config.vote_timeout_s + 2 * self.config.timeout_s):
            await self.settled.wait()
        status = self.membership.status
        log.info("pool: %s%s", status.state.value, f" ({status.reason})" if status.reason else "")

    async def flush(self, grace_s: float) -> None:
        """Give queued writes up to ``grace_s`` to reach the pool."""
        with anyio.CancelScope(shield=True):
            if (self.pending or self.in_flight) and self.attached:
                await self.drain(grace_s)
            if self.pending:
                log.warning(
                    "%d block(s) did not reach the pool before shutdown; they are written at the "
                    "next attach if still on disk",
                    len(self.pending),
                )

    # -- writes ------------------------------------------------------------------------------

    async def committed(self, blocks: list[H]) -> None:
        """COMMIT published ``blocks``: send them to the pool by the configured policy."""
        if not blocks:
            return
        through = self.config.write_policy is PoolWritePolicy.WRITE_THROUGH
        if through and self.attached:
            self._through.update(blocks)
            written = False
            try:
                await self._write(blocks)
                written = True
            except KvtierError as exc:  # the pool refused, or no DRAM slot for a block
                log.warning("write-through to the pool failed, block(s) stay local: %s", exc)
                self.counters["write_failures"] += 1
            finally:
                self._through.difference_update(blocks)
            if written:
                self._let_go(blocks)
                return
        for block in blocks:
            self._queue(block)
        self._kick()

    def _queue(self, block: H) -> None:
        queued = self.pending.get(block.id)
        if queued is block or block.pool is not None or block.forgotten:
            return
        if queued is not None:  # a forgotten block's entry: the key was committed again
            self._unqueue(queued)
        if self.pending_bytes + block.ref.raw_bytes > self.config.writeback_bytes:
            self.counters["skipped"] += 1
            return
        self.pending[block.id] = block
        self.pending_bytes += block.ref.raw_bytes

    def _unqueue(self, block: H) -> None:
        if self.pending.pop(block.id, None) is not None:
            self.pending_bytes -= block.ref.raw_bytes

    async def writer(self) -> None:
        """One writer task: drain ``pending`` in batches while the group is attached."""
        while True:
            if not self.attached or not self.pending:
                await self._wake.wait()
                continue
            batch = self._take_batch()
            self._in_flight.update(batch)
            try:
                await self.catalog.note_intents([b.ref for b in batch])
                await self._write(batch)
            except MediumFullError as exc:  # retrying would not make room: stay local
                left = [b for b in batch if b.pool is None and self.pending.get(b.id) is not b]
                self.counters["write_failures"] += 1
                self.counters["skipped"] += len(left)
                log.warning("%s: %d block(s) stay local", exc, len(left))
            except KvtierError as exc:  # unreachable, or a refusal that may pass: retry
                self.counters["write_failures"] += 1
                log.warning("pool write-back paused: %s", exc)
                for block in batch:
                    self._queue(block)
                self._in_flight.difference_update(batch)  # back in ``pending``
                with anyio.move_on_after(1.0):
                    await self._wake.wait()
            finally:
                self._in_flight.difference_update(batch)
                if any(self.pending.get(b.id) is not b for b in batch):  # some stopped waiting
                    self._progressed()
                    self._let_go(batch)
                self._kick()

    def _take_batch(self) -> list[H]:
        batch: list[H] = []
        size = 0
        for block in list(self.pending.values()):
            if len(batch) >= _BATCH_BLOCKS or (batch and size + block.ref.raw_bytes > _BATCH_BYTES):
                break
            self._unqueue(block)
            if block.forgotten:
                continue
            batch.append(block)
            size += block.ref.raw_bytes
        return batch

    async def _write(self, blocks: list[H]) -> None:
        """Write ``blocks`` (made resident and pinned meanwhile) with their manifest entries.
        Raises the pool's first refusal, or else the first block that could not be made
        resident (no DRAM slot free now), after recording what did land and queueing those
        blocks again, so that the caller backs off instead of retrying at once."""
        unknown = {
            b.id[0]: self.store.namespace_of(b) for b in blocks if b.id[0] not in self._published
        }
        if unknown:  # a wiped host must learn the namespace before it can index the blocks
            await self.catalog.publish_namespaces(unknown)
            self._published.update(unknown)
        pinned: list[H] = []
        sent: list[H] = []  # those of ``pinned`` whose value goes out, in order
        later: list[H] = []
        pin_error: KvtierError | None = None
        try:
            values = []
            for block in blocks:
                try:
                    await self.store.pin_resident(block)
                except BlockNotFoundError:
                    self.counters["lost"] += 1  # no copy left anywhere
                    continue
                except KvtierError as exc:  # no DRAM slot free now, or the disk failed: later
                    later.append(block)
                    pin_error = pin_error or exc
                    continue
                pinned.append(block)
                source = await self.store.committed_bytes(block)
                if source is None:  # its tenant changed it after COMMIT: never shared
                    self.counters["skipped"] += 1
                    continue
                sent.append(block)
                values.append((block.ref, await self.tier.encode(block.ref, memoryview(source))))
            outcome = await self.tier.store_many(values) if values else StoreOutcome([], None)
        finally:
            for block in pinned:
                self.store.unpin(block)
        for block, location in zip(sent, outcome.locations, strict=True):
            if location is None:
                continue
            if block.forgotten:  # FORGET ran during the write: take the copy back out
                if self.store.block_by_id(*block.id) is None:
                    await self.tier.discard_quietly(block.ref, location)
                continue
            self.store.record_copy(block, location)
            self.counters["written"] += 1
        for block in later:
            self._queue(block)
        if outcome.refused is not None:
            raise outcome.refused
        if pin_error is not None:
            raise pin_error

    def forgotten(self, block: H) -> None:
        """FORGET dropped ``block``: a restore running now must not index it again."""
        if self.pending.get(block.id) is block:
            self._unqueue(block)
        if self._restore_forgets is not None:
            self._restore_forgets.add(block.id)

    async def drain(self, timeout_s: float | None = None, *, up_to_seq: int | None = None) -> bool:
        """Wait until no block committed up to ``up_to_seq`` (all, by default) waits for the
        pool; ``False`` when the group detached (the blocks wait for the next attach), the
        writers made no progress for ``stall_s`` (a pool that refuses every write must not stall
        FSYNC), or ``timeout_s`` passed."""
        stall_s = 2 * self.config.timeout_s + 2.0

        def waiting() -> bool:
            if up_to_seq is None:
                return bool(self.pending or self._in_flight)
            blocks = itertools.chain(self.pending.values(), self._in_flight)
            return any(b.ref.seq <= up_to_seq for b in blocks)

        with anyio.move_on_after(timeout_s if timeout_s is not None else float("inf")):
            while waiting() and self.attached:
                with anyio.move_on_after(stall_s) as stalled:
                    await self._progress.wait()
                if stalled.cancelled_caught:
                    log.warning("the pool takes no writes: FSYNC returns the local guarantee")
                    break
        return not waiting()

    # -- restore -----------------------------------------------------------------------------

    async def _restore_logged(self) -> None:
        try:
            await self.restore()
        except KvtierError as exc:
            log.warning("restore from the pool interrupted: %s (retried at the next attach)", exc)
        except Exception:  # a background task: log it, never take the daemon down
            log.exception("restore from the pool failed (retried at the next attach)")
        finally:
            self.settled.set()

    async def restore(self) -> int:
        """Index what this rank has in the pool and the local tiers lack; the count."""
        started = time.monotonic()
        registry = self.store.registry
        await self.catalog.publish_namespaces({ns.digest: ns.spec for ns in registry})
        self._published.update(ns.digest for ns in registry)
        adopted = [registry.adopt(spec) for spec in await self.catalog.namespaces()]
        self._published.update(ns.digest for ns in adopted if ns is not None)
        if any(adopted):
            await anyio.to_thread.run_sync(registry.save)
        # Blocks with a pool copy before the scan; writers land more while it runs.
        had_pool = list(self.store.replicated())
        restored = 0
        in_pool: set[bytes] = set()
        listed_bytes = 0
        forgets: set[tuple[bytes, bytes]] = set()
        self._restore_forgets = forgets
        try:
            async for ref, location in self.catalog.manifest():
                in_pool.add(ref.ns_digest + ref.key)
                listed_bytes += ref.raw_bytes
                # a page of the manifest is read ahead: skip what FORGET dropped since
                forgotten = (ref.ns_digest, ref.key) in forgets
                if not forgotten and self.store.adopt_copy(ref, location):
                    restored += 1
                if len(in_pool) % 1024 == 0:
                    await anyio.lowlevel.checkpoint()
        finally:
            self._restore_forgets = None
        self.tier.note_blocks(len(in_pool), listed_bytes)
        # A pool that lost its data (no persistence): local blocks whose copy is gone there go
        # back to the backlog instead of pointing at nothing.
        for indexed in had_pool:
            if indexed.pool is not None and b"".join(indexed.id) not in in_pool:
                self.store.drop_copy(indexed)
                self._queue(indexed)
        unreached: list[tuple[bytes, bytes]] = []
        stale: list[bytes] = []
        for ns_digest, key in await self.catalog.intents():
            if ns_digest + key in in_pool:
                stale.append(ns_digest + key)
                continue
            block = self.store.block_by_id(ns_digest, key)
            if block is not None and self.store.has_local_copy(block):
                self._queue(block)
            else:
                unreached.append((ns_digest, key))
        await self.catalog.forget_intents(stale)
        self.unreached = unreached
        self.counters["restored"] += restored
        if unreached:
            log.warning(
                "%d block(s) committed on rank %d never reached the pool and are gone locally: "
                "they are reported, not served",
                len(unreached),
                self.config.rank,
            )
        log.info(
            "pool restore: %d block(s) indexed from the pool (%d listed) in %.2f s",
            restored,
            len(in_pool),
            time.monotonic() - started,
        )
        self._kick()
        self._progressed()
        return restored

    # -- lookups -----------------------------------------------------------------------------

    def group_lookup(self, ns: Namespace) -> bool:
        """Whether LOOKUP for ``ns`` must ask the pool (an attached TP group)."""
        return self.attached and ns.spec.world_size > 1

    async def group_hits(self, ns: Namespace, keys: list[bytes]) -> int:
        """Leading keys whose every rank's share is in the pool. Raises
        :class:`PoolUnavailableError` when the pool cannot answer."""
        self.counters["group_lookups"] += 1
        names = self.tier.names
        locations = [names.block(digest, key) for digest in ns.rank_digests for key in keys]
        found = await self.catalog.exists(locations)
        hits = len(keys)
        for rank in range(len(ns.rank_digests)):
            row = found[rank * len(keys) : (rank + 1) * len(keys)]
            hits = min(hits, row.index(False) if False in row else len(row))
        return hits


@contextlib.asynccontextmanager
async def open_pool_link(
    config: PoolConfig, tier: PoolTier, store: StoreForReplica[H], *, grace_s: float
) -> AsyncIterator[PoolLink[H]]:
    """Run a :class:`PoolLink` for ``store``: the group membership, the writers and the restores,
    in a task group of its own. On exit queued writes get ``grace_s`` to reach the pool, then
    everything stops."""
    async with anyio.create_task_group() as tg:
        link = PoolLink(config, tier, store, tg)
        tg.start_soon(link.membership.run)
        for _ in range(_WRITERS):
            tg.start_soon(link.writer)
        try:
            yield link
        finally:
            await link.flush(grace_s)
            tg.cancel_scope.cancel()
