"""The block table: arrays and their scalar cells stay one state as slots come, go and grow."""

from __future__ import annotations

import numpy as np

from kvtierd.slsap.blocktable import VERSION_MASK, BlockTable


def test_cells_follow_the_arrays_when_the_table_grows() -> None:
    table = BlockTable(initial_slots=2)
    slots = [table.slot_for(f"block-{i}") for i in range(9)]
    assert len(table.keys) == 16
    for slot in slots[::2]:
        table.set_resident(slot, True)
    table.last_cells[slots[3]] = 7.5
    assert table.resident_count == 5
    assert table.resident_slots().tolist() == sorted(slots[::2])
    assert table.last[slots[3]] == 7.5
    assert table.count[slots].tolist() == [0] * 9


def test_dropped_slots_are_untracked_and_reused() -> None:
    table = BlockTable(initial_slots=4)
    slots = [table.slot_for(key) for key in "abcdef"]
    table.set_resident(slots[0], True)
    ghosts = table.ghost_slots()
    assert ghosts.tolist() == sorted(slots[1:])
    before = table.version[ghosts].copy()
    table.drop(ghosts[:2])
    assert table.tracked_slots().tolist() == sorted({table.find(k) for k in "abcdef"} - {-1})
    assert (table.version[ghosts[:2]] == before[:2] + 1).all()
    assert table.find("b") == -1
    assert table.slot_for("g") in ghosts[:2].tolist()
    assert len(table) == 5


def test_versions_wrap_like_numpy() -> None:
    table = BlockTable(initial_slots=1)
    slot = table.slot_for("a")
    table.version[slot] = VERSION_MASK
    table.set_resident(slot, True)
    assert table.version[slot] == 0
    assert table.version.dtype == np.uint32
