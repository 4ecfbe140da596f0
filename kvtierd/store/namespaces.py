"""Namespaces: what makes blocks comparable, who may use them, and their persistent catalog.

A namespace's identity is its name, tenant, block size, layout and TP rank/world size; its
16-byte ``digest`` (xxh3-128 of that identity) tags every record on disk, so a block can only
ever be served to the layout that wrote it. The ranks of one TP group share a ``group_digest``
and therefore a ``key_salt``: the same tokens give the same keys on every rank, which is what
lets a lookup answer for the whole group. The tenant enters the salt, so tenants never share
keys.

Access: with no ``[[tenants]]`` configured every peer that can open the socket may use every
tenant; once any is configured, only listed tenants exist and each admits the uids and gids it
lists (root always).

The catalog (``namespaces.catalog``) lets a restarted daemon name the namespaces of recovered
blocks before any client reopens them.
"""

from __future__ import annotations

import enum
import logging
import os
import threading
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
import xxhash

from kvtierd.config import TenantConfig
from kvtierd.errors import AccessDeniedError, BlockNotFoundError, InvalidRequestError
from kvtierd.protocol.messages import Layout

__all__ = ["Compression", "Namespace", "NamespaceRegistry", "NamespaceSpec", "PeerCredentials"]

log = logging.getLogger("kvtierd.namespaces")

_DTYPE_BYTES = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int8": 1,
    "uint8": 1,
}


class Compression(enum.StrEnum):
    NONE = "none"
    ZSTD = "zstd"


@dataclass(frozen=True, slots=True)
class PeerCredentials:
    """A connected process, from ``SO_PEERCRED``."""

    pid: int
    uid: int
    gid: int


class NamespaceSpec(msgspec.Struct, frozen=True, array_like=True):
    """Everything that defines a namespace."""

    name: str
    tenant: str
    block_bytes: int
    layout: Layout | None
    rank: int
    world_size: int
    compression: Compression = Compression.NONE
    #: Summarise committed blocks for sparse-attention retrieval (HINT with queries).
    sparse: bool = False

    def validate(self) -> NamespaceSpec:
        """Return ``self`` or raise ``InvalidRequestError`` for an impossible combination."""
        if not 0 <= self.rank < self.world_size:
            raise InvalidRequestError(f"rank {self.rank} outside world size {self.world_size}")
        layout = self.layout
        if layout is not None and layout.dtype in _DTYPE_BYTES:
            expected = (
                2
                * layout.layers
                * layout.kv_heads
                * layout.head_dim
                * layout.block_tokens
                * _DTYPE_BYTES[layout.dtype]
            )
            if expected != self.block_bytes:
                raise InvalidRequestError(
                    f"layout gives {expected} bytes per block but block_bytes is {self.block_bytes}"
                )
        return self

    def identity(self, *, with_rank: bool) -> bytes:
        fields = [self.name, self.tenant, self.block_bytes, self.layout, self.world_size]
        if with_rank:
            fields.append(self.rank)
        return msgspec.msgpack.encode(fields)


@dataclass(eq=False, slots=True)
class Namespace:
    """A namespace known to this daemon; ``id`` is valid for this daemon's lifetime."""

    id: int
    spec: NamespaceSpec
    digest: bytes
    group_digest: bytes
    key_salt: bytes
    #: The digest of this namespace's share on every rank of its TP group (by rank).
    rank_digests: tuple[bytes, ...] = ()
    dram_blocks: int = 0
    nvme_blocks: int = 0
    blocks: int = field(default=0)

    @property
    def compress(self) -> bool:
        return self.spec.compression is Compression.ZSTD


