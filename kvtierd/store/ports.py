"""The two narrow ports where the store meets a replica link (the shared pool,
:mod:`kvtierd.pool.link`), so that neither imports the other.

* :class:`ReplicaLink`: what the store asks of a link: is the shared tier reachable, which
  leading keys does a TP group hold there, here are newly committed blocks, this block was
  forgotten, wait until what was committed up to a point is replicated.
* :class:`StoreForReplica`: what a link may ask of the store: find a block, pin it resident and
  read its committed bytes, record or drop its shared copy, adopt a copy found in the shared
  tier. It never changes the index any other way.

A link holds the store's blocks only as handles it may read a little of
(:class:`Replicated`: which block, its ref, whether it was forgotten, its shared copy) and hands
back to the store; the types say so: a link is generic in the handle type, and nothing of it
can change a block or read its other tiers.

:class:`Replica` is how the composition root (:mod:`kvtierd.server.assembly`) hands the store a
link: the shared tier itself (the store promotes pool-only copies from it like from any lower
tier) and how to open the link over the store's port, as an async context manager that owns
the link's tasks.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterator
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from typing import Protocol, TypeVar

from kvtierd.store.index import Block
from kvtierd.store.namespaces import Namespace, NamespaceRegistry, NamespaceSpec
from kvtierd.store.tier import BlockRef, LowerTier

__all__ = ["Replica", "ReplicaLink", "Replicated", "StoreForReplica"]


class Replicated(Protocol):
    """What a link may read of a block it was handed (read-only)."""

    @property
    def id(self) -> tuple[bytes, bytes]:
        """``(namespace digest, key)``."""

    @property
    def ref(self) -> BlockRef: ...

    @property
    def forgotten(self) -> bool: ...

    @property
    def pool(self) -> Hashable | None:
        """Where the shared tier holds it (``None``: not there)."""


H = TypeVar("H", bound=Replicated)


class ReplicaLink(Protocol):
    """What the store needs from a replica link."""

    @property
    def attached(self) -> bool:
        """Whether the shared tier can be used now (a pool-only copy is out of reach if not)."""

    @property
    def fsync_waits(self) -> bool:
        """Whether FSYNC waits for the blocks it covers to be replicated too."""

    async def settle(self) -> None:
        """Wait (bounded) until the link knows where it stands (restored from the shared tier,
        or working without it), so a restarted rank serves what it holds from the first
        request."""

    def group_lookup(self, ns: Namespace) -> bool:
        """Whether LOOKUP for ``ns`` must ask the shared tier (an attached TP group)."""

    async def group_hits(self, ns: Namespace, keys: list[bytes]) -> int:
        """Leading ``keys`` that every rank of ``ns``'s group holds in the shared tier; raises
        :class:`~kvtierd.store.tier.TierUnavailableError` when it cannot answer."""

    async def committed(self, blocks: list[Block]) -> None:
        """COMMIT published ``blocks``."""

    def forgotten(self, block: Block) -> None:
        """FORGET dropped ``block``."""

    def holds(self, block: Block) -> bool:
        """Whether the link holds ``block`` (queued for the shared tier, or being written
        there): the store keeps that ``Block`` live rather than let its row stand for it."""

    async def drain(self, timeout_s: float | None = None, *, up_to_seq: int | None = None) -> bool:
        """Wait until no block committed up to ``up_to_seq`` waits to be replicated."""


class StoreForReplica(Protocol[H]):
    """What a replica link may ask of the store about its blocks, handles of type ``H``
    (:class:`~kvtierd.store.residency.Residency` implements it for
    :class:`~kvtierd.store.index.Block`)."""

    registry: NamespaceRegistry

    def block_by_id(self, ns_digest: bytes, key: bytes) -> H | None: ...

    def replicated(self) -> Iterator[H]:
        """The indexed blocks that have a shared copy."""

    def namespace_of(self, block: H) -> NamespaceSpec: ...

    def has_local_copy(self, block: H) -> bool:
        """Whether a tier of this host (DRAM, NVMe) still holds ``block``."""

    def adopt_copy(self, ref: BlockRef, location: Hashable) -> bool:
        """The shared tier holds ``ref``; ``True`` when it was not indexed before."""

    def record_copy(self, block: H, location: Hashable) -> None: ...

    def drop_copy(self, block: H) -> None: ...

    async def pin_resident(self, block: H) -> None: ...

    def unpin(self, block: H) -> None: ...

    def cool(self, block: H) -> None:
        """The link no longer holds ``block``: the store may let go of it if it is idle."""

    async def committed_bytes(self, block: H) -> bytes | memoryview | None: ...


@dataclass(frozen=True)
class Replica:
    """A shared tier and how to open the link that keeps it filled."""

    tier: LowerTier
    open_link: Callable[[StoreForReplica[Block]], AbstractAsyncContextManager[ReplicaLink]]
