"""Namespaces: what makes blocks comparable, who may use them, and their persistent catalog.

A namespace's identity is its name, tenant, block size, layout and TP rank/world size; its
16-byte ``digest`` (xxh3-128 of that identity) tags every record on disk, so a block can only
ever be served to the layout that wrote it. The ranks of one TP group share a ``group_digest``
and therefore a ``key_salt``: the same tokens give the same keys on every rank, which is what
lets a lookup answer for the whole group. The tenant enters the salt, so tenants never share
keys; and the salt is a keyed hash (BLAKE2b) under the daemon's secret
(:mod:`kvtierd.store.secret`), so no one can compute another tenant's keys from public inputs
and ask whether a prompt is cached for it.

Access: with no ``[[tenants]]`` configured every peer that can open the socket may use every
tenant; once any is configured, only listed tenants exist and each admits the uids and gids it
lists (root always). Every number a request chooses is bounded here before anything is
computed from it (``[limits]``), and namespaces are counted per tenant.

The catalog (``namespaces.catalog``) lets a restarted daemon name the namespaces of recovered
blocks before any client reopens them. A copy removed, replaced or changed under the running
daemon is rewritten from memory (:meth:`NamespaceRegistry.restore_catalog`, asked by the disk
watch at every FSYNC and health tick); only a rewrite that fails is a health condition.
"""

from __future__ import annotations

import enum
import hashlib
import logging
import os
import stat
import threading
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
import xxhash

from kvtierd.config import LimitsConfig, TenantConfig
from kvtierd.errors import (
    AccessDeniedError,
    BlockNotFoundError,
    InvalidRequestError,
    NoSpaceError,
    QuotaError,
    StorageIOError,
    UnknownTenantError,
)
from kvtierd.layouts import layout_block_bytes
from kvtierd.protocol.messages import Layout
from kvtierd.store.catalog import (
    CatalogCopy,
    CopyState,
    copy_paths,
    read_copies,
    write_copies,
)
from kvtierd.store.regions import Regions, TenantRegion

__all__ = [
    "Compression",
    "Namespace",
    "NamespaceCounters",
    "NamespaceRegistry",
    "NamespaceSpec",
    "PeerCredentials",
]

log = logging.getLogger("kvtierd.namespaces")

#: What names one catalog copy as last seen: device, inode, file type, size, mtime (``None``:
#: none there). An inode number freed by an unlink may come back at once for another file.
_Identity = tuple[int, int, int, int, int] | None


def _copy_identities(catalog: Path) -> tuple[_Identity, _Identity]:
    first, second = (_identity(path) for path in copy_paths(catalog))
    return first, second


def _identity(path: Path) -> _Identity:
    try:
        status = os.stat(path)
    except FileNotFoundError:
        return None
    except OSError:
        return (-1, -1, -1, -1, -1)  # unreadable now: differs from anything seen, so rewritten
    kind = stat.S_IFMT(status.st_mode)
    return status.st_dev, status.st_ino, kind, status.st_size, status.st_mtime_ns


def _change(path: Path, was: _Identity, now: _Identity) -> str:
    if now is None:
        return f"the namespace catalog copy {path} was removed"
    if was is None or was[:3] != now[:3]:
        return f"another file was put at the namespace catalog copy {path}"
    return f"the namespace catalog copy {path} was changed in place"


#: Sanity bounds on a layout's fields (far beyond any model), so nothing sized by them can be
#: made absurdly large by a client.
_LAYOUT_BOUNDS = {"layers": 4096, "kv_heads": 4096, "head_dim": 65536, "block_tokens": 1 << 20}


class Compression(enum.StrEnum):
    NONE = "none"
    ZSTD = "zstd"


