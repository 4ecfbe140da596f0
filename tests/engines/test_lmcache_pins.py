"""The pin bookkeeping of the LMCache plug-in (``kvtierd.engines.lmcache_pins``), pure: which
lease an unpin lets go of, when a shared lease is released, and the budget."""

from __future__ import annotations

from kvtierd.client import BlockLease
from kvtierd.engines.lmcache_pins import PinTable
from kvtierd.protocol.messages import Extent


class Releases:
    """Counts the RELEASEs of the leases made by :meth:`lease`."""

    def __init__(self) -> None:
        self.released: list[str] = []

    def lease(self, name: str, keys: list[bytes]) -> BlockLease:
        extents = [Extent(i * 4096, 4096) for i in range(len(keys))]
        return BlockLease(keys, extents, [], lambda: self.released.append(name))


def test_an_empty_pin_is_undone_before_a_leased_one() -> None:
    table, log = PinTable(budget_blocks=8), Releases()
    # lookup A found k on NVMe (nothing leased); lookup B found it in DRAM and leased it
    table.add(1, [b"k"], None, table.reserve(0))
    table.add(1, [b"k"], log.lease("B", [b"k"]), table.reserve(1))
    table.unpin(1, b"k")  # A's unpin
    assert log.released == []
    assert [e.offset for _, e in table.take(1, [b"k"])] == [0]  # B's lease still serves
    table.unpin(1, b"k")  # B's unpin: the object taken above still holds the lease
    assert log.released == []


def test_a_lease_is_released_when_its_pins_and_objects_all_let_go() -> None:
    table, log = PinTable(budget_blocks=8), Releases()
    keys = [b"a", b"b", b"c"]
    table.add(1, keys, log.lease("L", keys[:2]), table.reserve(3))  # c past the DRAM prefix
    assert table.held_blocks == 2  # the unused reservation came back
    taken = table.take(1, keys)
    assert len(taken) == 2  # the leading leased pins only
    for key in keys:
        table.unpin(1, key)
    assert log.released == []  # the two objects still hold it
    for lease, _ in taken:
        lease.let_go()
    assert log.released == ["L"]
    assert table.held_blocks == 0
    assert table.take(1, keys) == []


def test_the_budget_counts_leases_until_released_and_undo_gives_back() -> None:
    table, log = PinTable(budget_blocks=3), Releases()
    first = table.add(1, [b"a", b"b"], log.lease("A", [b"a", b"b"]), table.reserve(2))
    assert table.reserve(5) == 1  # one block of room left
    table.unreserve(1)
    table.undo(first)  # a lookup that failed after pinning
    assert log.released == ["A"]
    assert table.held_blocks == 0
    assert table.reserve(5) == 3
