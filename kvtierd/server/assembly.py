"""The composition root: the store, and the shared pool joined to it, for a daemon's config.

It sits above both :mod:`kvtierd.store` and :mod:`kvtierd.pool`, which do not import each
other's insides: the store names what it needs from a replica link in
:mod:`kvtierd.store.ports`, the pool implements it, and only this module knows both. It checks
the pool's credentials before anything starts (a credential file that cannot be used is a
configuration error), builds the pool tier, and hands the store a
:class:`~kvtierd.store.ports.Replica`: the tier to promote pool-only copies from, and how to
open the link (:func:`kvtierd.pool.link.open_pool_link`, which owns the link's tasks and gives
queued writes half the shutdown grace to reach the pool).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator
from functools import partial

from kvtierd.config import Config, PoolConfig
from kvtierd.errors import ConfigError
from kvtierd.io import BindingVerdict
from kvtierd.pool.connect import PoolUnavailableError, pool_address, read_secret
from kvtierd.pool.link import PoolLink, open_pool_link
from kvtierd.pool.tier import PoolTier
from kvtierd.pool.values import PoolNames
from kvtierd.store.index import Block
from kvtierd.store.lifecycle import OpenProgress, open_store
from kvtierd.store.ports import Replica
from kvtierd.store.store import BlockStore

__all__ = ["open_daemon_store", "pool_link_of", "pool_replica"]

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
