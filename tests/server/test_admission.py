"""The connection limits as a decision (``kvtierd.server.admission``): who gives a slot up, and
when a new connection is refused; no daemon, no clock."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from kvtierd.errors import BusyError
from kvtierd.server.admission import SlotLimits, idlest, make_room
from kvtierd.store.namespaces import PeerCredentials

NOW = 1000.0
LIMITS = SlotLimits(total=4, per_uid=2, idle_s=60.0)


@dataclass(eq=False)
class Conn:
    peer: PeerCredentials
    last_request_s: float = NOW
    departing: bool = False
    closing: bool = False
    busy: bool = False


def conn(uid: int, *, quiet_s: float = 0.0, remote: str = "", **kw: bool) -> Conn:
    return Conn(PeerCredentials(pid=uid * 10, uid=uid, gid=uid, remote=remote), NOW - quiet_s, **kw)


def peer(uid: int, remote: str = "") -> PeerCredentials:
    return PeerCredentials(pid=1, uid=uid, gid=uid, remote=remote)


def test_a_connection_that_fits_closes_nothing() -> None:
    assert make_room([conn(1), conn(2)], peer(1), LIMITS, NOW) is None


def test_at_the_uid_limit_its_connection_idle_longest_gives_way() -> None:
    older, newer = conn(1, quiet_s=300), conn(1, quiet_s=100)
    assert make_room([newer, older, conn(2, quiet_s=900)], peer(1), LIMITS, NOW) is older


def test_at_the_uid_limit_without_an_idle_one_it_is_refused() -> None:
    sessions = [conn(1, quiet_s=30), conn(1, quiet_s=300, busy=True), conn(2, quiet_s=900)]
    with pytest.raises(BusyError, match=r"from uid 1 \(2 open\)"):
        make_room(sessions, peer(1), LIMITS, NOW)


def test_at_the_total_only_the_busiest_uid_gives_way() -> None:
    """uid 2 holds two connections, uid 3 one idle far longer: uid 2's idle one goes."""
    quiet = conn(3, quiet_s=5000)
    mine = conn(2, quiet_s=200)
    sessions = [conn(1, quiet_s=10), mine, conn(2, quiet_s=100), quiet]
    assert make_room(sessions, peer(4), LIMITS, NOW) is mine
    with pytest.raises(BusyError, match=r"too many connections \(4 open\)"):
        make_room([conn(1), conn(2, quiet_s=30), conn(2), quiet], peer(4), LIMITS, NOW)


def test_departing_connections_hold_no_slot_and_each_listener_counts_its_own() -> None:
    gone = [conn(1, departing=True, closing=True) for _ in range(4)]
    assert make_room(gone, peer(1), LIMITS, NOW) is None
    tcp = [conn(u, remote="10.0.0.1:5") for u in range(1, 5)]
    assert make_room(tcp, peer(1), LIMITS, NOW) is None  # a Unix client among TCP ones
    with pytest.raises(BusyError):
        make_room(tcp, peer(9, remote="10.0.0.2:7"), LIMITS, NOW)


def test_no_idle_timeout_means_nobody_gives_way() -> None:
    sessions = [conn(1, quiet_s=10_000), conn(1, quiet_s=10_000)]
    assert idlest(sessions, 0.0, NOW) is None
    with pytest.raises(BusyError):
        make_room(sessions, peer(1), SlotLimits(4, 2, 0.0), NOW)


def test_a_closing_or_busy_connection_is_never_picked() -> None:
    closing = conn(1, quiet_s=900, closing=True)
    busy = conn(1, quiet_s=800, busy=True)
    idle = conn(1, quiet_s=61)
    assert idlest([closing, busy, idle], 60.0, NOW) is idle
    assert idlest([closing, busy, conn(1, quiet_s=59)], 60.0, NOW) is None


def test_one_connection_given_up_makes_room_under_both_limits() -> None:
    """uid 1 is at its limit and the listener at its total: its idle connection counts under
    both, so it alone is closed (the old code could close a second, or close one and refuse)."""
    mine = conn(1, quiet_s=500)
    sessions = [mine, conn(1), conn(2), conn(3)]
    assert make_room(sessions, peer(1), LIMITS, NOW) is mine


def test_a_tcp_refusal_says_so() -> None:
    tcp = [conn(7, remote="10.0.0.1:5"), conn(7, remote="10.0.0.1:6")]
    with pytest.raises(BusyError, match=r"from uid 7 over TCP \(2 open\)"):
        make_room(tcp, peer(7, remote="10.0.0.1:9"), LIMITS, NOW)
