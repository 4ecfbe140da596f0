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
    try:
        assert left in shm.orphans(before)
        assert left not in shm.orphans(shm.snapshot())  # there before this snapshot: not new
    finally:
        left.unlink(missing_ok=True)  # only the test's own: others' leftovers are not its business


def test_a_segment_a_live_process_holds_open_is_not_an_orphan() -> None:
    before = shm.snapshot()
    segment = shared_memory.SharedMemory(create=True, size=1 << 16)
    name = shm.SHM / segment.name.lstrip("/")
    try:
        assert name not in shm.orphans(before)
        segment.buf[0] = 1  # still there, still mapped
    finally:
        segment.close()
        segment.unlink()
    assert name not in shm.orphans(before)  # unlinked by its owner


#: A child that maps a file of the directory it is given and closes the descriptor (as a
#: semaphore is held: by its mapping only), then waits for stdin to close.
MAP_ONLY = textwrap.dedent(
    """
    import mmap, os, sys
    fd = os.open(sys.argv[1], os.O_RDWR)
    held = mmap.mmap(fd, 4096)
    os.close(fd)
    print("mapped", flush=True)
    sys.stdin.read()
    """
)


def test_a_file_held_only_by_a_mapping_is_kept_and_removed_once_unmapped(tmp_path: Path) -> None:
    root = tmp_path / "shm dir"  # a space in the path, as /proc/PID/maps writes it
    root.mkdir()
    before = shm.snapshot(root)
    mapped, loose, other = root / "sem.mp-held", root / "psm_loose", root / "not-ours-by-name"
    for path in (mapped, loose, other):
        path.write_bytes(bytes(4096))
    child = subprocess.Popen(
        [sys.executable, "-c", MAP_ONLY, str(mapped)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout is not None
        assert child.stdout.readline().strip() == "mapped"
        assert shm.remove_orphans(before, root) == [loose]  # the mapped one and `other` stay
        assert mapped.exists()
        assert other.exists()
    finally:
        child.communicate("", timeout=30)
    assert shm.remove_orphans(before, root) == [mapped]


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
