"""The crash soak's workload: its namespaces, keys and block contents, and the records a hostile
tenant forges (:mod:`kvtierd.testing.crash`, :mod:`kvtierd.testing.remote_attacks`).

A block's bytes are a function of its key (:func:`block_content`), so any block served can be
checked. A hostile block is one whole forged record as the data file lays it out: a header page
that names an honest key in the honest namespace and a payload that matches the header's
checksum (:func:`forged_record`); recovery would take it for the honest block if it ever
reached the data file. :class:`Findings` is what an attacker reports to the loop.
"""

from __future__ import annotations

import functools
from typing import Protocol

import numpy as np
import xxhash

from kvtierd.store.namespaces import NamespaceSpec
from kvtierd.store.records import PAGE_BYTES, RecordHeader, checksum

__all__ = [
    "BLOCK_BYTES",
    "HOSTILE_BLOCK_BYTES",
    "Findings",
    "block_content",
    "forged_record",
    "hostile_content",
    "hostile_key_of",
    "key_of",
]

BLOCK_BYTES = 16 * 1024 + 123  # deliberately not a page multiple
UNIVERSE = 600  # distinct keys: about 12 MiB of slots, well inside the NVMe tier
NAMESPACE = "crash"

HONEST, HOSTILE = "honest", "hostile"
HOSTILE_NAMESPACE = "crash-hostile"
#: A hostile block is one whole forged record as the data file lays it out: header page, payload.
HOSTILE_BLOCK_BYTES = PAGE_BYTES + -(-BLOCK_BYTES // PAGE_BYTES) * PAGE_BYTES
HOSTILE_UNIVERSE = 200  # keys it commits; the keys of its uncommitted ALLOCs come after these
#: Forged records claim to be newer than anything written (recovery keeps the newest record).
FORGED_SEQ = 1 << 60


class Findings(Protocol):
    """What an attacker tells the soak's loop: what it tried and what became of it, a
    violation (an honest client failing, the daemon gone), a defence that failed."""

    def action(self, kind: str, n: int = 1) -> None: ...

    def outcome(self, kind: str, n: int = 1) -> None: ...

    def violation(self, text: str) -> None: ...

    def defence_failed(self, text: str) -> None: ...


@functools.cache
def block_content(key: bytes) -> bytes:
    """The one true content of ``key``."""
    return np.random.default_rng(int.from_bytes(key[:8], "little")).bytes(BLOCK_BYTES)


def key_of(i: int) -> bytes:
    return i.to_bytes(8, "little") + b"crashkey"


def hostile_key_of(i: int) -> bytes:
    return i.to_bytes(8, "little") + b"hostile!"


def _digest(name: str, tenant: str, block_bytes: int) -> bytes:
    """A namespace's record tag: public, computable by anyone who knows its name and shape."""
    spec = NamespaceSpec(name, tenant, block_bytes, None, 0, 1)
    return xxhash.xxh3_128_digest(spec.identity(with_rank=True))


HONEST_DIGEST = _digest(NAMESPACE, HONEST, BLOCK_BYTES)
HOSTILE_DIGEST = _digest(HOSTILE_NAMESPACE, HOSTILE, HOSTILE_BLOCK_BYTES)


def forged_record(digest: bytes, key: bytes, length: int, seq: int) -> bytes:
    """A record image, header page and padded payload, that recovery would take for ``key``'s
    newest block: its payload (not ``key``'s content) matches the header's checksum."""
    payload = (b"FORGED BY THE HOSTILE TENANT " * (length // 29 + 1))[:length]
    header = RecordHeader(digest, key, length, length, checksum(payload), seq).pack()
    padded = -(-length // PAGE_BYTES) * PAGE_BYTES
    return header.ljust(PAGE_BYTES, b"\0") + payload.ljust(padded, b"\0")


@functools.cache
def hostile_content(key: bytes) -> bytes:
    """What the hostile tenant commits under ``key``: a forged record of an honest key."""
    i = int.from_bytes(key[:8], "little")
    return forged_record(HONEST_DIGEST, key_of(i % UNIVERSE), BLOCK_BYTES, FORGED_SEQ + i)
