"""The composition root: the store, the shared pool joined to it, and the NIXL export of its
arena, and the peers asked before the pool, for a daemon's config.

It sits above both :mod:`kvtierd.store` and :mod:`kvtierd.pool`, which do not import each
other's insides: the store names what it needs from a replica link in
:mod:`kvtierd.store.ports`, the pool implements it, and only this module knows both. It checks
the pool's credentials before anything starts (a credential file that cannot be used is a
configuration error), builds the pool tier, and hands the store a
:class:`~kvtierd.store.ports.Replica`: the tier to promote pool-only copies from, and how to
open the link (:func:`kvtierd.pool.link.open_pool_link`, which owns the link's tasks and gives
queued writes half the shutdown grace to reach the pool).

:func:`open_nixl_reads` exports the store's tenant regions over NIXL, each from an exporter
process of its own (:mod:`kvtierd.nixl.export`), when ``nixl.enabled`` asks for it and NIXL
passes its probe here; otherwise the daemon serves on without NIXL reads,
and the request handlers answer READ_NIXL with the reason (``EOPNOTSUPP``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
from collections.abc import AsyncIterator
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
from kvtierd.server.peers import PeerReads, peer_endpoints
from kvtierd.store.index import Block
from kvtierd.store.lifecycle import OpenProgress, open_store
from kvtierd.store.namespaces import NamespaceSpec
from kvtierd.store.ports import Replica
from kvtierd.store.store import BlockStore

__all__ = [
    "open_daemon_store",
    "open_nixl_reads",
    "open_peer_reads",
    "pool_link_of",
    "pool_replica",
]

log = logging.getLogger("kvtierd.store")


def pool_replica(config: PoolConfig, *, grace_s: float) -> Replica:
    """The pool tier and how to open this rank's link to it; nothing connects until the store
    opens the link. Raises :class:`ConfigError` for a credential file that cannot be used."""
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
    tier = PoolTier(config, PoolNames(config.key_prefix, config.group, config.rank))
    return Replica(tier, partial(open_pool_link, config, tier, grace_s=grace_s))


def pool_link_of(store: BlockStore) -> PoolLink[Block] | None:
    """The store's pool link, as the pool's own type (for status and metrics)."""
    return store.pool if isinstance(store.pool, PoolLink) else None


@contextlib.asynccontextmanager
async def open_daemon_store(
    config: Config,
    *,
    io_verdict: BindingVerdict | None = None,
    progress: OpenProgress | None = None,
) -> AsyncIterator[BlockStore]:
    """:func:`kvtierd.store.open_store` for ``config``, joined to the pool when one is
    configured."""
    replica = None
    if config.pool.url:
        replica = pool_replica(config.pool, grace_s=config.daemon.shutdown_grace_s / 2)
    async with open_store(
        config, io_verdict=io_verdict, progress=progress, replica=replica
    ) as store:
        yield store


@contextlib.asynccontextmanager
async def open_nixl_reads(config: Config, store: BlockStore) -> AsyncIterator[NixlReads]:
    """The NIXL export of ``store``'s tenant regions (an exporter process each, supervised), for
    as long as the daemon serves; or, when ``nixl.enabled`` is false or NIXL cannot run here,
    why not (logged)."""
    if not config.nixl.enabled:
        yield NIXL_OFF
        return
    name = f"kvtierd-{socket.gethostname()}-{os.getpid()}"
    probe = partial(probe_nixl, timeout_s=config.nixl.probe_timeout_s)
    async with contextlib.AsyncExitStack() as stack:
        try:
            export = await stack.enter_async_context(
                open_region_export(
                    name,
                    store.arena.address,
                    store.regions,
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
    config: Config, store: BlockStore, nixl: NixlReads
) -> AsyncIterator[PeerReads | None]:
    """Ask ``remote.peers`` first for blocks only the pool holds (:mod:`kvtierd.server.peers`),
    while the block ends; ``None`` when there are no peers, no pool or no NIXL (logged)."""
    link = pool_link_of(store)
    if not config.remote.peers or link is None:
        yield None
        return
    if nixl.export is None:
        log.warning("remote.peers are not asked: %s", nixl.why_not)
        yield None
        return
    endpoints = peer_endpoints(config.remote)

    def spec_of(digest: bytes) -> NamespaceSpec | None:
        ns = store.registry.by_digest(digest)
        return ns.spec if ns is not None else None

    async with anyio.create_task_group() as tg:  # the peer connections' tasks
        peers = PeerReads(endpoints, nixl.export, spec_of, tg)
        link.tier.peer_source = peers
        log.info("blocks only the pool holds are asked of %s first", ", ".join(map(str, endpoints)))
        try:
            yield peers
        finally:
            link.tier.peer_source = None
            await peers.aclose()  # each connection's task sends DESTROY (shielded, bounded)
            tg.cancel_scope.cancel()  # and none started meanwhile outlives the block