@dataclass(frozen=True, slots=True)
class PeerCredentials:
    """A connected process, from ``SO_PEERCRED``; for a client on another host (a TCP
    connection, :mod:`kvtierd.server.remote`) pid 0, the uid its certificate acts as, gid -1
    (no group), and ``remote`` saying where it connects from and who it is."""

    pid: int
    uid: int
    gid: int
    remote: str = ""

    def __str__(self) -> str:
        if self.remote:
            return f"{self.remote} uid {self.uid}"
        return f"pid {self.pid} uid {self.uid}"


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

    def validate(self, limits: LimitsConfig | None = None) -> NamespaceSpec:
        """Return ``self`` or raise ``InvalidRequestError`` for an impossible combination or a
        number beyond ``limits``."""
        limits = limits or LimitsConfig()
        if self.world_size > limits.max_world_size:
            raise InvalidRequestError(
                f"world_size {self.world_size} exceeds limits.max_world_size "
                f"{limits.max_world_size}"
            )
        if self.block_bytes > limits.max_block_bytes:
            raise InvalidRequestError(
                f"block_bytes {self.block_bytes} exceeds limits.max_block_bytes "
                f"{limits.max_block_bytes}"
            )
        if not 0 <= self.rank < self.world_size:
            raise InvalidRequestError(f"rank {self.rank} outside world size {self.world_size}")
        layout = self.layout
        if layout is not None:
            for name, bound in _LAYOUT_BOUNDS.items():
                if getattr(layout, name) > bound:
                    raise InvalidRequestError(f"layout.{name} exceeds {bound}")
        expected = layout_block_bytes(layout) if layout is not None else None
        if expected is not None and expected != self.block_bytes:
            raise InvalidRequestError(
                f"layout gives {expected} bytes per block but block_bytes is {self.block_bytes}"
            )
        return self

    def identity(self, *, with_rank: bool) -> bytes:
        fields = [self.name, self.tenant, self.block_bytes, self.layout, self.world_size]
        if with_rank:
            fields.append(self.rank)
        return msgspec.msgpack.encode(fields)


@dataclass(slots=True)
class NamespaceCounters:
    """What one namespace's clients asked for and got, since the daemon started (blocks and
    bytes; tokens are blocks times the layout's ``block_tokens`` where it has a layout)."""

    lookup_blocks: int = 0
    hit_blocks: int = 0
    read_blocks: int = 0
    read_bytes: int = 0
    committed_blocks: int = 0
    committed_bytes: int = 0


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
    #: Where its blocks live in DRAM (its tenant's region); ``None``: no region holds it.
    region: TenantRegion | None = None
    dram_blocks: int = 0
    nvme_blocks: int = 0
    blocks: int = field(default=0)
    counters: NamespaceCounters = field(default_factory=NamespaceCounters)

    @property
    def compress(self) -> bool:
        return self.spec.compression is Compression.ZSTD


