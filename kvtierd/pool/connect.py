"""Reaching the pool: one place that turns ``[pool]`` into a connected redis-py asyncio client.

TLS and credentials are handled here and nowhere else. The password (or token) comes from a file
that only the daemon's user may read: a file that the group or others can read is refused, so a
secret never sits where another account can see it. Errors are :class:`PoolUnavailableError`
with a message fit for a log line: the address, what failed, never a secret.

:func:`probe` is the write/read check every rank runs before it votes to attach (and
``kvtierctl pool check`` runs from the command line).
"""

from __future__ import annotations

import os
import secrets
import ssl
import stat
from pathlib import Path
from typing import Any, TypeAlias
from urllib.parse import urlsplit

import redis.asyncio as aioredis
import redis.exceptions
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from kvtierd.config import PoolConfig
from kvtierd.errors import KvtierError
from kvtierd.store.tier import TierUnavailableError

__all__ = [
    "POOL_ERRORS",
    "PoolUnavailableError",
    "RedisLike",
    "connect_pool",
    "describe_failure",
    "pool_address",
    "probe",
    "read_secret",
]

RedisLike: TypeAlias = "aioredis.Redis | RedisCluster"

#: What a pool operation may raise. ``RedisClusterException`` (and its ``SlotNotCoveredError``)
#: is not a ``RedisError``: a cluster client re-initialising against a cluster that is down
#: raises it, and it must never escape into the daemon's task group.
POOL_ERRORS: tuple[type[BaseException], ...] = (
    redis.exceptions.RedisError,
    redis.exceptions.RedisClusterException,
    OSError,
)

#: Building a client also rejects malformed options with ValueError.
_CONNECT_ERRORS: tuple[type[BaseException], ...] = (*POOL_ERRORS, ValueError)

#: hiredis reads a reply in pieces of this size: KV blocks are megabytes, so read big pieces.
_READ_BYTES = 1 << 20


class PoolUnavailableError(TierUnavailableError):
    """The pool cannot be reached, authenticated to, or used (``EIO`` on the wire: the caller
    falls back to its local tiers)."""


def pool_address(config: PoolConfig) -> str:
    """``scheme://host:port/db`` of the pool, without any credential: safe to log and to vote on."""
    parts = urlsplit(config.url)
    host = parts.hostname or "localhost"
    shown = f"[{host}]" if ":" in host else host
    db = parts.path.strip("/") or "0"
    return f"{parts.scheme}://{shown}:{parts.port or 6379}/{db}"


def read_secret(path: str) -> str:
    """The password or token in ``path``; refused unless only its owner (this user) can read it."""
    file = Path(path)
    try:
        info = file.stat()
        text = file.read_text()
    except OSError as exc:
        raise PoolUnavailableError(
            f"cannot read pool.password_file {path}: {exc.strerror}"
        ) from exc
    if info.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise PoolUnavailableError(
            f"pool.password_file {path} is accessible to group or others "
            f"(mode {stat.filemode(info.st_mode)}): chmod 600 it"
        )
    if info.st_uid != os.geteuid():
        raise PoolUnavailableError(
            f"pool.password_file {path} belongs to uid {info.st_uid}, not to the daemon's user"
        )
    secret = text.strip()
    if not secret:
        raise PoolUnavailableError(f"pool.password_file {path} is empty")
    return secret


def _client_kwargs(config: PoolConfig) -> dict[str, Any]:
    parts = urlsplit(config.url)
    kwargs: dict[str, Any] = {
        "host": parts.hostname or "localhost",
        "port": parts.port or 6379,
        "socket_timeout": config.timeout_s,
        "socket_connect_timeout": config.timeout_s,
        "socket_read_size": _READ_BYTES,
        "max_connections": config.max_connections,
        "client_name": "kvtierd",
        # No silent retries inside redis-py (its default backs off for seconds): a failed
        # command must fail at once, the group membership reconnects with its own back-off and
        # engines fall back to the local tiers meanwhile.
        "retry": Retry(NoBackoff(), 0),
    }
    db = parts.path.strip("/")
    if db:
        if config.cluster:
            raise PoolUnavailableError("a Redis Cluster has only database 0: drop it from pool.url")
        kwargs["db"] = int(db)
    if config.username:
        kwargs["username"] = config.username
    if config.password_file:
        kwargs["password"] = read_secret(config.password_file)
    if config.tls:
        kwargs.update(ssl=True, ssl_cert_reqs="required", ssl_check_hostname=True)
        if config.ca_file:
            kwargs["ssl_ca_certs"] = config.ca_file
        if config.cert_file:
            kwargs.update(ssl_certfile=config.cert_file, ssl_keyfile=config.key_file)
    return kwargs


def describe_failure(exc: BaseException) -> str:
    """A log-safe reason for a failed pool operation."""
    if isinstance(exc, KvtierError):  # ours carry a log-safe message already
        return str(exc)
    if isinstance(exc, redis.exceptions.AuthenticationError | redis.exceptions.NoPermissionError):
        return f"authentication refused ({type(exc).__name__})"
    if isinstance(exc, redis.exceptions.ResponseError) and "WRONGPASS" in str(exc):
        return "authentication refused (wrong user or password)"
    if isinstance(exc, ssl.SSLError):
        return f"TLS failed: {exc.reason or exc}"
    cause = exc.__cause__ or exc.__context__
    if isinstance(cause, ssl.SSLError):
        return f"TLS failed: {cause.reason or cause}"
    text = str(exc).splitlines()[0] if str(exc) else ""
    if " of pipeline caused error: " in text:  # drop the command: it quotes keys and values
        text = text.split(" of pipeline caused error: ", 1)[1]
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


async def connect_pool(config: PoolConfig) -> RedisLike:
    """A client connected (and authenticated) to the pool; raises :class:`PoolUnavailableError`."""
    kwargs = _client_kwargs(config)
    client: RedisLike
    try:
        client = RedisCluster(**kwargs) if config.cluster else aioredis.Redis(**kwargs)
    except _CONNECT_ERRORS as exc:
        raise PoolUnavailableError(
            f"pool {pool_address(config)}: {describe_failure(exc)}"
        ) from None
    try:
        if isinstance(client, RedisCluster):
            await client.initialize()
        await client.ping()
    except POOL_ERRORS as exc:
        await client.aclose()
        raise PoolUnavailableError(
            f"pool {pool_address(config)} unreachable: {describe_failure(exc)}"
        ) from None
    return client


async def probe(client: RedisLike, config: PoolConfig) -> None:
    """Write a random value, read it back, delete it: what a rank checks before voting yes."""
    key = f"{config.key_prefix}:{{{config.group}}}:probe:{config.rank}".encode()
    value = secrets.token_bytes(64)
    try:
        await client.set(key, value, px=30_000)
        seen = await client.get(key)
        await client.delete(key)
    except POOL_ERRORS as exc:
        raise PoolUnavailableError(f"pool probe failed: {describe_failure(exc)}") from None
    if seen != value:
        raise PoolUnavailableError("pool probe read back different bytes than it wrote")
