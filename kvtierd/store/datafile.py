"""The NVMe tier's data file (or block device) as a medium: opening and claiming it, sizing a
regular file, its superblock, and the check that the path still names the file the tier wrote.

Kept apart from :mod:`kvtierd.store.nvme`, which reads and writes records in the file: nothing
here knows a record. The verdict of a failed check is pure (:mod:`kvtierd.store.diskhealth`);
:mod:`kvtierd.store.diskwatch` runs the check on a timer.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import mmap
import os
import stat
import struct
import time
import uuid
from pathlib import Path

from kvtierd.errors import ConfigError, ConfigProblem, NoSpaceError, StorageIOError
from kvtierd.io import IoBackend
from kvtierd.store.diskhealth import DataFileLostError, DiskFault
from kvtierd.store.durable import fsync_directory
from kvtierd.store.records import PAGE_BYTES, CorruptRecord, SegmentHeader, Superblock
from kvtierd.store.staging import StagingPages

__all__ = [
    "check_data_file",
    "describe_page",
    "identity_of",
    "mtime_ns",
    "open_superblock",
    "prepare_file",
]

log = logging.getLogger("kvtierd.nvme")
_BLKSSZGET = 0x1268  # <linux/fs.h>: the device's logical block size, an int


def describe_page(page: bytes | bytearray | memoryview) -> str:
    """What a page that should be a superblock holds, in a few words (for a log line)."""
    data = bytes(page)
    if not any(data):
        return "zeroes"
    try:
        superblock = Superblock.unpack(data)
    except CorruptRecord as exc:
        return f"no superblock: {exc}"
    return f"the superblock of another file, id {superblock.file_id.hex()}"


def identity_of(status: os.stat_result) -> tuple[int, int, int]:
    """What names the medium: a block device's number, or a regular file's device and inode."""
    if stat.S_ISBLK(status.st_mode):
        return (1, status.st_rdev, 0)
    return (0, status.st_dev, status.st_ino)


def mtime_ns(status: os.stat_result) -> int | None:
    """What tells a later start whether a regular data file was written since; ``None`` for a
    block device, whose node's times do not follow its writes."""
    return status.st_mtime_ns if stat.S_ISREG(status.st_mode) else None


#: The suffix of a data file being made (:func:`prepare_file`).
_MAKING = ".making"


