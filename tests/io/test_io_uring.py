"""What only the io_uring backend does: fixed-buffer chunks, registration failures, giving up on
requests that never finish, and not pinning the caller's memory."""

from __future__ import annotations

import logging
import mmap
import os
from collections.abc import Iterator
from functools import partial
from pathlib import Path

import anyio
import pytest

from kvtierd.errors import StorageIOError
from kvtierd.io.binding import RingOp
from kvtierd.io.buffers import buffer_address
from kvtierd.io.uring import open_uring_backend

pytestmark = [pytest.mark.anyio, pytest.mark.usefixtures("uring_works")]

BLOCK = 4096
MIB = 1 << 20


async def test_fixed_buffers_span_several_chunks(data_fd: int, arena: memoryview) -> None:
    data = os.urandom(4 * BLOCK)
    async with open_uring_backend(4, fixed_chunk_bytes=MIB) as backend:
        backend.register_buffer(arena)  # 4 MiB: fixed buffers 0..3
        in_chunk_2 = arena[2 * MIB + BLOCK : 2 * MIB + 5 * BLOCK]
        in_chunk_2[:] = data
        await backend.writev(data_fd, 0, [in_chunk_2])
        assert backend.statistics().fixed_ops == 1
        across = arena[MIB - 2 * BLOCK : MIB + 2 * BLOCK]  # straddles chunks 0 and 1
        await backend.readv(data_fd, 0, [across])
        assert backend.statistics().fixed_ops == 1
        two_chunks = [arena[:BLOCK], arena[3 * MIB : 3 * MIB + 3 * BLOCK]]
        await backend.readv(data_fd, 0, two_chunks)
        assert backend.statistics().fixed_ops == 1
        in_chunk_3 = arena[-4 * BLOCK :]
        await backend.readv(data_fd, 0, [in_chunk_3])
        assert backend.statistics().fixed_ops == 2
    assert bytes(across) == bytes(in_chunk_3) == data
    assert bytes(two_chunks[0]) + bytes(two_chunks[1]) == data


async def test_released_fixed_buffers_are_no_longer_used(data_fd: int, arena: memoryview) -> None:
    """After ``release_fixed_buffers`` (the arena's pages may have changed under the
    registration), transfers into the arena take the plain form and land in its pages."""
    data = os.urandom(BLOCK)
    async with open_uring_backend(4) as backend:
        backend.register_buffer(arena)
        arena[:BLOCK] = data
        await backend.writev(data_fd, 0, [arena[:BLOCK]])
        assert backend.statistics().fixed_ops == 1
        assert backend.fixed_buffers_fallback == ""
        backend.release_fixed_buffers()
        backend.release_fixed_buffers()  # idempotent
        assert "given up" in backend.fixed_buffers_fallback  # what the doctor's io line says
        target = arena[MIB : MIB + BLOCK]
        await backend.readv(data_fd, 0, [target])
        assert backend.statistics().fixed_ops == 1
    assert bytes(target) == data


@pytest.fixture
def file_backed(tmp_path: Path) -> Iterator[memoryview]:
    """A shared mapping of an ext4 file: the kernel refuses to register it."""
    with open(tmp_path / "backing", "w+b") as backing:
        backing.truncate(MIB)
        mapping = mmap.mmap(backing.fileno(), MIB)
        view = memoryview(mapping)
        yield view
        view.release()
        mapping.close()  # fails if the refused registration left an export behind


async def test_file_backed_memory_cannot_be_registered(
    file_backed: memoryview, data_fd: int, arena: memoryview
) -> None:
    async with open_uring_backend(4) as backend:
        with pytest.raises(StorageIOError, match=r"register_buffers.*Errno 14"):
            backend.register_buffer(file_backed)
        assert "refused to register them: [Errno 14]" in backend.fixed_buffers_fallback
        # Still fully usable, and the anonymous arena can be registered instead.
        backend.register_buffer(arena)
        assert backend.fixed_buffers_fallback == ""
        with pytest.raises(StorageIOError, match="already registered"):
            backend.register_buffer(arena)
        assert backend.fixed_buffers_fallback == ""  # the first registration is still used
        await backend.writev(data_fd, 0, [arena[:BLOCK]])
        assert backend.statistics().fixed_ops == 1


