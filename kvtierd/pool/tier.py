"""The pool tier: blocks in a shared Valkey/Redis (standalone or cluster) as a :class:`LowerTier`.

A block is one value under its own key (:mod:`kvtierd.pool.values`), so a cluster spreads blocks
over its masters; writing it also records it in this rank's manifest (a hash in the group's slot),
which is what a rank whose disk was wiped reads to learn what it may restore. Every value is
checked on the way back (header, then the xxh3 of the raw bytes): a mismatch is a miss, logged.

The tier never decides what to keep: the pool server evicts by its own ``maxmemory-policy``, and
a value evicted there is simply a miss here. It has no client while the group is not attached
(:attr:`client` is ``None``): every call then raises :class:`PoolUnavailableError` at once, and
the store goes on with its local tiers.
"""

from __future__ import annotations

import logging
from collections.abc import Hashable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import anyio
import msgspec
import redis.exceptions
import zstandard

from kvtierd.config import PoolConfig
from kvtierd.errors import BlockNotFoundError, KvtierError
from kvtierd.policy import ServedBy
from kvtierd.pool.connect import POOL_ERRORS, PoolUnavailableError, RedisLike, describe_failure
from kvtierd.pool.values import (
    CorruptValue,
    ManifestEntry,
    PoolNames,
    decode_header,
    encode_header,
    verify_payload,
)
from kvtierd.store.codec import THREAD_CHECKSUM_BYTES, compress, decompress_into
from kvtierd.store.counts import TierFigures
from kvtierd.store.tier import (
    BlockRef,
    LowerTier,
    MediumFullError,
    Recovered,
    TierCapabilities,
)

__all__ = ["PoolTier", "StoreOutcome"]

log = logging.getLogger("kvtierd.pool")
_manifest_encoder = msgspec.msgpack.Encoder()


def _pool_error(exc: BaseException, doing: str) -> PoolUnavailableError:
    return PoolUnavailableError(f"pool {doing} failed: {describe_failure(exc)}")


@dataclass(frozen=True)
class StoreOutcome:
    """What :meth:`PoolTier.store_many` wrote. ``locations`` has one entry per value, in order:
    where the pool holds it, or ``None`` where the pool refused it (nothing of it is stored, and
    the manifest does not list it). ``refused`` is the first refusal as an error
    (:class:`MediumFullError` for a full pool), ``None`` when every value landed."""

    locations: list[bytes | None]
    refused: KvtierError | None


@contextmanager
def map_pool_errors(what: str) -> Iterator[None]:
    """Raise :class:`PoolUnavailableError` ("pool ``what`` failed: <log-safe reason>") for a
    pool error (:data:`POOL_ERRORS`) in the block; the redis error is not chained (``from
    None``), since its text may quote keys and values."""
    try:
        yield
    except POOL_ERRORS as exc:
        raise _pool_error(exc, what) from None