def prepare_file(
    path: Path, size_bytes: int, preallocate: bool
) -> tuple[int, int, int | None, int | None]:
    """Open the data file (creating and sizing it) or block device, claimed for this process
    alone (``flock``, ``O_EXCL``); its fd, the bytes used, its mtime before this start
    (:func:`mtime_ns`) and its size before this start (``None``: created now, or a block
    device). Runs in a worker thread."""
    try:
        mode: int | None = path.stat().st_mode
    except FileNotFoundError:
        mode = None
    if mode is not None and stat.S_ISBLK(mode):
        return (*_open_device(path, size_bytes), None, None)
    if mode is not None and not stat.S_ISREG(mode):
        raise StorageIOError(f"{path} is neither a regular file nor a block device")
    if mode is None and path.is_relative_to("/dev"):
        raise StorageIOError(f"{path}: no such device")  # never a regular file in /dev
    created = mode is None
    path.parent.mkdir(parents=True, exist_ok=True)
    # A new file is made under another name and renamed into place once its superblock is
    # durable: a crash while it is made (sized, preallocated) leaves that name, made again at
    # the next start, never a data file of zeroes that start must refuse as overwritten.
    made = path.with_name(path.name + _MAKING) if created else path
    fd = _open_direct(made, os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise StorageIOError(f"{path} is in use by another kvtierd") from None
    size_bytes -= size_bytes % PAGE_BYTES
    try:
        before = os.fstat(fd)
        if created:
            os.ftruncate(fd, 0)  # what a start that crashed making it left
        if created or before.st_size != size_bytes:
            os.ftruncate(fd, size_bytes)
        if preallocate:
            os.posix_fallocate(fd, 0, size_bytes)
        if created:
            _initialise(fd, size_bytes)
            os.rename(made, path)
            fsync_directory(path.parent)
    except OSError as exc:
        os.close(fd)
        if created:
            made.unlink(missing_ok=True)  # a half-allocated file would keep holding the space
        if exc.errno == 28:
            raise NoSpaceError(
                f"cannot preallocate {size_bytes >> 20} MiB for {path}: the file system is full "
                "(lower nvme.size or free space)"
            ) from exc
        raise StorageIOError(f"cannot make {path}: {exc.strerror}") from exc
    if created:
        return fd, size_bytes, None, None
    return fd, size_bytes, mtime_ns(before), before.st_size


def _initialise(fd: int, file_bytes: int) -> None:
    """Write a new data file's superblock, durably (through a page-aligned buffer: the file
    is open ``O_DIRECT``)."""
    with mmap.mmap(-1, PAGE_BYTES) as page:
        packed = Superblock(uuid.uuid4().bytes, file_bytes, time.time_ns()).pack()
        page[: len(packed)] = packed
        os.pwrite(fd, page, 0)
    os.fdatasync(fd)


def _open_device(path: Path, size_bytes: int) -> tuple[int, int]:
    """Open a block device for its first ``size_bytes`` (rounded down to a page); raises
    :class:`ConfigError` when they do not fit in it, :class:`StorageIOError` when its logical
    block does not divide a page (O_DIRECT could not address a page)."""
    try:
        fd = _open_direct(path, os.O_EXCL)  # the kernel's claim: EBUSY while mounted or claimed
    except StorageIOError as exc:
        if isinstance(exc.__cause__, OSError) and exc.__cause__.errno == errno.EBUSY:
            raise StorageIOError(f"{path} is in use (mounted, or by another kvtierd)") from None
        raise
    try:
        device_bytes = os.lseek(fd, 0, os.SEEK_END)
        logical = struct.unpack("i", fcntl.ioctl(fd, _BLKSSZGET, bytes(4)))[0]
    except OSError as exc:
        os.close(fd)
        raise StorageIOError(f"cannot find the size of {path}: {exc.strerror}") from exc
    if size_bytes > device_bytes:
        os.close(fd)
        raise ConfigError(
            f"the NVMe device {path} is too small",
            [
                ConfigProblem(
                    "nvme.size",
                    f"{size_bytes} bytes do not fit in {path}, which has {device_bytes} "
                    f"(set nvme.size to at most {device_bytes - device_bytes % PAGE_BYTES})",
                )
            ],
        )
    if logical <= 0 or PAGE_BYTES % logical:
        os.close(fd)
        raise StorageIOError(
            f"{path} has {logical}-byte logical blocks, which 4096 is no multiple of"
        )
    return fd, size_bytes - size_bytes % PAGE_BYTES


def _open_direct(path: Path, flags: int) -> int:
    try:
        return os.open(path, os.O_RDWR | os.O_DIRECT | os.O_CLOEXEC | flags, 0o600)
    except OSError as exc:
        raise StorageIOError(f"cannot open {path} with O_DIRECT: {exc.strerror}") from exc


async def open_superblock(
    fd: int,
    path: Path,
    file_bytes: int,
    backend: IoBackend,
    pages: StagingPages,
    *,
    held_bytes: int | None = None,
    reinitialize: bool = False,
) -> Superblock:
    """The data file's superblock, written first for a new file. A damaged one is rebuilt from
    the first segment header, which names the file id too: one flipped bit in it must not make
    every record of the file foreign.

    A file that existed with bytes in it (``held_bytes``, its size before this start), whose
    superblock cannot be read and cannot be rebuilt, was truncated or overwritten: it may hold
    acknowledged blocks, so it is never initialised silently. Unless ``reinitialize``
    (``nvme.reinitialize_unreadable``) this raises :class:`StorageIOError` naming the file and
    what was found (the daemon exits 1); with it, the file is initialised afresh after an
    ERROR line. A file created now, an existing empty one, and a block device whose first two
    pages are zeroes (a new device) are initialised."""
    async with pages.page() as page:
        await backend.readv(fd, 0, [page])
        try:
            return Superblock.unpack(page)
        except CorruptRecord:
            found = describe_page(page)
            zeroes = not any(bytes(page))
        file_id = None
        await backend.readv(fd, PAGE_BYTES, [page])
        first_zeroes = not any(bytes(page))
        with contextlib.suppress(CorruptRecord):
            first = SegmentHeader.unpack(page)
            file_id = first.file_id if first.start == PAGE_BYTES else None
        # a new device (or one zeroed on purpose); a file created by this start, or empty
        fresh = zeroes and first_zeroes if _is_device(fd) else not held_bytes
        if file_id is None and not fresh:
            what = (
                f"{path} exists ({held_bytes} bytes)"
                if held_bytes is not None
                else f"the device {path}"
            )
            problem = (
                f"{what} but its superblock cannot be read (found {found}) and its first "
                "segment header does not name the file either: it was truncated or "
                "overwritten, and the blocks it held cannot be found"
            )
            if not reinitialize:
                log.error(
                    "%s; refusing to start rather than initialise it empty. Remedy: keep it "
                    "for inspection by moving it aside (mv %s %s.damaged), then start "
                    "kvtierd, which creates a new data file; or set "
                    "nvme.reinitialize_unreadable = true for one start to initialise it in place",
                    problem,
                    path,
                    path,
                )
                raise StorageIOError(
                    f"{problem}; refusing to initialise it (move it aside, or set "
                    "nvme.reinitialize_unreadable = true for one start)"
                )
            log.error(
                "%s; initialising it empty as nvme.reinitialize_unreadable = true asks "
                "(remove that setting now)",
                problem,
            )
        superblock = Superblock(file_id or uuid.uuid4().bytes, file_bytes, time.time_ns())
        page[:] = superblock.pack()
        await backend.writev(fd, 0, [page])
        await backend.fdatasync(fd)
    if file_id is not None:
        log.warning(
            "the superblock of %s was damaged (found %s); rebuilt from its first segment",
            path,
            found,
        )
    else:
        log.info("initialised NVMe data file %s (%d MiB)", path, file_bytes >> 20)
    return superblock


def _is_device(fd: int) -> bool:
    return stat.S_ISBLK(os.fstat(fd).st_mode)


async def check_data_file(
    path: Path,
    fd: int,
    identity: tuple[int, int, int],
    file_bytes: int,
    superblock: bytes | None,
    backend: IoBackend,
    pages: StagingPages,
) -> None:
    """Raise :class:`DataFileLostError` when ``path`` no longer names the open file:
    another file renamed over it (``replaced``) or none there (``removed``); or when the
    file is no longer what the tier wrote: shorter than the tier (``truncated``: the
    path's or the descriptor's ``st_size``, a regular file only) or its superblock no
    longer reads back as written (``damaged``). A data file is the same file while its
    device and inode are; a block device while its device number is (udev may recreate
    its node). Two ``stat`` calls and an ``fstat`` on the event loop (the descriptor's
    cannot block, the path's is a lookup on the local file system O_DIRECT needs), and one
    O_DIRECT read of the first page through the I/O backend."""
    try:
        now = os.stat(path)
    except (FileNotFoundError, NotADirectoryError):
        raise DataFileLostError(
            DiskFault.REMOVED,
            f"{path} was removed while kvtierd had it open{_still_at(identity, fd)}",
        ) from None
    except OSError as exc:
        raise DataFileLostError(
            DiskFault.EIO, f"cannot check that {path} is still the data file: {exc}"
        ) from exc
    if identity_of(now) != identity:
        raise DataFileLostError(
            DiskFault.REPLACED,
            f"{path} is no longer the data file kvtierd has open (another file was "
            f"put in its place){_still_at(identity, fd)}",
        )
    expected = file_bytes
    if stat.S_ISREG(now.st_mode):
        size = min(now.st_size, os.fstat(fd).st_size)
        if size < expected:
            raise DataFileLostError(
                DiskFault.TRUNCATED,
                f"{path} holds {size} bytes, but kvtierd's tier is {expected} bytes: "
                "it was truncated while kvtierd had it open",
            )
    if superblock is None:
        return
    try:
        async with pages.page() as page:
            await backend.readv(fd, 0, [page])
            intact = bytes(page) == superblock
            found = describe_page(page)
    except StorageIOError as exc:
        raise DataFileLostError(
            DiskFault.DAMAGED, f"cannot read back the superblock of {path}: {exc}"
        ) from exc
    if not intact:
        raise DataFileLostError(
            DiskFault.DAMAGED,
            f"the superblock of {path} no longer reads back as kvtierd wrote it "
            f"(found {found}): the file was overwritten in place",
        )


def _still_at(identity: tuple[int, int, int], fd: int) -> str:
    """Where a lost data file can still be read while this process runs (a device is still
    there under its own name)."""
    if identity[0]:
        return ""
    old = f"/proc/{os.getpid()}/fd/{fd}"
    return f"; the old file is readable at {old} until kvtierd exits"
