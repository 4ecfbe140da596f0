"""The arena's resident memory is pinned by the I/O backend before anything touches it.

On the virtual machines this project is measured on, io_uring reads into pages its fixed-buffer
registration faulted in keep the disk's queue full, and reads into pages faulted in before
(``MADV_POPULATE_WRITE``, ``mlock``, a write) go one request at a time (docs/architecture.md).
These tests check the order through ``mincore``: what the pin is given is not resident yet, and
is resident after. No timing is asserted.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
from collections.abc import Iterator

import anyio
import pytest

from kvtierd.config import TriState
from kvtierd.io import open_io_backend
from kvtierd.store.arena import Arena

_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
PAGE = mmap.PAGESIZE
MiB = 1 << 20


def resident_pages(view: memoryview) -> int:
    """How many pages of ``view`` are resident (``mincore``)."""
    address = ctypes.addressof((ctypes.c_char * 1).from_buffer(view))
    pages = view.nbytes // PAGE
    vector = (ctypes.c_ubyte * pages)()
    if _libc.mincore(ctypes.c_void_p(address), ctypes.c_size_t(view.nbytes), vector) != 0:
        raise OSError(ctypes.get_errno(), "mincore")
    return sum(v & 1 for v in vector)


def created(pin: object, **kwargs: object) -> Iterator[Arena]:
    arena = Arena.create(
        2 * MiB,
        [(None, 8 * MiB)],
        hugepages=TriState.NEVER,
        pin=pin,
        **kwargs,  # type: ignore[arg-type]
    )
    try:
        yield arena
    finally:
        arena.close()


@pytest.mark.parametrize("mlock", [TriState.AUTO, TriState.NEVER])
def test_the_pin_gets_the_resident_memory_untouched_and_leaves_it_resident(
    mlock: TriState,
) -> None:
    seen: list[tuple[int, int]] = []

    def pin(view: memoryview) -> bool:
        seen.append((view.nbytes, resident_pages(view)))
        return True

    for arena in created(pin, mlock=mlock):
        assert seen == [(arena.resident_bytes, 0)]  # nothing faulted before the pin
        assert arena.info.prefaulted
        if mlock is TriState.NEVER:  # this pin faults nothing (a registration does): no pre-fault
            assert resident_pages(arena.view[: arena.resident_bytes]) == 0


def test_a_failed_pin_leaves_the_pre_fault_to_do_it() -> None:
    for arena in created(lambda view: False):
        assert arena.info.prefaulted
        assert resident_pages(arena.view[: arena.resident_bytes]) == arena.resident_bytes // PAGE


def test_an_io_uring_registration_faults_the_arena_in_itself() -> None:
    """The real pin: the io_uring backend's fixed-buffer registration, which the daemon's store
    passes (``lifecycle._register``)."""

    async def main() -> None:
        async with open_io_backend("io_uring", queue_depth=4) as backend:
            if not backend.supports_fixed_buffers:
                pytest.skip("this kernel has no READV_FIXED: the arena is pre-faulted instead")
            before: list[int] = []

            def pin(view: memoryview) -> bool:
                before.append(resident_pages(view))
                backend.register_buffer(view)
                return True

            for arena in created(pin, mlock=TriState.NEVER):
                view = arena.view[: arena.resident_bytes]
                assert before == [0]
                assert resident_pages(view) == view.nbytes // PAGE
                assert backend.statistics().fixed_ops == 0

    anyio.run(main)
