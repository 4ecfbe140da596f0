"""Shared memory left in /dev/shm (``kvtierd.testing.shm``): a segment nobody holds any more is
found and removed; one a live process maps, or one that was there before, is left alone."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from multiprocessing import shared_memory
from pathlib import Path

import pytest

from kvtierd.testing import shm

pytestmark = pytest.mark.skipif(not shm.SHM.is_dir(), reason="no /dev/shm here")

#: A child that makes a segment and dies by SIGKILL, as vLLM's processes do under killpg: its
#: resource tracker never runs, so the segment stays.
LEAK = textwrap.dedent(
    """
    import os, signal
    from multiprocessing import resource_tracker, shared_memory
    segment = shared_memory.SharedMemory(create=True, size=1 << 16)
    resource_tracker.unregister(segment._name, "shared_memory")
    print(segment.name, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
    """
)


def test_a_segment_left_by_a_killed_process_is_found_and_removed() -> None:
    before = shm.snapshot()
    child = subprocess.run([sys.executable, "-c", LEAK], capture_output=True, text=True)
    assert child.returncode < 0  # killed
    left = shm.SHM / child.stdout.strip().lstrip("/")
    assert left.exists()
    assert left in shm.orphans(before)
    assert shm.orphans(shm.snapshot()) == []  # it was there before this snapshot: not new
    assert left in shm.remove_orphans(before)
    assert not left.exists()


def test_a_segment_a_live_process_maps_is_not_an_orphan() -> None:
    before = shm.snapshot()
    segment = shared_memory.SharedMemory(create=True, size=1 << 16)
    try:
        assert shm.SHM / segment.name.lstrip("/") not in shm.remove_orphans(before)
        segment.buf[0] = 1  # still there, still mapped
    finally:
        segment.close()
        segment.unlink()
    assert shm.orphans(before) == []  # unlinked by its owner


def test_the_check_exits_1_when_something_was_left(tmp_path: Path) -> None:
    snapshot = tmp_path / "before"
    snapshot.write_text("\n".join(sorted(shm.snapshot())))
    assert shm.main([str(snapshot)]) == 0
    child = subprocess.run([sys.executable, "-c", LEAK], capture_output=True, text=True)
    left = shm.SHM / child.stdout.strip().lstrip("/")
    try:
        assert shm.main([str(snapshot)]) == 1
    finally:
        left.unlink(missing_ok=True)
