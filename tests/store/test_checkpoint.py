"""Checkpoints and the crash restart from one (kvtierd/store/checkpoint.py, changes.py).

A real NVMe tier on a real file runs in a child process that is killed with SIGKILL; the
parent then opens the tier as a restarting daemon does and checks: every block whose sync
returned is there with its bytes, every one forgotten (and synced) is gone, a rewritten key
comes back as its newest version, and only the segments written since the checkpoint (or
carved since) were scanned. A damaged checkpoint or generation table, and a kill while a
checkpoint is being written, cost a full scan or the previous checkpoint: the same result.
"""

from __future__ import annotations

import contextlib
import json
import mmap
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import anyio.lowlevel
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvtierd.errors import StorageIOError
from kvtierd.io import open_io_backend
from kvtierd.store import checkpoint as checkpoint_module
from kvtierd.store.changes import ChangeTable, CorruptTable
from kvtierd.store.checkpoint import checkpoint_paths
from kvtierd.store.nvme import NvmeTier, open_nvme_tier
from kvtierd.store.records import PAGE_BYTES, checksum
from kvtierd.store.recovery import SNAPSHOT_NAME, snapshot_path
from kvtierd.store.segments import DiskSlot
from kvtierd.store.staging import StagingPages
from kvtierd.store.tier import BlockRef

pytestmark = [pytest.mark.timeout(300)]

NS = bytes(range(16))
FILE_BYTES = 32 << 20
SEGMENT_BYTES = 1 << 20
BLOCK = 60 << 10  # 64 KiB slots: 16 to a 1 MiB segment
PAGES = 16
ROOT = Path(__file__).resolve().parents[2]