class PoolTier(LowerTier):
    kind = ServedBy.POOL
    #: Durable as the pool server is configured (AOF); indexed by the link's restore, not
    #: when opened.
    capabilities = TierCapabilities(
        durable=True, recovers_on_open=False, shared_across_hosts=True, evicts_itself=True
    )

    def __init__(self, config: PoolConfig, names: PoolNames) -> None:
        self.config = config
        self.names = names
        # Reads hold at most 3/4 of the client's connections, and wait for one beyond that:
        # redis-py refuses a connection past max_connections ("Too many connections"), which
        # failed a READ of more pool-only blocks than that; writes and the consensus keep theirs.
        self._read_slots = anyio.Semaphore(max(1, config.max_connections * 3 // 4))
        self.client: RedisLike | None = None
        self._block_prefix = names.block(b"", b"")
        self._counters = dict.fromkeys(
            (
                "hits",
                "misses",
                "miss_bytes",
                "corrupt",
                "bytes_read",
                "bytes_written",
                "writes",
                "blocks",
                "stored_bytes",
            ),
            0,
        )

    def live(self) -> RedisLike:
        """The client while the group is attached; :class:`PoolUnavailableError` if not."""
        if self.client is None:
            raise PoolUnavailableError("the group is not attached to the pool")
        return self.client

    def location(self, ref: BlockRef) -> bytes:
        return self.names.block(ref.ns_digest, ref.key)

    def _field(self, location: Hashable) -> bytes:
        if not isinstance(location, bytes) or not location.startswith(self._block_prefix):
            raise TypeError("not a pool location")
        return location[len(self._block_prefix) :]

    # -- LowerTier ---------------------------------------------------------------------------

    def slot_class(self, ref: BlockRef) -> int:
        return 0  # the pool server manages its own memory

    async def encode(self, ref: BlockRef, payload: memoryview) -> bytes:
        """The value for ``ref`` (header and payload, compressed when configured)."""
        raw = payload[: ref.raw_bytes]
        if ref.compress or self.config.compress:
            packed = await anyio.to_thread.run_sync(compress, raw)
            if len(packed) < ref.raw_bytes:
                return encode_header(ref, len(packed), True) + packed
        return encode_header(ref, ref.raw_bytes, False) + raw

    async def store(self, ref: BlockRef, payload: memoryview) -> Hashable:
        outcome = await self.store_many([(ref, await self.encode(ref, payload))])
        if outcome.refused is not None:
            raise outcome.refused
        (location,) = outcome.locations
        assert location is not None
        return location

    async def store_many(self, values: Sequence[tuple[BlockRef, bytes]]) -> StoreOutcome:
        """Write encoded blocks, then the manifest entries of the values the pool took.

        Returns each value's location and the first refusal (:class:`StoreOutcome`) rather
        than raising it: the caller records the values that did land before it reacts, and the
        manifest never lists a value the pool does not hold. Raises
        :class:`PoolUnavailableError` when the pool cannot be reached.
        """
        client = self.live()
        locations = [self.location(ref) for ref, _ in values]
        with map_pool_errors("write"):
            # Values first, each judged on its own reply: a pipeline is not a transaction, and a
            # manifest entry written beside a refused SET (full pool, ACL) would make a wiped host
            # restore a block the pool never had, and clear the intent that reports it.
            async with client.pipeline(transaction=False) as pipe:
                for location, (_, value) in zip(locations, values, strict=True):
                    pipe.set(location, value)
                replies = await pipe.execute(raise_on_error=False)
            stored = [
                (location, ref, len(value))
                for location, (ref, value), reply in zip(locations, values, replies, strict=True)
                if not isinstance(reply, BaseException)
            ]
            if stored:
                manifest = {
                    location[len(self._block_prefix) :]: _manifest_encoder.encode(
                        ManifestEntry(ref.raw_bytes, ref.checksum, ref.seq, ref.compress)
                    )
                    for location, ref, _ in stored
                }
                async with client.pipeline(transaction=False) as pipe:
                    pipe.hset(self.names.manifest(), mapping=manifest)  # type: ignore[arg-type]
                    pipe.hdel(self.names.intents(), *manifest)
                    await pipe.execute()
                written = sum(size for _, _, size in stored)
                self._counters["writes"] += len(stored)
                self._counters["blocks"] += len(stored)
                self._counters["bytes_written"] += written
                self._counters["stored_bytes"] += written
        landed: list[bytes | None] = []
        refused: KvtierError | None = None
        for location, reply in zip(locations, replies, strict=True):
            if not isinstance(reply, BaseException):
                landed.append(location)
                continue
            landed.append(None)
            if refused is None:
                refused = (
                    MediumFullError("the pool is full (its maxmemory is reached)")
                    if isinstance(reply, redis.exceptions.OutOfMemoryError)
                    else _pool_error(reply, "write")
                )
        return StoreOutcome(landed, refused)

    async def load(self, ref: BlockRef, location: Hashable, dest: memoryview) -> None:
        client = self.live()
        # acquire_nowait first: anyio's acquire() yields to the loop twice even when a slot is
        # free, a measurable share of a small block's restore.
        try:
            self._read_slots.acquire_nowait()
        except anyio.WouldBlock:
            await self._read_slots.acquire()
        try:
            with map_pool_errors("read"):
                reply = await client.get(location)  # type: ignore[arg-type]
        finally:
            self._read_slots.release()
        if reply is None:
            self._counters["misses"] += 1
            self._counters["miss_bytes"] += ref.raw_bytes
            raise BlockNotFoundError("block is no longer in the pool")
        value = as_bytes(reply)
        try:
            if len(value) < THREAD_CHECKSUM_BYTES:
                _unpack_into(ref, value, dest)
            else:
                await anyio.to_thread.run_sync(_unpack_into, ref, value, dest)
        except (CorruptValue, zstandard.ZstdError) as exc:
            self._counters["corrupt"] += 1
            log.warning("pool value of block %s is not intact (%s): a miss", ref.key.hex(), exc)
            raise BlockNotFoundError(f"pool copy unreadable: {exc}") from None
        self._counters["hits"] += 1
        self._counters["bytes_read"] += len(value)

    async def discard(self, ref: BlockRef, location: Hashable) -> None:
        field = self._field(location)
        client = self.live()
        with map_pool_errors("delete"):
            async with client.pipeline(transaction=False) as pipe:
                pipe.delete(location)  # type: ignore[arg-type]
                pipe.hdel(self.names.manifest(), field)
                pipe.hdel(self.names.intents(), field)  # a forgotten block is not "unreached"
                deleted, _, _ = await pipe.execute()
        self._counters["blocks"] -= int(deleted)

    async def sync(self) -> None:
        """Durability is the pool server's (``appendfsync``); nothing is buffered here."""

    def recovered(self) -> Sequence[Recovered]:
        return ()  # the pool is indexed when the group attaches: see :meth:`manifest`

    def statistics(self) -> TierFigures:
        c = self._counters
        return TierFigures(
            "pool",
            c["blocks"],
            c["stored_bytes"],
            0,
            c["hits"],
            c["misses"],
            0,
            c["bytes_read"],
            c["bytes_written"],
            c["miss_bytes"],
        )

    # -- what the link tells the tier ---------------------------------------------------------

    def note_blocks(self, count: int, stored_bytes: int) -> None:
        """What this rank's manifest lists (after a restore): blocks and their raw bytes."""
        self._counters["blocks"] = count
        self._counters["stored_bytes"] = stored_bytes


def as_bytes(value: bytes | str) -> bytes:
    """The client never decodes replies (``decode_responses`` is off): values are bytes."""
    if isinstance(value, str):
        raise TypeError("the pool client must not decode replies")
    return value


def _unpack_into(ref: BlockRef, value: bytes, dest: memoryview) -> None:
    compressed, payload = decode_header(ref, value)
    if compressed:
        written = decompress_into(payload, dest[: ref.raw_bytes])
        verify_payload(ref, dest[:written])
    else:
        verify_payload(ref, payload)
        dest[: ref.raw_bytes] = payload
