"""A checkpoint and a share of segments written since, synthesised for ``bench_scale``'s
crash restart from a checkpoint (issue 32: restart at 10M blocks under 20 s after a crash).

From the clean-stop snapshot a daemon just wrote, :func:`synthesise_checkpoint` makes what a
daemon serving that file would have left at a crash: the checkpoint (the same columns, with a
generation), the generation table saying which segments were written since, and those writes
(every record of each such segment rewritten with a newer ``seq``, as a rewrite of its key
would leave it); then it deletes the clean-stop snapshot (a crash writes none). The start that
follows adopts the checkpoint and scans the segments written since.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import numpy as np

from kvtierd.store import snapshot as snapshots
from kvtierd.store.changes import ChangeTable
from kvtierd.store.checkpoint import checkpoint_paths
from kvtierd.store.durable import replace_durably
from kvtierd.store.records import PAGE_BYTES, CorruptRecord, RecordHeader, SegmentHeader

__all__ = ["synthesise_checkpoint"]


def synthesise_checkpoint(snapshot: Path, data_file: Path, share: float) -> tuple[int, int]:
    """Turn the clean-stop ``snapshot`` of ``data_file`` into a checkpoint with ``share`` of
    its segments (at least one, spread over the file) written since; returns how many, and
    of how many."""
    snap = snapshots.decode(snapshot.read_bytes())
    snap.generation = 1
    checkpoint, generations = checkpoint_paths(snapshot)
    replace_durably(checkpoint, snapshots.encode(snap))
    count = len(snap.segments)
    changed = np.unique(np.linspace(0, count - 1, max(1, round(count * share))).astype(np.int64))
    table = ChangeTable(generations, snap.file_id, 1, 2)
    table.segments = np.ones(count, np.uint64)
    table.segments[changed] = 2
    table.save()
    fd = os.open(data_file, os.O_RDWR)
    try:
        for number in changed.tolist():
            header = SegmentHeader(snap.file_id, *snap.segments[number])
            for index in range(header.slot_count):
                offset = header.slot_offset(index)
                try:
                    record = RecordHeader.unpack(os.pread(fd, PAGE_BYTES, offset))
                except CorruptRecord:
                    continue
                newer = dataclasses.replace(record, seq=record.seq + (1 << 40))
                os.pwrite(fd, newer.pack(), offset)
        os.fsync(fd)
    finally:
        os.close(fd)
    snapshot.unlink()
    return len(changed), count
