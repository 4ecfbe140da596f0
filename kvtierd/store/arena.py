"""The DRAM arena: one address range in the daemon, made of per-tenant shared-memory regions.

Theory of operation. The daemon reserves one contiguous range of address space and fills it
with regions: first its own **private** memory (the record-header pages; anonymous, never
passed to anyone), then one **region per tenant** (and one for the default tenant), then more
private memory for write-back staging, which is not pre-faulted, locked or registered with
io_uring, so it costs memory only while used. Each tenant region is its own anonymous
memory file (``memfd_create``), sized, sealed against shrinking and growing
(``F_SEAL_SHRINK | F_SEAL_GROW``, then ``F_SEAL_SEAL``) and mapped ``MAP_FIXED | MAP_SHARED``
at its place in the range. A client receives a region's
descriptor through ``SCM_RIGHTS`` only once the daemon has admitted it to that tenant (at
OPEN_NS), so it can map its tenant's bytes and no one else's; and since the region is sealed,
nothing it does to the descriptor (``ftruncate``) can make the daemon's mapping fault. A block
moves between daemon and engine as an offset and a length, never through the socket.

Keeping one range for everything lets io_uring register the resident part as fixed buffers at
once, and lets the store address every slot by one offset. Three properties are asked of the kernel,
each optional and logged:

* **huge pages**: ``MFD_HUGETLB`` for a region when enough 2 MiB hugetlb pages are free
  (``auto``), which cuts TLB misses on large copies; otherwise ordinary shmem pages with
  ``MADV_HUGEPAGE``. With tenants configured, ``auto`` never picks hugetlb for a tenant region:
  a client that punches a hole in hugetlb memory while the host's pool is empty would make the
  daemon's next touch of those pages fault (SIGBUS), which shmem pages never do;
* **pre-faulting**: the first touch of new memory runs at 0.4-3 GB/s against 20 GB/s
  afterwards, so every resident page is faulted in at start-up. Where the I/O backend pins the
  arena (io_uring fixed buffers), its registration does it, before anything else touches the
  memory: NVMe reads into pages that registration faulted in kept 20-60 requests in the
  device's queue on the virtual machines measured, where pages faulted in beforehand (by
  ``MADV_POPULATE_WRITE``, ``mlock`` or a write) were read into one request at a time, about
  0.7 of the disk's speed (docs/architecture.md, *Fixed buffers before the pre-fault*). The
  two orders cost the same (about 0.3 s a GiB); without fixed buffers, ``MADV_POPULATE_WRITE``;
* **mlock**: pinned pages are never swapped (``auto`` tries and logs when ``RLIMIT_MEMLOCK``
  refuses; systemd's ``LimitMEMLOCK=infinity`` lifts it).

The arena knows nothing about blocks: :mod:`kvtierd.store.slots` carves its regions.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import fcntl
import logging
import mmap
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from humanfriendly import format_size

from kvtierd.config import TriState
from kvtierd.errors import NoSpaceError, StorageIOError
from kvtierd.host import free_hugepage_bytes, shmem_thp_mode
from kvtierd.store.kept import REGION_SEALS, HandedRegion, KeptRegion, region_file_name

__all__ = ["HUGE_PAGE_BYTES", "Arena", "ArenaInfo", "Region", "map_region", "usable_kind"]

log = logging.getLogger("kvtierd.arena")

HUGE_PAGE_BYTES = 2 << 20
#: Pre-faulting goes this far between checkpoints (0.1-0.5 s of first-touch work here).
PREFAULT_CHUNK_BYTES = 256 << 20
_MADV_POPULATE_WRITE = 23
_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [
    ctypes.c_void_p,
    ctypes.c_size_t,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_long,
]


@dataclass(frozen=True, slots=True)
class ArenaInfo:
    """How the arena ended up, for logs and STATFS."""

    size_bytes: int
    hugepages: bool
    locked: bool
    prefaulted: bool
    #: The part pre-faulted and locked (all but the lazy private memory at the end).
    resident_bytes: int = 0


@dataclass(frozen=True, slots=True)
class Region:
    """One tenant's part of the arena: ``size_bytes`` at arena offset ``base``, backed by the
    sealed memory file ``fd`` (what a client of that tenant maps). ``id`` names it on the wire;
    ``tenant`` is ``None`` for the default region."""

    id: int
    tenant: str | None
    fd: int
    base: int
    size_bytes: int
    hugepages: bool
    #: What it was before this start, when it is a region a stopped daemon left
    #: (:mod:`kvtierd.store.kept`); its blocks are to be checked before use.
    kept: KeptRegion | None = None


def _round_up(n: int, unit: int = HUGE_PAGE_BYTES) -> int:
    return -(-n // unit) * unit


def _address_of(mapping: mmap.mmap) -> int:
    view = (ctypes.c_char * 1).from_buffer(mapping)
    try:
        return ctypes.addressof(view)
    finally:
        del view  # drop the buffer export at once, or the mmap could never be closed


class Arena:
    """The daemon's address range: private memory at ``[0, private_bytes)``, then the regions.
    Construct with :meth:`create`."""

    def __init__(
        self,
        mapping: mmap.mmap,
        pad: int,
        private_bytes: int,
        regions: Sequence[Region],
        info: ArenaInfo,
    ) -> None:
        self._mapping = mapping
        self._pad = pad
        self._whole = memoryview(mapping)
        self.view = self._whole[pad : pad + info.size_bytes]
        self.private_bytes = private_bytes
        self.regions = tuple(regions)
        self.info = info

    @property
    def size_bytes(self) -> int:
        return self.info.size_bytes

    @property
    def address(self) -> int:
        """The address of arena offset 0 in this process (for NIXL's registrations)."""
        return _address_of(self._mapping) + self._pad

    @property
    def resident_bytes(self) -> int:
        """The private memory and the regions: pre-faulted, locked, and what io_uring should
        register (registering pins pages: the lazy memory after it would be resident too)."""
        return self.info.resident_bytes or self.info.size_bytes

    def lazy(self) -> memoryview:
        """The lazy private memory at the end of the arena (at offset :attr:`resident_bytes`)."""
        return self.view[self.resident_bytes :]

    @classmethod
    def create(
        cls,
        private_bytes: int,
        regions: Sequence[tuple[str | None, int]] = (),
        *,
        hugepages: TriState = TriState.AUTO,
        mlock: TriState = TriState.AUTO,
        prefault: bool = True,
        checkpoint: Callable[[int, int], None] = lambda done, total: None,
        tenants_isolated: bool = False,
        lazy_bytes: int = 0,
        pin: Callable[[memoryview], bool] | None = None,
        handed: Mapping[tuple[str | None, int], HandedRegion] | None = None,
    ) -> Arena:
        """Reserve, map and prepare the arena: ``private_bytes`` of daemon memory, then one
        sealed region per ``(tenant, bytes)``, then ``lazy_bytes`` of private memory that is
        neither pre-faulted nor locked (write-back staging: it costs memory only while used,
        and lies past :attr:`resident_bytes`, the part to register with io_uring). Raises
        :class:`NoSpaceError` when the kernel refuses the memory and :class:`StorageIOError`
        when a feature set to ``always`` fails.

        ``tenants_isolated``: the regions belong to mutually distrusting tenants, so ``auto``
        does not choose hugetlb pages for them (see the module docstring).

        ``checkpoint(done_bytes, total_bytes)`` runs between pre-fault chunks, with how much is
        pre-faulted so far (what a starting daemon reports), and may raise to give up (the
        store's lifecycle raises once its start-up was cancelled, so Ctrl-C ends a long
        pre-fault within a chunk); whatever was created is released before the exception
        leaves.

        ``pin(view)`` is given the resident part before anything touches it, and says whether
        it pinned every page (the I/O backend's fixed-buffer registration): the kernel then
        faulted the pages in itself, and the pre-fault is skipped. Order matters: io_uring
        reads into pages its registration faulted in keep the device's queue full, where
        pages faulted in before (by ``MADV_POPULATE_WRITE``, ``mlock`` or a first touch) were
        read into one request at a time on the virtual machines measured (docs/architecture.md,
        *Fixed buffers before the pre-fault*).

        ``handed``: regions a stopped daemon left, by ``(tenant, size)``
        (:mod:`kvtierd.store.kept`), each of pages this start may use (:func:`usable_kind`,
        which the caller applies): a region of that tenant and size maps that memory file
        instead of a new one, and the arena owns its descriptor once it returns (on failure,
        the caller still does)."""
        handed = handed or {}
        private_bytes = _round_up(max(private_bytes, 0))
        sizes = [(tenant, _round_up(size)) for tenant, size in regions]
        resident = private_bytes + sum(size for _, size in sizes)
        total = resident + _round_up(max(lazy_bytes, 0))
        if total <= 0:
            raise ValueError("an arena needs some memory")
        try:
            mapping = mmap.mmap(-1, total + HUGE_PAGE_BYTES, flags=mmap.MAP_SHARED)
        except OSError as exc:
            raise NoSpaceError(f"cannot reserve a {total}-byte arena: {exc.strerror}") from exc
        pad = -_address_of(mapping) % HUGE_PAGE_BYTES
        made: list[Region] = []
        try:
            huge_left = free_hugepage_bytes()
            base = private_bytes
            for number, (tenant, size) in enumerate(sizes, start=1):
                want_huge = hugepages is TriState.ALWAYS or (
                    hugepages is TriState.AUTO and not tenants_isolated and huge_left >= size
                )
                again = handed.get((tenant, size))
                if again is not None:
                    fd, huge, kept = again.fd, again.kept.hugepages, again.kept
                else:
                    (fd, huge), kept = cls._open_memfd(tenant, size, want_huge, hugepages), None
                made.append(Region(number, tenant, fd, base, size, huge, kept))
                cls._map_fixed(mapping, pad + base, size, fd)
                huge_left -= size if huge and kept is None else 0  # kept: not in the free count
                base += size
            huge_all = bool(made) and all(r.hugepages for r in made)
            with contextlib.suppress(OSError):  # transparent huge pages, where allowed
                mapping.madvise(mmap.MADV_HUGEPAGE, pad, total)
            if not huge_all and shmem_thp_mode() in ("never", "deny"):
                log.info(
                    "the arena is on 4 KiB pages: no hugetlb pages are used and "
                    "transparent_hugepage/shmem_enabled is %r; clients copy out of it about "
                    "10 %% slower (reserve vm.nr_hugepages, or set shmem_enabled to advise)",
                    shmem_thp_mode(),
                )
            pinned = pin is not None and cls._pin(mapping, pad, resident, pin, checkpoint)
            if prefault and not pinned:
                log.info("arena: pre-faulting %d MiB", resident >> 20)
            prefaulted = pinned or (prefault and cls._prefault(mapping, pad, resident, checkpoint))
            locked = cls._lock(_address_of(mapping) + pad, resident, mlock)
        except BaseException:
            with contextlib.suppress(BufferError):
                mapping.close()
            for region in made:
                if region.kept is None:  # a handed descriptor is its keeper's until taken
                    os.close(region.fd)
            raise
        info = ArenaInfo(total, huge_all, locked, prefaulted, resident)
        log.info(
            "arena: %s for blocks in %d region(s) and %s of record headers (what --check "
            "counts), then %s of write-back staging, touched only while blocks wait for "
            "write-back; hugepages=%s, mlock=%s, prefaulted=%s",
            format_size(resident - private_bytes, binary=True),
            len(made),
            format_size(private_bytes, binary=True),
            format_size(total - resident, binary=True),
            huge_all,
            locked,
            prefaulted,
        )
        return cls(mapping, pad, private_bytes, made, info)

    @staticmethod
    def _open_memfd(
        tenant: str | None, size_bytes: int, want_huge: bool, hugepages: TriState
    ) -> tuple[int, bool]:
        name = region_file_name(tenant)
        flags = os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING
        if want_huge:
            fd = os.memfd_create(name, flags | os.MFD_HUGETLB)
            try:
                os.ftruncate(fd, size_bytes)
                fcntl.fcntl(fd, fcntl.F_ADD_SEALS, REGION_SEALS)
                return fd, True
            except OSError as exc:
                os.close(fd)
                if hugepages is TriState.ALWAYS:
                    raise StorageIOError(f"hugetlb arena refused: {exc.strerror}") from exc
                log.warning("hugetlb arena refused (%s); using ordinary pages", exc.strerror)
        fd = os.memfd_create(name, flags)
        try:
            os.ftruncate(fd, size_bytes)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, REGION_SEALS)
        except OSError as exc:
            os.close(fd)
            raise NoSpaceError(f"cannot size the arena: {exc.strerror}") from exc
        return fd, False

    @staticmethod
    def _map_fixed(mapping: mmap.mmap, offset: int, size_bytes: int, fd: int) -> None:
        """Put ``fd``'s pages at ``offset`` of the reservation (replacing what was there)."""
        address = _address_of(mapping) + offset
        prot = mmap.PROT_READ | mmap.PROT_WRITE
        flags = mmap.MAP_SHARED | 0x10  # MAP_FIXED: inside our own reservation, by design
        got = _libc.mmap(address, size_bytes, prot, flags, fd, 0)
        if got != address:
            err = ctypes.get_errno()
            raise NoSpaceError(f"cannot map an arena region: {os.strerror(err)}")

    @staticmethod
    def _pin(
        mapping: mmap.mmap,
        offset: int,
        size_bytes: int,
        pin: Callable[[memoryview], bool],
        checkpoint: Callable[[int, int], None],
    ) -> bool:
        checkpoint(0, size_bytes)
        log.info(
            "arena: pinning %d MiB for the I/O backend (its pin faults the pages in)",
            size_bytes >> 20,
        )
        with memoryview(mapping)[offset : offset + size_bytes] as view:
            pinned = pin(view)
        if pinned:
            checkpoint(size_bytes, size_bytes)
        return pinned

    @staticmethod
    def _prefault(
        mapping: mmap.mmap, offset: int, size_bytes: int, checkpoint: Callable[[int, int], None]
    ) -> bool:
        try:
            for start in range(0, size_bytes, PREFAULT_CHUNK_BYTES):
                checkpoint(start, size_bytes)
                mapping.madvise(
                    _MADV_POPULATE_WRITE,
                    offset + start,
                    min(PREFAULT_CHUNK_BYTES, size_bytes - start),
                )
            checkpoint(size_bytes, size_bytes)
        except OSError as exc:
            if exc.errno == 12:  # ENOMEM: the memory is not there; fail now, not on first use
                raise NoSpaceError("not enough memory to populate the arena") from exc
            log.warning("arena pre-fault unavailable (%s); first touches will be slow", exc)
            return False
        return True

    @staticmethod
    def _lock(address: int, size_bytes: int, mode: TriState) -> bool:
        if mode is TriState.NEVER:
            return False
        if _libc.mlock(ctypes.c_void_p(address), ctypes.c_size_t(size_bytes)) == 0:
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

    def close(self, *, keep_regions: bool = False) -> None:
        """Close the descriptors and unmap. A mapping that still has exported views (io_uring
        keeps the registered buffer exported) is left to be unmapped at process exit, its
        memory given back meanwhile; with ``keep_regions`` (someone else holds them for the
        next start) only the private memory is."""
        self.view.release()
        self._whole.release()
        try:
            self._mapping.close()
        except BufferError:
            # The address range stays reserved until exit, but not its memory: unlock it and
            # give the pages back (a late reader sees zeroes, never a fault).
            start, size = self._pad, self.info.size_bytes
            _libc.munlock(
                ctypes.c_void_p(_address_of(self._mapping) + start), ctypes.c_size_t(size)
            )
            spans = [(start, size)]
            if keep_regions:  # a hole punched in a region would be punched in the kept file
                resident = self.resident_bytes
                spans = [(start, self.private_bytes), (start + resident, size - resident)]
            for offset, length in spans:
                with contextlib.suppress(OSError, ValueError):
                    self._mapping.madvise(mmap.MADV_REMOVE, offset, length)
            log.debug("arena views still exported; its memory is released, the range at exit")
        for region in self.regions:
            os.close(region.fd)


def usable_kind(kept_huge: bool, mode: TriState, tenants_isolated: bool) -> bool:
    """Whether a kept region's pages are of a kind this start may use: hugetlb pages where it
    could choose them itself (never for an isolated tenant under ``auto``: see the module
    docstring), ordinary pages unless ``always`` asks for hugetlb."""
    if kept_huge:
        return mode is TriState.ALWAYS or (mode is TriState.AUTO and not tenants_isolated)
    return mode is not TriState.ALWAYS


def map_region(fd: int, size_bytes: int, *, populate: bool = True) -> mmap.mmap:
    """Map a received region descriptor (the client's side). ``populate`` builds the page
    tables at once (about 60 ms per GiB here) so the first copies run at full speed. Raises
    ``OSError`` when the descriptor is not a region of at least ``size_bytes``."""
    if os.fstat(fd).st_size < size_bytes:
        raise OSError(f"the region descriptor holds {os.fstat(fd).st_size} bytes, not {size_bytes}")
    flags = mmap.MAP_SHARED | (mmap.MAP_POPULATE if populate else 0)
    return mmap.mmap(fd, size_bytes, flags=flags)