class NamespaceRegistry:
    """All namespaces, by id and by digest, and the access rules."""

    def __init__(self, catalog: Path | None, tenants: list[TenantConfig]) -> None:
        self._catalog = catalog
        self._tenants = {t.name: t for t in tenants}
        self._by_id: dict[int, Namespace] = {}
        self._by_digest: dict[bytes, Namespace] = {}
        self._groups: dict[bytes, dict[int, Namespace]] = {}
        self._save_lock = threading.Lock()
        if catalog is not None:
            self._load(catalog)

    def __iter__(self):  # type: ignore[no-untyped-def]
        return iter(list(self._by_id.values()))

    def __len__(self) -> int:
        return len(self._by_id)

    def check_access(self, tenant: str, peer: PeerCredentials) -> None:
        if not self._tenants or peer.uid == 0:
            return
        rule = self._tenants.get(tenant)
        if rule is None or (peer.uid not in rule.uids and peer.gid not in rule.gids):
            raise AccessDeniedError(f"uid {peer.uid} may not use tenant {tenant!r}")

    def open(
        self, spec: NamespaceSpec, peer: PeerCredentials, *, create: bool = True
    ) -> tuple[Namespace, bool]:
        """The namespace for ``spec`` and whether it is new (the catalog needs saving).
        Raises ``BlockNotFoundError`` for an unknown namespace when ``create`` is false."""
        spec.validate()
        self.check_access(spec.tenant, peer)
        digest = xxhash.xxh3_128_digest(spec.identity(with_rank=True))
        known = self._by_digest.get(digest)
        if known is not None:
            return known, False
        if not create:
            raise BlockNotFoundError(f"namespace {spec.name!r} with this identity does not exist")
        return self._add(spec, digest), True

    def _add(self, spec: NamespaceSpec, digest: bytes) -> Namespace:
        group = xxhash.xxh3_128_digest(spec.identity(with_rank=False))
        salt = xxhash.xxh3_128_digest(b"kvtierd/key-salt/v1" + group)
        ranks = tuple(
            xxhash.xxh3_128_digest(msgspec.structs.replace(spec, rank=r).identity(with_rank=True))
            for r in range(spec.world_size)
        )
        ns = Namespace(len(self._by_id) + 1, spec, digest, group, salt, ranks)
        self._by_id[ns.id] = ns
        self._by_digest[digest] = ns
        self._groups.setdefault(group, {})[spec.rank] = ns
        return ns

    def adopt(self, spec: NamespaceSpec) -> Namespace | None:
        """Add a namespace learnt from elsewhere (the pool); ``None`` when it is already known or
        invalid. The caller saves the catalog."""
        try:
            spec.validate()
        except InvalidRequestError:
            return None
        digest = xxhash.xxh3_128_digest(spec.identity(with_rank=True))
        if digest in self._by_digest:
            return None
        return self._add(spec, digest)

    def get(self, ns_id: int) -> Namespace:
        try:
            return self._by_id[ns_id]
        except KeyError:
            raise InvalidRequestError(f"namespace {ns_id} is not open") from None

    def by_digest(self, digest: bytes) -> Namespace | None:
        return self._by_digest.get(digest)

    def group(self, ns: Namespace) -> list[Namespace | None]:
        """The namespace of every rank of ``ns``'s TP group (``None`` for a rank never seen)."""
        members = self._groups.get(ns.group_digest, {})
        return [members.get(rank) for rank in range(ns.spec.world_size)]

    def save(self) -> None:
        """Write the catalog atomically (small; called off the event loop)."""
        if self._catalog is None:
            return
        # Concurrent OPEN_NS calls save from several worker threads: one at a time, or they
        # share the temporary file and the catalog can end up interleaved or a rename fails.
        with self._save_lock:
            data = msgspec.msgpack.encode([ns.spec for ns in list(self._by_id.values())])
            tmp = self._catalog.with_suffix(".tmp")
            with open(tmp, "wb") as out:
                out.write(data)
                out.flush()
                os.fsync(out.fileno())
            os.replace(tmp, self._catalog)

    def _load(self, catalog: Path) -> None:
        try:
            specs = msgspec.msgpack.decode(catalog.read_bytes(), type=list[NamespaceSpec])
        except FileNotFoundError:
            return
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            log.warning("ignoring unreadable namespace catalog %s: %s", catalog, exc)
            return
        for spec in specs:
            digest = xxhash.xxh3_128_digest(spec.identity(with_rank=True))
            if digest not in self._by_digest:
                self._add(spec, digest)
