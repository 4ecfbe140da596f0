"""The composition root: a daemon's store, with what it is joined to, for its config.

:func:`open_daemon_store` puts the parts together in the order they need each other and closes
them in the reverse one:

0. with a pool, the pool tier (:func:`pool_tier`), before anything opens: it checks the pool's
   credentials, and a credential file that cannot be used is a configuration error;
1. the store's base (:func:`kvtierd.store.lifecycle.open_store_base`: the arena with its tenant
   regions, the I/O backend, the namespace registry);
2. the NIXL export of those regions (:func:`open_nixl_reads`), each from an exporter process
   of its own (:mod:`kvtierd.nixl.export`), when ``nixl.enabled`` asks for it and NIXL passes
   its probe here; otherwise the daemon serves on without NIXL reads, and the request handlers
   answer READ_NIXL with the reason (``EOPNOTSUPP``);
3. with a pool, the peers asked before it, when ``remote.peers`` are configured and NIXL runs
   (:func:`open_peer_reads`), the tier then wrapped in a
   :class:`~kvtierd.server.peers.PeerFirstTier`;
4. the store itself, handed a :class:`~kvtierd.store.ports.Replica`: the (wrapped) tier to
   promote pool-only copies from, and how to open the link
   (:func:`kvtierd.pool.link.open_pool_link`, which owns the link's tasks and gives queued
   writes half the shutdown grace to reach the pool); the link is kept as the pool's own type
   for the daemon's status and metrics (:class:`Assembled`).

It sits above both :mod:`kvtierd.store` and :mod:`kvtierd.pool`, which do not import each
other's insides: the store names what it needs from a replica link in
:mod:`kvtierd.store.ports`, the pool implements it, and only this module knows both. Nothing
is set on a part after it was made: each gets what it uses when it is built.

Closing runs the other way: the store (the link's grace, the write-back drain, the index
snapshot) while the peers and the exporters still run, then the peers, then the exporters, and
only then the arena they map and the backend.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
from collections.abc import AsyncIterator
from dataclasses import dataclass
from functools import partial

import anyio

from kvtierd.config import Config, PoolConfig
from kvtierd.errors import ConfigError, NotSupportedError
from kvtierd.io import BindingVerdict
from kvtierd.nixl.agent import TransferError
from kvtierd.nixl.export import NIXL_OFF, NixlReads, open_region_export
from kvtierd.nixl.exporter import forbid_dumps
from kvtierd.nixl.probe import probe_nixl
from kvtierd.pool.connect import PoolUnavailableError, pool_address, read_secret
from kvtierd.pool.link import PoolLink, open_pool_link
from kvtierd.pool.tier import PoolTier
from kvtierd.pool.values import PoolNames
from kvtierd.server.peers import PeerFirstTier, PeerReads, peer_endpoints
from kvtierd.store.index import Block
from kvtierd.store.kept import DramKeeper
from kvtierd.store.lifecycle import (
    OpenPhase,
    OpenProgress,
    StoreBase,
    open_store,
    open_store_base,
)
from kvtierd.store.namespaces import NamespaceRegistry, NamespaceSpec
from kvtierd.store.ports import Replica, StoreForReplica
from kvtierd.store.store import BlockStore

__all__ = [
    "Assembled",
    "open_daemon_store",
    "open_nixl_reads",
    "open_peer_reads",
    "pool_tier",
]

log = logging.getLogger("kvtierd.store")


def pool_tier(config: PoolConfig) -> PoolTier:
    """The pool tier for ``config``; nothing connects until the store opens the link. Raises
    :class:`ConfigError` for a credential file that cannot be used."""
    try:
        if config.password_file:
            read_secret(config.password_file)
    except PoolUnavailableError as exc:
        raise ConfigError(str(exc)) from None
    if not config.tls:
        log.warning(
            "pool %s is plaintext (pool.allow_plaintext = true): blocks and credentials cross "
            "the network unencrypted",
            pool_address(config),
        )
    return PoolTier(config, PoolNames(config.key_prefix, config.group, config.rank))


@dataclass(frozen=True, slots=True)
class Assembled:
    """What a daemon serves from: the store, its link to the shared pool as the pool's own type
    (for status and metrics; ``None`` without a pool), and the NIXL export of its regions (or
    why there is none)."""

    store: BlockStore
    pool: PoolLink[Block] | None
    nixl: NixlReads


@contextlib.asynccontextmanager
async def open_daemon_store(
    config: Config,
    *,
    io_verdict: BindingVerdict | None = None,
    progress: OpenProgress | None = None,
    keeper: DramKeeper | None = None,
) -> AsyncIterator[Assembled]:
    """The store for ``config`` and what it is joined to, opened in order and closed in the
    reverse one: its base (arena, regions, registry), the NIXL export of the regions, the
    peers, and the store itself with the pool tier (wrapped in a :class:`PeerFirstTier` when
    there are peers) and its link. The pool's credentials are checked before anything opens
    (:class:`ConfigError`). ``keeper``: who keeps the DRAM across restarts (systemd's
    file-descriptor store, :mod:`kvtierd.server.fdstore`)."""
    tier = pool_tier(config.pool) if config.pool.url else None  # before anything starts
    progress = progress if progress is not None else OpenProgress()  # one for every step
    async with contextlib.AsyncExitStack() as stack:
        base = await stack.enter_async_context(
            open_store_base(config, io_verdict=io_verdict, progress=progress, keeper=keeper)
        )
        nixl = await stack.enter_async_context(open_nixl_reads(config, base, progress))
        replica = None
        opener = None
        if tier is not None:
            peers = await stack.enter_async_context(open_peer_reads(config, base.registry, nixl))
            opener = _LinkOpener(config.pool, tier, config.daemon.shutdown_grace_s / 2)
            replica = Replica(tier if peers is None else PeerFirstTier(tier, peers), opener.open)
        store = await stack.enter_async_context(
            open_store(config, progress=progress, replica=replica, base=base)
        )
        yield Assembled(store, opener.link if opener is not None else None, nixl)


@dataclass
class _LinkOpener:
    """Opens the pool link for the store (:func:`open_pool_link`) and keeps it as the pool's
    own type, which the store sees only through its port."""

    config: PoolConfig
    tier: PoolTier
    grace_s: float
    link: PoolLink[Block] | None = None

    @contextlib.asynccontextmanager
    async def open(self, store: StoreForReplica[Block]) -> AsyncIterator[PoolLink[Block]]:
        async with open_pool_link(self.config, self.tier, store, grace_s=self.grace_s) as link:
            self.link = link
            yield link


@contextlib.asynccontextmanager
async def open_nixl_reads(
    config: Config, base: StoreBase, progress: OpenProgress
) -> AsyncIterator[NixlReads]:
    """The NIXL export of the tenant regions of ``base`` (an exporter process each,
    supervised), for as long as the daemon serves; or, when ``nixl.enabled`` is false or NIXL
    cannot run here, why not (logged)."""
    if not config.nixl.enabled:
        yield NIXL_OFF
        return
    progress.advance(OpenPhase.EXPORTING)
    name = f"kvtierd-{socket.gethostname()}-{os.getpid()}"
    probe = partial(probe_nixl, timeout_s=config.nixl.probe_timeout_s)
    async with contextlib.AsyncExitStack() as stack:
        try:
            export = await stack.enter_async_context(
                open_region_export(
                    name,
                    base.arena.address,
                    base.regions,
                    start_timeout_s=config.nixl.probe_timeout_s,
                    probe=probe,
                    landing_slot_bytes=config.limits.max_block_bytes,
                    user=config.nixl.exporter_user,
                )
            )
        except (NotSupportedError, TransferError) as exc:
            log.warning("NIXL reads are off: %s", exc)
            yield NixlReads(None, str(exc))
            return
        if os.geteuid() != 0:  # the exporters keep this uid (docs/nixl.md)
            forbid_dumps()
            log.info("not dumpable: the NIXL exporters run as this daemon's uid")
        yield NixlReads(export)


@contextlib.asynccontextmanager
async def open_peer_reads(
    config: Config, registry: NamespaceRegistry, nixl: NixlReads
) -> AsyncIterator[PeerReads | None]:
    """Ask ``remote.peers`` first for blocks only the pool holds (:mod:`kvtierd.server.peers`),
    while the block ends; ``None`` when there are no peers, no pool or no NIXL (logged)."""
    if not config.remote.peers or not config.pool.url:
        yield None
        return
    if nixl.export is None:
        log.warning("remote.peers are not asked: %s", nixl.why_not)
        yield None
        return
    endpoints = peer_endpoints(config.remote)

    def spec_of(digest: bytes) -> NamespaceSpec | None:
        ns = registry.by_digest(digest)
        return ns.spec if ns is not None else None

    async with anyio.create_task_group() as tg:  # the peer connections' tasks
        peers = PeerReads(endpoints, nixl.export, spec_of, tg)
        log.info("blocks only the pool holds are asked of %s first", ", ".join(map(str, endpoints)))
        try:
            yield peers
        finally:
            await peers.aclose()  # each connection's task sends DESTROY (shielded, bounded)
            tg.cancel_scope.cancel()  # and none started meanwhile outlives the block