async def test_many_distinct_buffers_leave_the_mapping_closable(data_fd: int) -> None:
    fd = os.memfd_create("scratch")
    os.ftruncate(fd, MIB)
    mapping = mmap.mmap(fd, MIB)
    view = memoryview(mapping)
    async with open_uring_backend(8) as backend:
        backend.register_buffer(view[: MIB // 2])
        async with anyio.create_task_group() as tg:
            for i in range(MIB // BLOCK):
                tg.start_soon(
                    backend.writev, data_fd, i * BLOCK, [view[i * BLOCK : (i + 1) * BLOCK]]
                )
        assert backend.statistics().fixed_ops == MIB // BLOCK // 2
    view.release()
    mapping.close()
    os.close(fd)


async def test_close_gives_up_on_a_request_that_never_finishes(
    arena: memoryview, caplog: pytest.LogCaptureFixture
) -> None:
    read_end, write_end = os.pipe()
    outcome: list[BaseException] = []

    async def reader() -> None:
        try:
            await backend.readv(read_end, 0, [arena[:BLOCK]])
        except StorageIOError as exc:
            outcome.append(exc)

    try:
        async with (
            anyio.create_task_group() as tg,
            open_uring_backend(4, drain_timeout_s=0.05) as backend,
        ):
            tg.start_soon(reader)
            while backend.statistics().in_flight == 0:  # noqa: ASYNC110 - no event to wait on
                await anyio.sleep(0.001)
    finally:
        os.close(read_end)
        os.close(write_end)
    # The kernel accepted the cancellation of the pipe read, so nothing had to be abandoned.
    assert len(outcome) == 1
    assert "Errno 125" in str(outcome[0])  # ECANCELED
    assert "cancelling 1 stuck requests" in caplog.text
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


async def test_a_failed_preparation_leaves_the_ring_usable(data_fd: int, arena: memoryview) -> None:
    async with open_uring_backend(4) as backend:
        ring = backend._ring

        def broken_prep(tag: int) -> object:
            raise TypeError("bad argument")

        with pytest.raises(TypeError, match="bad argument"):
            await ring.run(broken_prep)
        assert await backend.writev(data_fd, 0, [arena[:BLOCK]]) == BLOCK
        assert await backend.readv(data_fd, 0, [arena[BLOCK : 2 * BLOCK]]) == BLOCK
        assert backend.statistics().in_flight == 0


async def test_a_bad_request_among_many_fails_alone(data_fd: int, arena: memoryview) -> None:
    """Requests past the queue depth wait in the backlog and are started by the reaper; one
    whose preparation fails there raises to its caller once the others of its call completed,
    never in the reaper, and the ring stays usable."""
    data = os.urandom(6 * BLOCK)
    arena[: len(data)] = data
    async with open_uring_backend(2) as backend:
        await backend.writev(data_fd, 0, [arena[: len(data)]])
        ring = backend._ring

        def broken_prep(tag: int) -> object:
            raise TypeError("bad argument")

        targets = [arena[MIB + i * BLOCK : MIB + (i + 1) * BLOCK] for i in range(6)]
        preps = [
            partial(
                ring.raw.prep_rw, RingOp.READV, data_fd, [(buffer_address(t), BLOCK)], i * BLOCK, -1
            )
            for i, t in enumerate(targets)
        ]
        preps.insert(4, broken_prep)  # two in the ring, the rest in the backlog
        with pytest.raises(TypeError, match="bad argument"):
            await ring.run_many(preps)
        assert backend.statistics().in_flight == 0
        assert all(bytes(t) == data[i * BLOCK : (i + 1) * BLOCK] for i, t in enumerate(targets))
        assert await backend.readv(data_fd, 0, [targets[0]]) == BLOCK


async def test_requests_of_one_turn_enter_the_kernel_together(
    data_fd: int, arena: memoryview
) -> None:
    """Reads started in the same turn of the loop are handed to the kernel in one
    ``io_uring_enter``, not one each; every one still gets its own bytes."""
    data = os.urandom(32 * BLOCK)
    arena[: len(data)] = data
    async with open_uring_backend(32) as backend:
        backend.register_buffer(arena)
        await backend.writev(data_fd, 0, [arena[: len(data)]])
        before = backend.statistics()
        targets = [arena[MIB + i * BLOCK : MIB + (i + 1) * BLOCK] for i in range(32)]
        async with anyio.create_task_group() as tg:
            for i, target in enumerate(targets):
                tg.start_soon(backend.readv, data_fd, i * BLOCK, [target])
        after = backend.statistics()
    assert after.submitted - before.submitted == 32
    assert after.submit_calls - before.submit_calls < 32
    assert all(bytes(t) == data[i * BLOCK : (i + 1) * BLOCK] for i, t in enumerate(targets))
