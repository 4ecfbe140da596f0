"""Which open connection gives its slot up so that a new one fits: the connection limits as a
decision, without I/O or a clock (the daemon passes ``now`` and closes what is returned).

The Unix socket and TCP count their own connections (``daemon.max_connections`` and
``remote.max_connections``), so that TCP clients never take a local engine's slot; on each,
one uid holds at most ``daemon.max_connections_per_uid`` (over TCP also at most
``remote.max_connections_per_uid``: the daemon passes the smaller as
:attr:`SlotLimits.per_uid`). A connection that has said DESTROY and is not stuck writing its
reply holds no slot (its client may connect again at once).

At a limit, the connection idle longest among those the limit counts gives its slot up, if one
is idle: no request for ``daemon.idle_timeout_s`` (0: never) and nothing in flight, leased or
being written (closing it would take an engine's views from under it). At the whole
listener's limit only the uid that holds the most connections gives one up, never a quieter
uid's (another tenant's). Otherwise the new connection is refused with :class:`BusyError`,
which says which limit it met. One connection given up frees a slot under every limit the new
one meets, since it counts under each of them.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from dataclasses import dataclass
from typing import Protocol, TypeVar

from kvtierd.config import Config
from kvtierd.errors import BusyError
from kvtierd.store.namespaces import PeerCredentials

__all__ = ["Occupant", "SlotLimits", "idlest", "make_room", "slot_limits"]


class Occupant(Protocol):
    """What admission reads of an open connection."""

    @property
    def peer(self) -> PeerCredentials: ...

    @property
    def departing(self) -> bool:
        """It said DESTROY (or was closed) and is not stuck writing: its slot is free."""

    @property
    def closing(self) -> bool: ...

    @property
    def last_request_s(self) -> float:
        """When its last complete request arrived (``time.monotonic``)."""

    @property
    def busy(self) -> bool:
        """Something of it is in flight, leased or being written."""


S = TypeVar("S", bound=Occupant)


@dataclass(frozen=True, slots=True)
class SlotLimits:
    """The limits of one listener kind."""

    #: Connections of the listener kind (Unix socket or TCP), all uids together.
    total: int
    #: Connections of one uid on it.
    per_uid: int
    #: How long without a request makes a connection idle; 0: none ever gives its slot up.
    idle_s: float


def slot_limits(config: Config, peer: PeerCredentials) -> SlotLimits:
    """The limits of ``peer``'s listener kind (module docstring)."""
    daemon, remote = config.daemon, config.remote
    if peer.remote:
        per_uid = min(daemon.max_connections_per_uid, remote.uid_cap)
        return SlotLimits(remote.max_connections, per_uid, daemon.idle_timeout_s)
    return SlotLimits(daemon.max_connections, daemon.max_connections_per_uid, daemon.idle_timeout_s)


def idlest(candidates: Iterable[S], idle_s: float, now: float) -> S | None:
    """The connection of ``candidates`` idle longest, if one is idle (module docstring)."""
    if not idle_s:
        return None
    idle = [
        s for s in candidates if not s.closing and now - s.last_request_s >= idle_s and not s.busy
    ]
    return min(idle, key=lambda s: s.last_request_s, default=None)


def make_room(
    sessions: Iterable[S], peer: PeerCredentials, limits: SlotLimits, now: float
) -> S | None:
    """The connection to close so that a new one of ``peer`` fits on its listener kind
    (``limits``), or ``None`` when it fits as things are; raises :class:`BusyError` when it
    does not fit and no connection it counts with is idle."""
    open_now = [s for s in sessions if not s.departing and bool(s.peer.remote) == bool(peer.remote)]
    over = " over TCP" if peer.remote else ""
    own = [s for s in open_now if s.peer.uid == peer.uid]
    if len(own) >= limits.per_uid:
        why = f"too many connections from uid {peer.uid}{over} ({len(own)} open)"
        return _one_of(own, limits.idle_s, now, why)
    if len(open_now) >= limits.total:
        why = f"too many connections{over} ({len(open_now)} open)"
        return _one_of(_busiest(open_now), limits.idle_s, now, why)
    return None


def _one_of(candidates: Collection[S], idle_s: float, now: float, why: str) -> S:
    victim = idlest(candidates, idle_s, now)
    if victim is None:
        raise BusyError(why)
    return victim


def _busiest(sessions: list[S]) -> list[S]:
    """The connections of the uid that holds the most."""
    by_uid: dict[int, list[S]] = {}
    for session in sessions:
        by_uid.setdefault(session.peer.uid, []).append(session)
    return max(by_uid.values(), key=len, default=[])
