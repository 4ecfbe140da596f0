"""What a request handler may touch (:mod:`kvtierd.server.handlers`), and nothing deeper.

A handler sees the store's request methods, the daemon's NIXL export, the connection's own
records (its owner, its peer's credentials, the namespaces it opened, the descriptors to pass
with a reply), the limits it negotiates, and the daemon's reports. Not the socket, the protocol
state machine (which closes the connection after DESTROY and after a refused INIT), other
sessions or the store's insides.
:class:`~kvtierd.server.session.Session` implements it; the handler tests
(``tests/server/test_handlers.py``) implement it over a real store with no socket at all.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from kvtierd.config import Config
from kvtierd.nixl.export import NixlReads
from kvtierd.protocol.messages import ConfigReply, PoolStatusReply, StatfsReply
from kvtierd.server.checks import HostCheck
from kvtierd.server.throttle import Throttle
from kvtierd.store.counts import StoreStatistics
from kvtierd.store.index import Owner
from kvtierd.store.namespaces import PeerCredentials
from kvtierd.store.store import BlockStore

__all__ = ["Reports", "RequestContext", "SessionHost", "Timings"]


class Reports(Protocol):
    """The daemon-wide reports a handler may ask for (the daemon implements them)."""

    def statistics(
        self, peer: PeerCredentials | None = None, *, figures: StoreStatistics | None = None
    ) -> StatfsReply: ...

    def pool_status(self) -> PoolStatusReply: ...

    async def doctor(self) -> Sequence[HostCheck]: ...

    def configuration(self) -> ConfigReply:
        """The configuration the daemon runs (CONFIG)."""


class Timings(Protocol):
    """Where a session reports how long each request took (the request-duration histogram),
    and each request that failed (the error counter)."""

    def observe(self, opcode: int, tier: str, seconds: float) -> None: ...

    def failed(self, opcode: int, code: int, tenant: str) -> None:
        """A request answered with errno ``code``; ``tenant`` is its bounded label."""


class SessionHost(Reports, Protocol):
    """What a session uses of the daemon that admitted it: the configuration (its limits),
    the store, the NIXL export and the reports its handlers reach, where it times and counts
    its requests and throttles its warnings. Not the other sessions, the listeners or the
    daemon's own bookkeeping."""

    @property
    def config(self) -> Config: ...

    @property
    def store(self) -> BlockStore: ...

    @property
    def nixl(self) -> NixlReads: ...

    @property
    def timings(self) -> Timings | None: ...

    @property
    def peer_warnings(self) -> Throttle: ...

    def count_request(self) -> None:
        """One more request served, daemon-wide."""


class RequestContext(Protocol):
    owner: Owner
    peer: PeerCredentials
    #: Ids of the namespaces this connection opened.
    namespaces: set[int]
    #: Descriptors to pass with the reply to request ``unique``.
    reply_fds: dict[int, list[int]]

    @property
    def store(self) -> BlockStore: ...

    @property
    def reports(self) -> Reports: ...

    @property
    def nixl(self) -> NixlReads:
        """The daemon's NIXL export of the tenant regions, or why it has none."""

    @property
    def may_create_namespaces(self) -> bool:
        """Whether OPEN_NS may create a namespace here (over TCP: ``remote.allow_create``)."""

    @property
    def max_inflight(self) -> int:
        """Requests this connection may have in flight (told to the client at INIT)."""

    @property
    def max_frame_bytes(self) -> int:
        """The largest frame the daemon takes (INIT negotiates down from it)."""

    def negotiate(self, max_frame_bytes: int) -> None:
        """Use ``max_frame_bytes`` as the connection's frame limit from now on."""