def content(key: bytes, seq: int) -> bytes:
    stamp = key + seq.to_bytes(8, "little")
    return (stamp * (BLOCK // len(stamp) + 1))[:BLOCK]


def key_for(i: int) -> bytes:
    return b"ckpt-%06d" % i


@contextlib.asynccontextmanager
async def open_tier(directory: Path, every: int) -> AsyncIterator[tuple[NvmeTier, memoryview]]:
    memory = mmap.mmap(-1, PAGES * PAGE_BYTES + BLOCK + PAGE_BYTES)
    view = memoryview(memory)
    async with open_io_backend("threads", queue_depth=16) as backend:
        pages = StagingPages(view[: PAGES * PAGE_BYTES], PAGES)
        async with open_nvme_tier(
            directory / "nvme.data",
            FILE_BYTES,
            backend=backend,
            pages=pages,
            segment_bytes=SEGMENT_BYTES,
            snapshot_dir=directory,
            checkpoint_every_bytes=every,
        ) as tier:
            yield tier, view[PAGES * PAGE_BYTES :]


# -- the child: writes, checkpoints, syncs, and is killed --------------------------------------


def child(directory: str, plan: str, backend: str) -> None:
    """Run ``plan`` (JSON) against the tier in ``directory``, printing after every sync the
    keys durable by then (``{"key": seq}``, 0: forgotten) and the segments written since the
    last checkpoint finished; then wait to be killed."""
    anyio.run(_child, Path(directory), json.loads(plan), backend=backend)


async def _child(directory: Path, plan: dict[str, Any]) -> None:
    async with open_tier(directory, plan["every"]) as (tier, buffer):
        seq = tier.max_seq
        where: dict[bytes, tuple[BlockRef, DiskSlot]] = {
            r.ref.key: (r.ref, r.location)  # type: ignore[misc]
            for r in tier.recovered()
        }
        durable: dict[str, int] = {}  # synced: seq, or 0 when forgotten
        touched: set[int] = set()

        def report() -> None:
            print(json.dumps({"durable": durable, "touched": sorted(touched)}), flush=True)

        for step in plan["steps"]:
            if step[0] == "put":
                for i in range(step[1], step[2]):
                    key = key_for(i)
                    if durable.get(key.decode()) == 0:  # may come back from now on
                        del durable[key.decode()]
                        report()
                    seq += 1
                    ref, slot = await _stored(tier, buffer, i, seq)
                    touched.add(slot.segment)
                    if key in where:  # the older record goes once the new one is durable
                        await tier.sync()
                        durable[key.decode()] = seq
                        report()
                        touched.add(where[key][1].segment)
                        await tier.discard(*where[key])
                    where[key] = (ref, slot)
            elif step[0] == "forget":
                for i in range(step[1], step[2]):
                    key = key_for(i)
                    if key in where:
                        durable.pop(key.decode(), None)  # gone or not until the next sync
                        report()
                        touched.add(where[key][1].segment)
                        await tier.discard(*where.pop(key))
                        durable[key.decode()] = 0
            elif step[0] == "checkpoint":
                assert tier.checkpoints is not None
                await tier.checkpoints.take(tier._segmap, tier.cold)
                touched = set()
            elif step[0] == "sync":
                await tier.sync()
                durable.update({key.decode(): ref.seq for key, (ref, _) in where.items()})
                report()
        print(json.dumps({"done": True}), flush=True)
        await anyio.sleep(3600)


def run_child(directory: Path, plan: dict[str, Any], backend: str, kill_after: float | None) -> Any:
    """Run the child; kill it with SIGKILL when it is done (or ``kill_after`` seconds after
    it starts); the last line it printed about durable keys."""
    code = "import sys; from tests.store.test_checkpoint import child; child(*sys.argv[1:])"
    proc = subprocess.Popen(
        [sys.executable, "-c", code, str(directory), json.dumps(plan), backend],
        stdout=subprocess.PIPE,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert proc.stdout is not None
    last: Any = {"durable": {}, "touched": []}
    try:
        if kill_after is not None:
            time.sleep(kill_after)
            proc.send_signal(signal.SIGKILL)
        for line in proc.stdout:
            try:
                report = json.loads(line)
            except json.JSONDecodeError:  # cut short by the kill
                break
            if "done" in report:
                break
            last = report
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        proc.stdout.close()
    (directory / SNAPSHOT_NAME).unlink(missing_ok=True)  # no clean stop: a crash
    return last


# -- the parent: restart and check -------------------------------------------------------------


def as_a_kill_leaves(live: Path, crashed: Path) -> Path:
    """``crashed``: a copy of the files in ``live`` a kill now would leave (no clean-stop
    snapshot), taken while the tier is open."""
    crashed.mkdir()
    for name in ("nvme.data", "index.snapshot.checkpoint", "index.snapshot.generations"):
        shutil.copyfile(live / name, crashed / name)
    return crashed


async def restart(directory: Path, durable: dict[str, int]) -> NvmeTier:
    """Open the tier after the kill, check every durable key's bytes and every forgotten key's
    absence, and return the tier (closed) for its recovery counters."""
    async with open_tier(directory, 1 << 40) as (tier, buffer):
        found = {r.ref.key.decode(): r for r in tier.recovered()}
        for key, seq in durable.items():
            if seq == 0:
                assert key not in found, f"{key} was forgotten and came back"
                continue
            assert key in found, f"{key} (seq {seq}) was synced and is lost"
            ref, location = found[key].ref, found[key].location
            assert ref.seq >= seq, key
            await tier.load(ref, location, buffer[: BLOCK + PAGE_BYTES - BLOCK % PAGE_BYTES])
            assert bytes(buffer[:BLOCK]) == content(key.encode(), ref.seq), key
    return tier


PLAN = {
    "every": 1 << 40,  # only the plan's checkpoints
    "steps": [
        ["put", 0, 96],  # six segments
        ["sync"],
        ["checkpoint"],
        ["forget", 3, 6],  # segment 0
        ["put", 20, 22],  # rewritten: segment 1 (the old records) and where the new ones go
        ["put", 96, 100],
        ["sync"],
    ],
}


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_a_crash_restart_scans_only_the_segments_written_since_the_checkpoint(
    tmp_path: Path, backend: str
) -> None:
    last = run_child(tmp_path, PLAN, backend, None)
    assert len(last["durable"]) == 100
    tier = anyio.run(restart, tmp_path, last["durable"], backend=backend)
    assert tier.recovery_source == "checkpoint"
    total = len(tier._segmap.segments)
    assert 0 < tier.recovery_scanned == len(last["touched"]) < total


@pytest.mark.parametrize("damage", ["checkpoint", "table"])
def test_a_damaged_checkpoint_or_table_costs_a_full_scan_with_the_same_result(
    tmp_path: Path, damage: str
) -> None:
    last = run_child(tmp_path, PLAN, "asyncio", None)
    checkpoint, table = checkpoint_paths(tmp_path / SNAPSHOT_NAME)
    target = checkpoint if damage == "checkpoint" else table
    raw = bytearray(target.read_bytes())
    raw[len(raw) // 2] ^= 0x10
    target.write_bytes(bytes(raw))
    tier = anyio.run(restart, tmp_path, last["durable"])
    assert tier.recovery_source == "scan"
    assert tier.recovery_scanned == len(tier._segmap.segments)


def test_a_checkpoint_the_table_does_not_cover_is_not_trusted(tmp_path: Path) -> None:
    """A checkpoint left from before a fresh table (the table lost) is never adopted."""
    last = run_child(tmp_path, PLAN, "asyncio", None)
    _, table = checkpoint_paths(tmp_path / SNAPSHOT_NAME)
    table.unlink()
    tier = anyio.run(restart, tmp_path, last["durable"])
    assert tier.recovery_source == "scan"
    checkpoint, _ = checkpoint_paths(tmp_path / SNAPSHOT_NAME)
    assert not checkpoint.exists()  # deleted before a fresh table was started


def test_a_kill_while_the_next_checkpoint_is_written_restarts_from_the_previous_one(
    tmp_path: Path,
) -> None:
    """As the checkpoint thread leaves it when killed mid-write: the table saved with the next
    generation, and half a checkpoint under the temporary name. The previous checkpoint is
    still covered and adopted; the half one is never read."""
    last = run_child(tmp_path, PLAN, "trio", None)
    checkpoint, generations = checkpoint_paths(tmp_path / SNAPSHOT_NAME)
    table = ChangeTable.decode(generations, generations.read_bytes())
    table.advance()
    table.save()
    whole = checkpoint.read_bytes()
    checkpoint.with_name(checkpoint.name + ".tmp").write_bytes(whole[: len(whole) // 2])
    tier = anyio.run(restart, tmp_path, last["durable"], backend="trio")
    assert tier.recovery_source == "checkpoint"
    assert tier.recovery_scanned == len(last["touched"])


@settings(max_examples=6, deadline=None, suppress_health_check=list(HealthCheck))
@given(seed=st.integers(0, 1 << 30), delay=st.floats(0.6, 3.0))
def test_kill_at_any_moment_during_periodic_checkpoints_loses_nothing_synced(
    tmp_path_factory: pytest.TempPathFactory, seed: int, delay: float
) -> None:
    """Checkpoints every 1 MiB written, writes, rewrites and forgets synced in small batches,
    and a kill at a random moment (during a checkpoint's write, between a mark and its write):
    whatever the restart starts from, every synced block is back and no forgotten one."""
    directory = tmp_path_factory.mktemp("kill")
    rng = random.Random(seed)
    steps: list[list[Any]] = [["put", 0, 48], ["sync"]]
    for _ in range(60):
        first = rng.randrange(0, 150)
        steps.append([rng.choice(["put", "put", "forget"]), first, first + rng.randrange(1, 8)])
        steps.append(["sync"])
    plan = {"every": 1 << 20, "steps": steps}
    backend = rng.choice(["asyncio", "trio"])
    last = run_child(directory, plan, backend, delay)
    tier = anyio.run(restart, directory, last["durable"], backend=backend)
    assert tier.recovery_source in ("checkpoint", "scan")
    # a second start from what the first left (its checkpoint and table) agrees too
    anyio.run(restart, directory, last["durable"], backend=backend)


# -- the generation table alone ----------------------------------------------------------------


@given(
    marks=st.lists(st.tuples(st.integers(0, 40), st.integers(0, 3)), max_size=30),
    flip=st.integers(0, 10_000),
)
@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
def test_the_generation_table_reads_back_as_saved_and_any_flipped_bit_is_refused(
    tmp_path_factory: pytest.TempPathFactory, marks: list[tuple[int, int]], flip: int
) -> None:
    path = tmp_path_factory.mktemp("table") / "table"
    table = ChangeTable(path, bytes(range(16)), 5, 5)
    table.save()

    async def mark_all() -> None:
        for segment, advances in marks:
            for _ in range(advances):
                table.advance()
            await table.mark(segment)

    anyio.run(mark_all)
    loaded = ChangeTable.load(path, bytes(range(16)))
    assert (loaded.since, loaded.generation) == (5, table.generation)
    assert loaded.segments.tolist() == table.segments.tolist()
    for generation in range(5, table.generation):
        expected = [s for s, g in enumerate(table.segments.tolist()) if g > generation]
        assert np.flatnonzero(loaded.changed_since(generation, len(loaded.segments))).tolist() == (
            expected
        )
        assert loaded.covers(generation)
    assert not loaded.covers(4)
    assert not loaded.covers(table.generation)
    raw = bytearray(path.read_bytes())
    raw[flip % len(raw)] ^= 1 << (flip % 8)
    with pytest.raises(CorruptTable):
        ChangeTable.decode(path, bytes(raw))
    with pytest.raises(CorruptTable):
        ChangeTable.load(path, bytes(16))  # another data file's


def test_a_start_not_from_the_checkpoint_starts_a_fresh_table_and_drops_the_checkpoint(
    tmp_path: Path,
) -> None:
    """After a start by scan (here: the checkpoint damaged) the file may hold writes the table
    never saw (the same check fails when a writer that marks nothing wrote it), so neither the
    old table nor its checkpoint may be trusted at a later crash."""
    last = run_child(tmp_path, PLAN, "asyncio", None)
    checkpoint, generations = checkpoint_paths(tmp_path / SNAPSHOT_NAME)
    before = ChangeTable.decode(generations, generations.read_bytes()).since
    raw = bytearray(checkpoint.read_bytes())
    raw[len(raw) // 2] ^= 0x10
    checkpoint.write_bytes(bytes(raw))
    tier = anyio.run(restart, tmp_path, last["durable"])
    assert tier.recovery_source == "scan"
    assert not checkpoint.exists()
    assert ChangeTable.decode(generations, generations.read_bytes()).since != before


def test_two_paths_to_one_data_file_share_its_snapshot_checkpoint_and_table(
    tmp_path: Path,
) -> None:
    """A link to the data file (``/dev/disk/by-id`` to a device) names the same files: two
    tables of one file would each miss the writes made through the other path."""
    (tmp_path / "disk").mkdir()
    target = tmp_path / "disk" / "kv.data"
    target.touch()
    link = tmp_path / "alias.data"
    link.symlink_to(target)
    assert snapshot_path(tmp_path, link) == snapshot_path(tmp_path, target)
    (tmp_path / "nvme.data").symlink_to(target)  # the default name, through a link
    assert snapshot_path(tmp_path, tmp_path / "nvme.data") == snapshot_path(tmp_path, target)


def _in_the_way(path: Path) -> Path:
    """A directory (not empty) where the file ``path`` was: a rename onto it and an unlink of
    it fail, as on a failing disk, for root too."""
    path.unlink(missing_ok=True)
    (path / "in-the-way").mkdir(parents=True)
    return path


def _cleared(path: Path) -> None:
    (path / "in-the-way").rmdir()
    path.rmdir()


async def _stored(
    tier: NvmeTier, buffer: memoryview, i: int, seq: int | None = None
) -> tuple[BlockRef, DiskSlot]:
    """Block ``i`` stored with ``seq`` (by default ``i + 1``), through ``buffer``."""
    key = key_for(i)
    seq = i + 1 if seq is None else seq
    data = content(key, seq)
    buffer[:BLOCK] = data
    ref = BlockRef(NS, key, BLOCK, checksum(data), seq)
    slot = await tier.store(ref, buffer[: BLOCK + PAGE_BYTES - BLOCK % PAGE_BYTES])
    assert isinstance(slot, DiskSlot)
    return ref, slot


async def _stored_and_checkpointed(
    tier: NvmeTier, buffer: memoryview, i: int
) -> tuple[BlockRef, DiskSlot]:
    """Block ``i`` stored, then a checkpoint taken: its segment is marked again at its next
    write or discard."""
    stored = await _stored(tier, buffer, i)
    assert tier.checkpoints is not None
    await tier.checkpoints.take(tier._segmap, tier.cold)
    return stored


def _header_at(directory: Path, slot: DiskSlot) -> bytes:
    with open(directory / "nvme.data", "rb") as file:
        file.seek(slot.offset)
        return file.read(4)


@pytest.mark.anyio
async def test_a_table_that_cannot_be_written_gives_checkpoints_up_not_the_writes(
    tmp_path: Path,
) -> None:
    """The data directory fails under the generation table: the checkpoint is deleted, the
    discard and later writes go on unmarked, no checkpoint is taken any more, and a crash
    restart scans every header and finds every block."""
    async with open_tier(tmp_path, 1 << 20) as (tier, buffer):
        ref, slot = await _stored_and_checkpointed(tier, buffer, 0)
        assert tier.checkpoints is not None
        checkpoint = tier.checkpoints.path
        assert checkpoint.exists()
        table = _in_the_way(tier.checkpoints.table.path)
        await tier.discard(ref, slot)
        assert tier.checkpoints.abandoned is not None
        assert not checkpoint.exists()
        assert _header_at(tmp_path, slot) == bytes(4)
        kept = [await _stored_and_checkpointed(tier, buffer, i) for i in range(1, 40)]
        assert not checkpoint.exists()
        assert tier.checkpoints.written == 1
    _cleared(table)
    (tmp_path / SNAPSHOT_NAME).unlink()  # as after a crash
    async with open_tier(tmp_path, 1 << 20) as (tier, _):
        assert tier.recovery_source == "scan"
        found = {r.ref.key: r.ref.seq for r in tier.recovered()}
        assert found == {ref.key: ref.seq for ref, _ in kept}


@pytest.mark.anyio
async def test_a_discard_whose_mark_fails_keeps_its_slot_until_a_sync_zeroes_it(
    tmp_path: Path,
) -> None:
    """Neither the table can be written nor the checkpoint deleted: the discard fails, its
    record's row gone already (no block may be made of it while the discard waits), its slot
    neither free nor zeroed but kept from reuse; the next sync zeroes and frees it, or fails
    while it cannot."""
    async with open_tier(tmp_path, 1 << 20) as (tier, buffer):
        ref, slot = await _stored_and_checkpointed(tier, buffer, 0)
        assert tier.checkpoints is not None
        table = _in_the_way(tier.checkpoints.table.path)
        checkpoint = _in_the_way(tier.checkpoints.path)
        used = tier.statistics().used_bytes
        with pytest.raises(StorageIOError):
            await tier.discard(ref, slot)
        assert tier.checkpoints.abandoned is None
        assert tier.cold.find(NS, ref.key) == -1
        assert tier.statistics().used_bytes == used  # kept: not free, not zeroed
        assert _header_at(tmp_path, slot) == b"KVTB"
        with pytest.raises(StorageIOError):
            await tier.sync()  # still neither
        _cleared(table)
        _cleared(checkpoint)
        await tier.sync()
        assert _header_at(tmp_path, slot) == bytes(4)
        assert tier.statistics().used_bytes == used - slot.size


@pytest.mark.anyio
async def test_writes_and_discards_during_a_sliced_copy_leave_a_checkpoint_that_holds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A checkpoint's copy is taken a slice of rows at a time while the loop serves: blocks
    written, rewritten and forgotten between the slices (slots freed and reused under the
    copy) leave a checkpoint a crash restart adopts, and that restart finds every synced
    block at its newest version and no forgotten one."""
    monkeypatch.setattr(checkpoint_module, "_SLICE_ROWS", 4)  # 4 rows a step of the loop
    live = tmp_path / "live"
    live.mkdir()
    durable: dict[str, int] = {}
    async with open_tier(live, 1 << 40) as (tier, buffer):
        assert tier.checkpoints is not None
        where: dict[bytes, tuple[BlockRef, DiskSlot]] = {}
        seq = 0

        async def put(i: int) -> None:
            nonlocal seq
            key = key_for(i)
            seq += 1
            ref, slot = await _stored(tier, buffer, i, seq)
            if key in where:
                await tier.discard(*where[key])  # (the test's restart syncs nothing between)
            where[key] = (ref, slot)

        for i in range(64):
            await put(i)
        await tier.sync()
        rng = random.Random(5)

        async def meanwhile() -> None:
            for _ in range(12):  # the copy takes 16 steps
                i = rng.randrange(80)
                if rng.random() < 0.4 and key_for(i) in where:
                    await tier.discard(*where.pop(key_for(i)))  # its slot free for the next
                else:
                    await put(i)
                await anyio.lowlevel.checkpoint()

        async with anyio.create_task_group() as tasks:
            tasks.start_soon(tier.checkpoints.take, tier._segmap, tier.cold)
            tasks.start_soon(meanwhile)
        assert tier.checkpoints.written == 1
        await tier.sync()
        durable = {key.decode(): ref.seq for key, (ref, _) in where.items()}
        durable |= {key_for(i).decode(): 0 for i in range(80) if key_for(i) not in where}
        crashed = as_a_kill_leaves(live, tmp_path / "crashed")
    tier = await restart(crashed, durable)
    assert tier.recovery_source == "checkpoint"


@pytest.mark.anyio
async def test_a_slot_copied_twice_under_a_sliced_copy_is_left_out_of_the_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rows and slots are both reused last freed first, but from different stacks: a row a
    freed row of another size class, a slot its own class's. So a block written while the copy
    runs can land in the slot of a row already copied (forgotten since) under a row not copied
    yet: the copy then names that slot twice, and a checkpoint holding both rows is refused
    at the crash restart (a full scan). The rows of segments changed during the copy are left
    out of it, so the restart uses the checkpoint and finds every synced block."""
    monkeypatch.setattr(checkpoint_module, "_SLICE_ROWS", 4)
    live = tmp_path / "live"
    live.mkdir()
    small = 12 << 10  # another size class: its own slots, the same rows
    async with open_tier(live, 1 << 40) as (tier, buffer):
        assert tier.checkpoints is not None
        stored = [await _stored(tier, buffer, i) for i in range(8)]  # rows 0-7
        other = BlockRef(NS, b"other-size", small, checksum(bytes(small)), 100)
        buffer[:small] = bytes(small)
        other_slot = await tier.store(other, buffer[:small])  # row 8
        await tier.sync()
        cold = tier.cold
        first_row = cold.at(stored[0][1].segment, stored[0][1].index)
        other_row = cold.at(other_slot.segment, other_slot.index)  # type: ignore[attr-defined]
        assert (first_row, other_row) == (0, 8)
        moved = anyio.Event()
        chunks = cold.chunks

        def paused(rows: int) -> Any:
            """The copy, held after its first slice (rows 0-3) until the writes are done."""
            pieces = chunks(rows)
            first = next(pieces)
            yield first
            while not moved.is_set():
                yield {name: column[:0] for name, column in first.items()}
            yield from pieces

        monkeypatch.setattr(cold, "chunks", paused)

        async def meanwhile() -> None:
            await tier.discard(*stored[0])  # row 0 (copied) and its slot freed
            await tier.discard(other, other_slot)  # row 8 (not copied yet) freed last
            again = await _stored(tier, buffer, 50, seq=200)
            # the new block: row 8, in the slot row 0 named
            assert again[1] == stored[0][1]
            assert cold.at(again[1].segment, again[1].index) == 8
            moved.set()

        async with anyio.create_task_group() as tasks:
            tasks.start_soon(tier.checkpoints.take, tier._segmap, cold)
            tasks.start_soon(meanwhile)
        assert tier.checkpoints.written == 1
        await tier.sync()
        durable = {key_for(i).decode(): i + 1 for i in range(1, 8)}
        durable |= {key_for(0).decode(): 0, key_for(50).decode(): 200, "other-size": 0}
        crashed = as_a_kill_leaves(live, tmp_path / "crashed")
    tier = await restart(crashed, durable)
    assert tier.recovery_source == "checkpoint"


@pytest.mark.anyio
async def test_two_syncs_at_once_zero_a_dropped_records_slot_once(tmp_path: Path) -> None:
    """A slot whose discard could not zero it is zeroed and freed once, whichever FSYNC comes
    first; the other waits for it. (Two syncs once both zeroed it: the second's zero could
    land on the next block written into the freed slot, and its second free failed.)"""
    async with open_tier(tmp_path, 0) as (tier, buffer):
        ref, slot = await _stored(tier, buffer, 0)
        await tier.sync()
        real = tier._backend.writev
        zeroings = 0

        async def writev(fd: int, offset: int, buffers: list[memoryview]) -> int:
            nonlocal zeroings
            if offset == slot.offset and len(buffers) == 1 and not any(bytes(buffers[0])):
                zeroings += 1
                if zeroings == 1:
                    raise StorageIOError("EIO (injected into the discard's zeroing)")
                await anyio.sleep(0.05)  # slow: the second sync comes meanwhile
            return await real(fd, offset, buffers)

        tier._backend.writev = writev  # type: ignore[method-assign]
        with pytest.raises(StorageIOError):
            await tier.discard(ref, slot)
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(tier.sync)
            tasks.start_soon(tier.sync)
        assert zeroings == 2  # the discard's, failed, and one sync's
        tier._backend.writev = real  # type: ignore[method-assign]
        _, again = await _stored(tier, buffer, 1)
        assert again == slot  # the freed slot, to the next block
        await tier.sync()
        assert _header_at(tmp_path, slot) == b"KVTB"


@pytest.mark.anyio
async def test_a_table_refused_at_start_says_checkpoints_were_given_up(tmp_path: Path) -> None:
    """A generation table that cannot be written when the tier opens: checkpoints are given up
    for the run (not "off", which is the configuration's word), and the tier serves."""
    _, generations = checkpoint_paths(tmp_path / SNAPSHOT_NAME)
    _in_the_way(generations)
    async with open_tier(tmp_path, 1 << 20) as (tier, _buffer):
        assert tier.checkpoints is None
        figures = tier.checkpoint_figures()
        assert figures is not None
        assert figures.state.startswith("given up: ")
        assert "cannot be written" in figures.state
        assert not figures.on
    async with open_tier(tmp_path / "off", 0) as (tier, _buffer):
        figures = tier.checkpoint_figures()
        assert figures is not None
        assert figures.state == "off"
