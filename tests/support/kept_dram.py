"""Blocks the kept-DRAM tests store through a real daemon and read back, in one place for the
tests of the feature and of its attacks: blocks nobody could mistake for another (their tag
and key, repeated), put and FSYNCed, the tier of each without promoting it, and their bytes."""

from __future__ import annotations

from kvtierd.client import connect
from kvtierd.keys import chain_keys
from kvtierd.testing import DaemonProcess

__all__ = ["BLOCK", "pattern", "put_blocks", "read_blocks", "tiers_of"]

BLOCK = 64 << 10


def pattern(tag: bytes, key: bytes) -> bytes:
    unit = tag + key
    return (unit * (BLOCK // len(unit) + 1))[:BLOCK]


def put_blocks(
    daemon: DaemonProcess,
    count: int,
    name: str = "kept",
    tenant: str = "default",
    *,
    durable: bool = True,
) -> list[bytes]:
    """``count`` blocks of namespace ``name``, each its ``pattern`` (tagged by ``name``),
    FSYNCed when ``durable``; their keys."""
    with connect(daemon.socket) as client:
        ns = client.namespace(name, block_bytes=BLOCK, tenant=tenant)
        keys = chain_keys(range(16 * count), 16, ns.key_salt)
        assert ns.put(keys, [pattern(name.encode(), k) for k in keys]) == count
        if durable:
            client.fsync()
    return keys


def tiers_of(
    daemon: DaemonProcess, keys: list[bytes], name: str = "kept", tenant: str = "default"
) -> list[str | None]:
    """Where each block is, without moving any."""
    with connect(daemon.socket) as client:
        ns = client.namespace(name, block_bytes=BLOCK, tenant=tenant)
        return ns.lookup_each(keys, promote=False)


def read_blocks(
    daemon: DaemonProcess, keys: list[bytes], name: str = "kept", tenant: str = "default"
) -> list[bytes]:
    with connect(daemon.socket) as client:
        ns = client.namespace(name, block_bytes=BLOCK, tenant=tenant)
        with ns.get(keys) as views:
            return [bytes(view) for view in views]