class NamespaceRegistry:
    """All namespaces, by id and by digest, and the access rules."""

    def __init__(
        self,
        catalog: Path | None,
        tenants: list[TenantConfig],
        *,
        secret: bytes,
        regions: Regions | None = None,
        limits: LimitsConfig | None = None,
    ) -> None:
        """``secret`` keys every salt; ``regions`` places each namespace's blocks."""
        if len(secret) < 16:
            raise ValueError("the key secret must hold at least 16 bytes")
        self._secret = secret
        self._regions = regions
        self.limits = limits or LimitsConfig()
        self._per_tenant: dict[str, int] = {}
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

    def may_use(self, tenant: str, peer: PeerCredentials) -> bool:
        """Whether ``peer`` is admitted to ``tenant``."""
        try:
            self.check_access(tenant, peer)
        except AccessDeniedError:  # UnknownTenantError too
            return False
        return True

    def check_access(self, tenant: str, peer: PeerCredentials) -> None:
        if not self._tenants or peer.uid == 0:
            return
        rule = self._tenants.get(tenant)
        if rule is not None and (peer.uid in rule.uids or peer.gid in rule.gids):
            return
        own = [t.name for t in self._tenants.values() if peer.uid in t.uids or peer.gid in t.gids]
        if rule is None and own:  # a name it got wrong: say so, naming only its own tenants
            raise UnknownTenantError(
                f"no tenant {tenant!r}: uid {peer.uid} may use {', '.join(map(repr, own))}"
            )
        raise AccessDeniedError(f"uid {peer.uid} may not use tenant {tenant!r}")

    def open(
        self, spec: NamespaceSpec, peer: PeerCredentials, *, create: bool = True
    ) -> tuple[Namespace, bool]:
        """The namespace for ``spec`` and whether it is new (the catalog needs saving).
        Raises ``BlockNotFoundError`` for an unknown namespace when ``create`` is false."""
        self.check_access(spec.tenant, peer)  # first: a stranger learns nothing from errors
        spec.validate(self.limits)
        digest = xxhash.xxh3_128_digest(spec.identity(with_rank=True))
        known = self._by_digest.get(digest)
        if known is not None:
            return known, False
        if not create:
            raise BlockNotFoundError(f"namespace {spec.name!r} with this identity does not exist")
        region = self._regions.for_tenant(spec.tenant) if self._regions is not None else None
        if self._regions is not None and region is None:
            if self._tenants and spec.tenant not in self._tenants:
                raise UnknownTenantError(
                    f"no tenant {spec.tenant!r}: the daemon's tenants are "
                    f"{', '.join(map(repr, self._tenants))}, and every byte of DRAM went to "
                    "them (no default region for others)"
                )
            raise NoSpaceError(
                f"tenant {spec.tenant!r} has no DRAM region (every byte went to listed tenants)"
            )
        if region is not None and spec.block_bytes > region.allocator.capacity:
            raise NoSpaceError(
                f"a {spec.block_bytes}-byte block does not fit tenant {spec.tenant!r}'s "
                f"{region.allocator.capacity}-byte DRAM region"
            )
        limits = self.limits
        if self._per_tenant.get(spec.tenant, 0) >= limits.max_namespaces_per_tenant:
            raise QuotaError(
                f"tenant {spec.tenant!r} has {limits.max_namespaces_per_tenant} namespaces "
                "(limits.max_namespaces_per_tenant)"
            )
        if len(self._by_id) >= limits.max_namespaces:
            raise QuotaError(f"the daemon holds {limits.max_namespaces} namespaces (limits)")
        return self._add(spec, digest), True

    def _add(self, spec: NamespaceSpec, digest: bytes) -> Namespace:
        group = xxhash.xxh3_128_digest(spec.identity(with_rank=False))
        salt = hashlib.blake2b(
            group, digest_size=16, key=self._secret, person=b"kvtierd-salt-v2"
        ).digest()
        ranks = tuple(
            xxhash.xxh3_128_digest(msgspec.structs.replace(spec, rank=r).identity(with_rank=True))
            for r in range(spec.world_size)
        )
        region = self._regions.for_tenant(spec.tenant) if self._regions is not None else None
        ns = Namespace(len(self._by_id) + 1, spec, digest, group, salt, ranks, region)
        self._per_tenant[spec.tenant] = self._per_tenant.get(spec.tenant, 0) + 1
        self._by_id[ns.id] = ns
        self._by_digest[digest] = ns
        self._groups.setdefault(group, {})[spec.rank] = ns
        return ns

    def adopt(self, spec: NamespaceSpec) -> Namespace | None:
        """Add a namespace learnt from elsewhere (the pool); ``None`` when it is already known or
        invalid. The caller saves the catalog."""
        try:
            spec.validate(self.limits)
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

    def find(self, ns_id: int) -> Namespace | None:
        """:meth:`get`, ``None`` for an id that names no namespace."""
        return self._by_id.get(ns_id)

    def by_digest(self, digest: bytes) -> Namespace | None:
        return self._by_digest.get(digest)

    def group(self, ns: Namespace) -> list[Namespace | None]:
        """The namespace of every rank of ``ns``'s TP group (``None`` for a rank never seen)."""
        members = self._groups.get(ns.group_digest, {})
        return [members.get(rank) for rank in range(ns.spec.world_size)]

    def save(self) -> None:
        """Write the catalog durably, both copies (:mod:`kvtierd.store.catalog`); small, called
        off the event loop. Returns at once when there is nothing to write.

        Raises ``NoSpaceError`` (``ENOSPC``, ``EDQUOT``) or ``StorageIOError`` when a namespace
        not saved before could not be saved now: it stays unsaved (:meth:`needs_save`), so the
        next caller retries, and nothing that depends on it may be acknowledged. Failing only to
        rewrite a damaged copy, while every namespace is durable in the other, is logged.
        """
        if self._catalog is None:
            return
        # Concurrent OPEN_NS calls save from several worker threads: one at a time, or they
        # share the temporary file and the catalog can end up interleaved or a rename fails.
        with self._save_lock:
            namespaces = list(self._by_id.values())
            unsaved = [ns for ns in namespaces if ns.digest not in self._durable]
            if not unsaved and not self._catalog_repair:
                return
            try:
                specs = [ns.spec for ns in namespaces] + self._beyond_limits
                write_copies(self._catalog, msgspec.msgpack.encode(specs))
            except (NoSpaceError, StorageIOError) as exc:
                if unsaved:
                    raise
                log.warning("%s; the damaged copy is rewritten at the next save", exc)
                return
            self._saved(namespaces)

    def restore_catalog(self) -> str | None:
        """Rewrite the catalog from memory when a copy is no longer the file the daemon last
        wrote or read (removed, another file in its place, changed in place: its device,
        inode, size or mtime moved); what was found, or ``None`` when nothing changed (or the
        daemon has no namespace a catalog must name). Runs off the event loop (the watch's
        timer and every FSYNC, :mod:`kvtierd.store.diskwatch`). Raises ``NoSpaceError`` or
        ``StorageIOError``, naming what was found, when the rewrite fails.

        Why rewrite rather than only report: the daemon owns the catalog and rewrites it whole
        at every save anyway, and memory holds every namespace it ever loaded or created (the
        union any copy could name), so the rewrite is exact; while it succeeds nothing
        acknowledged is at risk."""
        if self._catalog is None:
            return None
        with self._save_lock:
            if not self._durable and not self._beyond_limits:
                return None
            now = _copy_identities(self._catalog)
            paths = copy_paths(self._catalog)
            found = [
                _change(path, was, is_)
                for path, was, is_ in zip(paths, self._identities, now, strict=True)
                if was != is_
            ]
            if not found:
                return None
            what = "; ".join(found)
            namespaces = list(self._by_id.values())
            specs = [ns.spec for ns in namespaces] + self._beyond_limits
            try:
                write_copies(self._catalog, msgspec.msgpack.encode(specs))
            except NoSpaceError as exc:
                raise NoSpaceError(f"{what}, and rewriting it failed: {exc}") from exc
            except StorageIOError as exc:
                raise StorageIOError(f"{what}, and rewriting it failed: {exc}") from exc
            self._saved(namespaces)
            return f"{what}; rewritten from memory ({len(specs)} namespaces)"

    def _load(self, catalog: Path) -> None:
        """Adopt the union of the catalog's readable copies; note whether one needs rewriting."""
        #: Digests of the namespaces some intact copy of the catalog holds.
        self._durable: set[bytes] = set()
        #: Namespaces of the catalog beyond today's limits: not served, but kept in every save
        #: (raising the limit again brings them and their blocks back).
        self._beyond_limits: list[NamespaceSpec] = []
        #: Whether a copy is damaged, missing, legacy or behind the other.
        self._catalog_repair: bool = False
        copies = read_copies(catalog)
        #: What each copy was when last read or written (:meth:`restore_catalog`).
        self._identities = _copy_identities(catalog)
        readable = 0
        for copy in copies:
            specs = self._catalog_specs(copy)
            if specs is None:
                continue
            readable += 1
            for spec in specs:
                try:  # a catalog an older daemon wrote may name a namespace beyond today's limits
                    spec.validate(self.limits)
                except InvalidRequestError as exc:
                    log.warning("not serving namespace %r of the catalog: %s", spec.name, exc)
                    if spec not in self._beyond_limits:
                        self._beyond_limits.append(spec)
                    continue
                digest = xxhash.xxh3_128_digest(spec.identity(with_rank=True))
                self._durable.add(digest)
                if digest not in self._by_digest:
                    self._add(spec, digest)
        if readable == 0 and any(copy.state is not CopyState.MISSING for copy in copies):
            log.error(
                "no readable copy of the namespace catalog %s: blocks of the namespaces it "
                "named cannot be recovered",
                catalog,
            )
        # A damaged, missing or legacy copy, or two copies that differ (a crash between their
        # writes): the next save rewrites both.
        listed = {copy.payload for copy in copies}
        self._catalog_repair = bool(self._durable) and (
            len(listed) != 1 or any(copy.state is not CopyState.INTACT for copy in copies)
        )

    def needs_save(self, ns: Namespace) -> bool:
        """Whether :meth:`save` must run (and succeed) before anything that names ``ns`` may
        be acknowledged: ``True`` until a save that included ``ns`` succeeded, and while a
        damaged copy of the catalog awaits rewriting. Always ``False`` without a catalog."""
        if self._catalog is None:
            return False
        return self._catalog_repair or ns.digest not in self._durable

    def _saved(self, namespaces: list[Namespace]) -> None:
        """A save that held ``namespaces`` reached both copies."""
        self._durable.update(ns.digest for ns in namespaces)
        self._catalog_repair = False
        if self._catalog is not None:
            self._identities = _copy_identities(self._catalog)

    @staticmethod
    def _catalog_specs(copy: CatalogCopy) -> list[NamespaceSpec] | None:
        """The specs of one copy, or ``None`` (logged) when it is missing or unusable."""
        if copy.state is CopyState.MISSING:
            return None
        if copy.state is CopyState.DAMAGED:
            log.warning("ignoring damaged namespace catalog copy %s: %s", copy.path, copy.problem)
            return None
        try:
            return msgspec.msgpack.decode(copy.payload, type=list[NamespaceSpec])
        except msgspec.DecodeError as exc:  # ValidationError included
            log.warning("ignoring damaged namespace catalog copy %s: %s", copy.path, exc)
            return None
