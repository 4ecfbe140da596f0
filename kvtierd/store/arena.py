"""The DRAM arena: one memfd, mapped shared by the daemon and by every client.

Theory of operation. The daemon creates an anonymous memory file (``memfd_create``), sizes it and
maps it ``MAP_SHARED``; clients receive the descriptor once, at INIT, through ``SCM_RIGHTS`` and
map the same pages, so a block moves between daemon and engine as an offset and a length, never
through the socket. Three properties are asked of the kernel, each optional and logged:

* **huge pages**: ``MFD_HUGETLB`` when enough 2 MiB hugetlb pages are free (``auto``), which cuts
  TLB misses on large copies; otherwise ordinary shmem pages;
* **pre-faulting**: ``MADV_POPULATE_WRITE`` at start-up, because the first touch of new memory
  runs at 0.4-3 GB/s against 20 GB/s afterwards, and io_uring buffer registration of an
  unfaulted GiB takes seconds instead of milliseconds;
* **mlock**: pinned pages are never swapped (``auto`` tries and logs when ``RLIMIT_MEMLOCK``
  refuses; systemd's ``LimitMEMLOCK=infinity`` lifts it).

The arena knows nothing about blocks: :mod:`kvtierd.store.slots` carves it.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import logging
import mmap
import os
from collections.abc import Callable
from dataclasses import dataclass

from kvtierd.config import TriState
from kvtierd.errors import NoSpaceError, StorageIOError
from kvtierd.host import free_hugepage_bytes, shmem_thp_mode

__all__ = ["HUGE_PAGE_BYTES", "Arena", "ArenaInfo", "map_arena"]

log = logging.getLogger("kvtierd.arena")

HUGE_PAGE_BYTES = 2 << 20
#: Pre-faulting goes this far between checkpoints (0.1-0.5 s of first-touch work here).
PREFAULT_CHUNK_BYTES = 256 << 20
_MADV_POPULATE_WRITE = 23
_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)


@dataclass(frozen=True, slots=True)
class ArenaInfo:
    """How the arena ended up, for logs and STATFS."""

    size_bytes: int
    hugepages: bool
    locked: bool
    prefaulted: bool


def _address_of(mapping: mmap.mmap) -> int:
    view = (ctypes.c_char * 1).from_buffer(mapping)
    try:
        return ctypes.addressof(view)
    finally:
        del view  # drop the buffer export at once, or the mmap could never be closed


class Arena:
    """A shared-memory region of ``size_bytes``; construct with :meth:`create`."""

    def __init__(self, fd: int, mapping: mmap.mmap, info: ArenaInfo) -> None:
        self.fd = fd
        self._mapping = mapping
        self.info = info
        self.view = memoryview(mapping)

    @property
    def size_bytes(self) -> int:
        return self.info.size_bytes

    @classmethod
    def create(
        cls,
        size_bytes: int,
        *,
        hugepages: TriState = TriState.AUTO,
        mlock: TriState = TriState.AUTO,
        prefault: bool = True,
        checkpoint: Callable[[], None] = lambda: None,
    ) -> Arena:
        """Create, map and prepare the arena. Raises :class:`NoSpaceError` when the kernel
        refuses the memory and :class:`StorageIOError` when a feature set to ``always`` fails.

        ``checkpoint`` runs between pre-fault chunks and may raise to give up (the store's
        lifecycle raises once its start-up was cancelled, so Ctrl-C ends a long pre-fault within
        a chunk); whatever was created is released before the exception leaves."""
        size_bytes = -(-size_bytes // HUGE_PAGE_BYTES) * HUGE_PAGE_BYTES
        fd, huge = cls._open_memfd(size_bytes, hugepages)
        try:
            mapping = mmap.mmap(fd, size_bytes, flags=mmap.MAP_SHARED)
        except OSError as exc:
            os.close(fd)
            raise NoSpaceError(f"cannot map a {size_bytes}-byte arena: {exc.strerror}") from exc
        if not huge:  # transparent huge pages, where shmem_enabled allows them (advise)
            with contextlib.suppress(OSError):
                mapping.madvise(mmap.MADV_HUGEPAGE)
            thp = shmem_thp_mode()
            if thp in ("never", "deny"):  # a hint, like the hugetlb one above
                log.info(
                    "the arena is on 4 KiB pages: no hugetlb pages are reserved and "
                    "transparent_hugepage/shmem_enabled is %r; clients copy out of it about "
                    "10 %% slower (reserve vm.nr_hugepages, or set shmem_enabled to advise)",
                    thp,
                )
        if prefault:
            log.info("arena: pre-faulting %d MiB", size_bytes >> 20)
        try:
            prefaulted = prefault and cls._prefault(mapping, size_bytes, checkpoint)
            locked = cls._lock(mapping, size_bytes, mlock)
        except BaseException:
            mapping.close()
            os.close(fd)
            raise
        info = ArenaInfo(size_bytes, huge, locked, prefaulted)
        log.info(
            "arena: %d MiB, hugepages=%s, mlock=%s, prefaulted=%s",
            size_bytes >> 20,
            huge,
            locked,
            prefaulted,
        )
        return cls(fd, mapping, info)

    @staticmethod
    def _open_memfd(size_bytes: int, hugepages: TriState) -> tuple[int, bool]:
        want_huge = hugepages is TriState.ALWAYS or (
            hugepages is TriState.AUTO and free_hugepage_bytes() >= size_bytes
        )
        if want_huge:
            fd = os.memfd_create("kvtierd-arena", os.MFD_CLOEXEC | os.MFD_HUGETLB)
            try:
                os.ftruncate(fd, size_bytes)
                return fd, True
            except OSError as exc:
                os.close(fd)
                if hugepages is TriState.ALWAYS:
                    raise StorageIOError(f"hugetlb arena refused: {exc.strerror}") from exc
                log.warning("hugetlb arena refused (%s); using ordinary pages", exc.strerror)
        elif hugepages is TriState.AUTO:
            log.info("not enough free hugetlb pages for the arena; using ordinary pages")
        fd = os.memfd_create("kvtierd-arena", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, size_bytes)
        except OSError as exc:
            os.close(fd)
            raise NoSpaceError(f"cannot size the arena: {exc.strerror}") from exc
        return fd, False

    @staticmethod
    def _prefault(mapping: mmap.mmap, size_bytes: int, checkpoint: Callable[[], None]) -> bool:
        try:
            for start in range(0, size_bytes, PREFAULT_CHUNK_BYTES):
                checkpoint()
                mapping.madvise(
                    _MADV_POPULATE_WRITE, start, min(PREFAULT_CHUNK_BYTES, size_bytes - start)
                )
        except OSError as exc:
            if exc.errno == 12:  # ENOMEM: the memory is not there; fail now, not on first use
                raise NoSpaceError("not enough memory to populate the arena") from exc
            log.warning("arena pre-fault unavailable (%s); first touches will be slow", exc)
            return False
        return True

    @staticmethod
    def _lock(mapping: mmap.mmap, size_bytes: int, mode: TriState) -> bool:
        if mode is TriState.NEVER:
            return False
        if _libc.mlock(ctypes.c_void_p(_address_of(mapping)), ctypes.c_size_t(size_bytes)) == 0:
            return True
        err = ctypes.get_errno()
        message = f"mlock of the arena failed: {os.strerror(err)} (raise LimitMEMLOCK)"
        if mode is TriState.ALWAYS:
            raise StorageIOError(message)
        log.warning("%s; the arena may be swapped", message)
        return False

    def buffer(self, offset: int, length: int) -> memoryview:
        """A view of ``length`` bytes at ``offset``; raises ``ValueError`` outside the arena."""
        if offset < 0 or length < 0 or offset + length > self.info.size_bytes:
            raise ValueError(f"[{offset}, {offset + length}) lies outside the arena")
        return self.view[offset : offset + length]

    def close(self) -> None:
        """Close the descriptor and unmap. A mapping that still has exported views (io_uring
        keeps the registered buffer exported) is left to be unmapped at process exit."""
        self.view.release()
        try:
            self._mapping.close()
        except BufferError:
            log.debug("arena views still exported; the mapping is released at exit")
        os.close(self.fd)


def map_arena(fd: int, size_bytes: int, *, populate: bool = True) -> mmap.mmap:
    """Map a received arena descriptor (the client's side). ``populate`` builds the page tables
    at once (about 60 ms per GiB here) so the first copies run at full speed."""
    flags = mmap.MAP_SHARED | (mmap.MAP_POPULATE if populate else 0)
    return mmap.mmap(fd, size_bytes, flags=flags)
