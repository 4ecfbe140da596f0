"""What names a block's bytes in every tier below DRAM (:class:`BlockRef`), and what a tier
found of them when it opened (:class:`Recovered`): the vocabulary of the lower-tier port
(:mod:`kvtierd.store.tier`), in a module of its own so that the tiers' row views
(:mod:`kvtierd.store.coldrefs`) can use it without importing the port."""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass

__all__ = ["BlockRef", "Recovered"]


@dataclass(frozen=True, slots=True)
class BlockRef:
    """What identifies a block's bytes in every tier.

    ``checksum`` is the xxh3-64 of the ``raw_bytes`` bytes the client committed; ``seq`` grows
    with every commit in the daemon, so the newest copy of a key wins after recovery.
    """

    ns_digest: bytes
    key: bytes
    raw_bytes: int
    checksum: int
    seq: int
    compress: bool = False


@dataclass(frozen=True, slots=True)
class Recovered:
    """A block a tier found intact (by its header) when it opened."""

    ref: BlockRef
    location: Hashable
