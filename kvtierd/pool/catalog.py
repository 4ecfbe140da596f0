"""What the pool holds besides the blocks' values: this rank's manifest and intents, and the
group's namespace catalog (the link's restore reads them; writes keep them).

* the manifest (``P:{g}:m:<rank>``): one entry per value this rank wrote, what a wiped host
  needs to index a block it finds only in the pool;
* the intents (``P:{g}:i:<rank>``): blocks committed here and on their way to the pool, so a
  restore can tell one that never arrived;
* the catalog (``P:{g}:ns``): every namespace of the group, so a wiped host knows them again.

The pool tier (:class:`~kvtierd.pool.tier.PoolTier`) is only the tier: values in, values out.
The catalog shares its connection (none while the group is detached).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Sequence

import msgspec
from redis.typing import EncodableT, FieldT

from kvtierd.pool.tier import PoolTier, as_bytes, map_pool_errors
from kvtierd.pool.values import ManifestEntry
from kvtierd.store.namespaces import NamespaceSpec
from kvtierd.store.tier import BlockRef

__all__ = ["PoolCatalog"]

log = logging.getLogger("kvtierd.pool")
_SCAN_COUNT = 1000
_manifest_decoder = msgspec.msgpack.Decoder(ManifestEntry)
_spec_decoder = msgspec.msgpack.Decoder(NamespaceSpec)


class PoolCatalog:
    def __init__(self, tier: PoolTier) -> None:
        self._tier = tier
        self._names = tier.names
        self._block_prefix = tier.names.block(b"", b"")

    async def exists(self, locations: Sequence[bytes]) -> list[bool]:
        """Which of ``locations`` hold a value now (one pipeline)."""
        client = self._tier.live()
        with map_pool_errors("lookup"):
            async with client.pipeline(transaction=False) as pipe:
                for location in locations:
                    pipe.exists(location)
                found = await pipe.execute()
        return [bool(n) for n in found]

    async def manifest(self) -> AsyncIterator[tuple[BlockRef, bytes]]:
        """Every block this rank's manifest lists, as (ref, location)."""
        client = self._tier.live()
        with map_pool_errors("manifest scan"):
            async for field, raw in client.hscan_iter(self._names.manifest(), count=_SCAN_COUNT):
                ns_digest, key = field[:16], field[16:]
                try:
                    entry = _manifest_decoder.decode(raw)
                except msgspec.DecodeError:
                    log.warning("ignoring an unreadable manifest entry in the pool")
                    continue
                ref = BlockRef(
                    ns_digest, key, entry.raw_bytes, entry.checksum, entry.seq, entry.compress
                )
                yield ref, self._block_prefix + field

    async def note_intents(self, refs: Sequence[BlockRef]) -> None:
        """Record that these blocks are committed here and on their way to the pool."""
        if not refs:
            return
        client = self._tier.live()
        mapping: dict[FieldT, EncodableT] = {ref.ns_digest + ref.key: ref.seq for ref in refs}
        with map_pool_errors("intent record"):
            await client.hset(self._names.intents(), mapping=mapping)

    async def intents(self) -> list[tuple[bytes, bytes]]:
        """(ns digest, key) of blocks committed on this rank that never reached the pool."""
        client = self._tier.live()
        with map_pool_errors("intent scan"):
            fields = await client.hkeys(self._names.intents())
        return [(f[:16], f[16:]) for f in map(as_bytes, fields)]

    async def forget_intents(self, fields: Sequence[bytes]) -> None:
        if fields:
            with map_pool_errors("intent cleanup"):
                await self._tier.live().hdel(self._names.intents(), *fields)

    async def publish_namespaces(self, specs: dict[bytes, NamespaceSpec]) -> None:
        if not specs:
            return
        mapping: dict[FieldT, EncodableT] = {
            digest: msgspec.msgpack.encode(spec) for digest, spec in specs.items()
        }
        with map_pool_errors("namespace publish"):
            await self._tier.live().hset(self._names.namespaces, mapping=mapping)

    async def namespaces(self) -> list[NamespaceSpec]:
        with map_pool_errors("namespace fetch"):
            raw = await self._tier.live().hvals(self._names.namespaces)
        specs = []
        for value in raw:
            try:
                specs.append(_spec_decoder.decode(as_bytes(value)))
            except (msgspec.DecodeError, msgspec.ValidationError):
                log.warning("ignoring an unreadable namespace in the pool")
        return specs
