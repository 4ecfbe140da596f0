"""The contract every io backend keeps, run on io_uring and threads, on asyncio and trio, against a
real O_DIRECT file and page-aligned (memfd) buffers."""

from __future__ import annotations

import errno
import mmap
import os
import resource
from collections.abc import Callable
from pathlib import Path

import anyio
import anyio.lowlevel
import pytest
from conftest import BLOCK, HeldRead

from kvtierd.errors import ClosedError, StorageIOError
from kvtierd.io import IoBackend, IoBackendKind, open_io_backend

pytestmark = pytest.mark.anyio

QUEUE_DEPTH = 4


def _pattern(seed: int, nbytes: int) -> bytes:
    return bytes((seed + i * 7) % 251 for i in range(256)) * (nbytes // 256)


async def _wait_until(predicate: Callable[[], bool]) -> None:
    while not predicate():  # noqa: ASYNC110 - the backend's counters have no event to wait on
        await anyio.sleep(0.001)


def _open_fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


async def test_round_trip_is_byte_exact(
    backend_kind: IoBackendKind, data_path: Path, data_fd: int, arena: memoryview
) -> None:
    data = os.urandom(3 * BLOCK)
    async with open_io_backend(backend_kind, queue_depth=QUEUE_DEPTH) as backend:
        assert backend.kind is backend_kind
        arena[: 3 * BLOCK] = data
        assert await backend.writev(data_fd, 2 * BLOCK, [arena[: 3 * BLOCK]]) == 3 * BLOCK
        target = arena[BLOCK * 16 : BLOCK * 19]
        assert await backend.readv(data_fd, 2 * BLOCK, [target]) == 3 * BLOCK
        assert bytes(target) == data
        await backend.fdatasync(data_fd)
        stats = backend.statistics()
    assert stats.kind == backend_kind.value
    assert (stats.bytes_written, stats.bytes_read, stats.fsyncs) == (3 * BLOCK, 3 * BLOCK, 1)
    assert stats.submitted == stats.completed == 3
    assert stats.in_flight == 0
    assert (await anyio.Path(data_path).read_bytes())[2 * BLOCK :] == data


async def test_vectored_ops_split_buffers_differently(
    backend_kind: IoBackendKind, data_fd: int, arena: memoryview, outside: memoryview
) -> None:
    sizes = [BLOCK, 2 * BLOCK, BLOCK, 3 * BLOCK]
    data = os.urandom(sum(sizes))
    arena[: len(data)] = data
    pieces, pos = [], 0
    for size in sizes:
        pieces.append(arena[pos : pos + size])
        pos += size
    async with open_io_backend(backend_kind, queue_depth=QUEUE_DEPTH) as backend:
        assert await backend.writev(data_fd, BLOCK, pieces) == len(data)
        # Read back in a different split, across two unrelated mappings.
        first, second = outside[: 5 * BLOCK], arena[64 * BLOCK : 66 * BLOCK]
        assert await backend.readv(data_fd, BLOCK, [first, second]) == len(data)
    assert bytes(first) + bytes(second) == data


async def test_many_concurrent_ops_beyond_queue_depth(
    backend_kind: IoBackendKind, data_fd: int, arena: memoryview
) -> None:
    count = 120
    peak = 0

    async def sample(backend: IoBackend) -> None:
        nonlocal peak
        while True:
            peak = max(peak, backend.statistics().in_flight)
            await anyio.lowlevel.checkpoint()

    async def round_trip(backend: IoBackend, i: int) -> None:
        source = arena[i * BLOCK : (i + 1) * BLOCK]
        source[:] = _pattern(i, BLOCK)
        await backend.writev(data_fd, i * BLOCK, [source])
        target = arena[(count + i) * BLOCK : (count + i + 1) * BLOCK]
        await backend.readv(data_fd, i * BLOCK, [target])
        assert bytes(target) == _pattern(i, BLOCK)

    async with open_io_backend(backend_kind, queue_depth=QUEUE_DEPTH) as backend:
        async with anyio.create_task_group() as sampler:
            sampler.start_soon(sample, backend)
            async with anyio.create_task_group() as tg:
                for i in range(count):
                    tg.start_soon(round_trip, backend, i)
            sampler.cancel_scope.cancel()
        stats = backend.statistics()
    assert 1 <= peak <= QUEUE_DEPTH
    assert stats.submitted == stats.completed == 2 * count
    assert stats.bytes_read == stats.bytes_written == count * BLOCK


async def test_read_past_end_of_file_raises(
    backend_kind: IoBackendKind, data_fd: int, arena: memoryview
) -> None:
    async with open_io_backend(backend_kind, queue_depth=QUEUE_DEPTH) as backend:
        await backend.writev(data_fd, 0, [arena[: 2 * BLOCK]])
        with pytest.raises(StorageIOError, match=r"Errno \d+.*end of file after 8192 of 16384"):
            await backend.readv(data_fd, 0, [arena[: 4 * BLOCK]])
        with pytest.raises(StorageIOError, match=r"end of file after 0 of 4096"):
            await backend.readv(data_fd, 100 * BLOCK, [arena[:BLOCK]])
        assert backend.statistics().in_flight == 0


async def test_readv_each_fills_every_request_beyond_queue_depth(
    backend_kind: IoBackendKind, data_fd: int, arena: memoryview
) -> None:
    count = 3 * QUEUE_DEPTH + 1  # more requests than slots: each slot is reused as one ends
    for i in range(count):
        arena[i * BLOCK : (i + 1) * BLOCK] = _pattern(i, BLOCK)
    async with open_io_backend(backend_kind, queue_depth=QUEUE_DEPTH) as backend:
        await backend.writev(data_fd, 0, [arena[: count * BLOCK]])
        base = count * BLOCK  # read back in reverse order, into buffers two blocks apart
        requests = [
            (i * BLOCK, [arena[base + 2 * i * BLOCK :][:BLOCK]]) for i in reversed(range(count))
        ]
        assert await backend.readv_each(data_fd, requests) == [BLOCK] * count
        stats = backend.statistics()
    for i in range(count):
        assert bytes(arena[base + 2 * i * BLOCK :][:BLOCK]) == _pattern(i, BLOCK)
    assert stats.submitted == stats.completed == count + 1
    assert stats.in_flight == 0
    assert stats.bytes_read == count * BLOCK


async def test_readv_each_reports_an_unreadable_request_alone(
    backend_kind: IoBackendKind, data_fd: int, arena: memoryview
) -> None:
    async with open_io_backend(backend_kind, queue_depth=QUEUE_DEPTH) as backend:
        arena[: 2 * BLOCK] = _pattern(3, 2 * BLOCK)
        await backend.writev(data_fd, 0, [arena[: 2 * BLOCK]])
        first, beyond, second = (arena[(4 + i) * BLOCK : (5 + i) * BLOCK] for i in range(3))
        results = await backend.readv_each(
            data_fd, [(0, [first]), (100 * BLOCK, [beyond]), (BLOCK, [second])]
        )
        assert results[0] == results[2] == BLOCK
        assert isinstance(results[1], StorageIOError)
        assert "end of file after 0 of 4096" in str(results[1])
        assert bytes(first) + bytes(second) == _pattern(3, 2 * BLOCK)
        assert backend.statistics().in_flight == 0


async def test_bad_file_descriptor_raises(backend_kind: IoBackendKind, arena: memoryview) -> None:
    # The highest fd number allowed: closed, and no fd opened meanwhile can take it by accident.
    unused = resource.getrlimit(resource.RLIMIT_NOFILE)[0] - 1
    with pytest.raises(OSError, match="Bad file descriptor"):
        os.fstat(unused)
    async with open_io_backend(backend_kind, queue_depth=QUEUE_DEPTH) as backend:
        for fd in (unused, -1):
            with pytest.raises(StorageIOError, match=rf"Errno {errno.EBADF}\b"):
                await backend.readv(fd, 0, [arena[:BLOCK]])
            with pytest.raises(StorageIOError, match="Bad file descriptor"):
                await backend.writev(fd, 0, [arena[:BLOCK]])
            with pytest.raises(StorageIOError, match="Bad file descriptor"):
                await backend.fdatasync(fd)
        assert backend.statistics().in_flight == 0


async def test_fixed_buffers_used_only_inside_the_registered_buffer(
    backend_kind: IoBackendKind, data_fd: int, arena: memoryview, outside: memoryview
) -> None:
    async with open_io_backend(backend_kind, queue_depth=QUEUE_DEPTH) as backend:
        if backend_kind is IoBackendKind.IO_URING and not backend.supports_fixed_buffers:
            pytest.skip("this kernel has no READV_FIXED (Linux < 6.15)")
        backend.register_buffer(arena)
        inside = [arena[BLOCK : 3 * BLOCK], arena[8 * BLOCK : 9 * BLOCK]]
        inside[0][:] = _pattern(1, 2 * BLOCK)
        inside[1][:] = _pattern(2, BLOCK)
        await backend.writev(data_fd, 0, inside)
        fixed_after_write = backend.statistics().fixed_ops
        await backend.readv(data_fd, 0, [outside[: 3 * BLOCK]])
        await backend.readv(data_fd, 0, [arena[: 2 * BLOCK], outside[4 * BLOCK : 5 * BLOCK]])
        fixed_after_outside = backend.statistics().fixed_ops
        await backend.readv(data_fd, 0, [arena[-3 * BLOCK :]])
        fixed_at_end = backend.statistics().fixed_ops
    assert bytes(outside[: 3 * BLOCK]) == _pattern(1, 2 * BLOCK) + _pattern(2, BLOCK)
    assert bytes(arena[-3 * BLOCK :]) == bytes(outside[: 3 * BLOCK])
    expected = [1, 1, 2] if backend.supports_fixed_buffers else [0, 0, 0]
    assert [fixed_after_write, fixed_after_outside, fixed_at_end] == expected


async def test_cancelled_op_completes_before_its_caller_unwinds(
    backend_kind: IoBackendKind, arena: memoryview, data_fd: int, held_read: HeldRead
) -> None:
    buffer = arena[:BLOCK]
    outcome: list[str] = []

    async def reader(backend: IoBackend, scope: anyio.CancelScope) -> None:
        with scope:
            try:
                await backend.readv(held_read.fd, 0, [buffer])
            except anyio.get_cancelled_exc_class():
                outcome.append("cancelled")
                raise
            outcome.append("returned")  # pragma: no cover - the contract forbids it

    async with open_io_backend(backend_kind, queue_depth=QUEUE_DEPTH) as backend:
        scope = anyio.CancelScope()
        async with anyio.create_task_group() as tg:
            tg.start_soon(reader, backend, scope)
            await _wait_until(lambda: backend.statistics().in_flight == 1)
            scope.cancel()
            await anyio.sleep(0.05)
            assert outcome == []  # still held: the kernel owns the buffer
            held_read.release()
        assert outcome == ["cancelled"]
        assert bytes(buffer) == held_read.expected
        stats = backend.statistics()
        assert stats.in_flight == 0
        assert stats.submitted == stats.completed == 1
        # Still usable.
        await backend.writev(data_fd, 0, [buffer])
        await backend.readv(data_fd, 0, [arena[BLOCK : 2 * BLOCK]])
    assert bytes(arena[BLOCK : 2 * BLOCK]) == held_read.expected


async def test_closing_waits_for_in_flight_ops(
    backend_kind: IoBackendKind, arena: memoryview, held_read: HeldRead
) -> None:
    buffer = arena[:BLOCK]
    results: list[int] = []

    async def reader(backend: IoBackend) -> None:
        results.append(await backend.readv(held_read.fd, 0, [buffer]))

    async def release_later() -> None:
        await anyio.sleep(0.05)
        held_read.release()

    async with anyio.create_task_group() as tg:
        async with open_io_backend(backend_kind, queue_depth=QUEUE_DEPTH) as backend:
            tg.start_soon(reader, backend)
            await _wait_until(lambda: backend.statistics().in_flight == 1)
            tg.start_soon(release_later)
        assert results == [BLOCK]  # the exit waited for the read
    assert bytes(buffer) == held_read.expected
    with pytest.raises(ClosedError):
        await backend.readv(held_read.fd, 0, [buffer])


async def test_close_releases_everything_even_after_an_error(
    backend_kind: IoBackendKind, data_fd: int, arena: memoryview
) -> None:
    before = _open_fds()
    opened: list[IoBackend] = []

    async def use_then_fail() -> None:
        async with open_io_backend(backend_kind, queue_depth=QUEUE_DEPTH) as backend:
            opened.append(backend)
            backend.register_buffer(arena)
            await backend.writev(data_fd, 0, [arena[:BLOCK]])
            raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        await use_then_fail()
    assert _open_fds() == before
    (backend,) = opened
    assert backend.statistics().in_flight == 0
    with pytest.raises(ClosedError):
        await backend.writev(data_fd, 0, [arena[:BLOCK]])
    with pytest.raises(ClosedError):
        await backend.fdatasync(data_fd)


async def test_cancelled_while_waiting_for_a_slot_submits_nothing(
    backend_kind: IoBackendKind, arena: memoryview, held_read: HeldRead
) -> None:
    async with open_io_backend(backend_kind, queue_depth=1) as backend:
        async with anyio.create_task_group() as tg:
            tg.start_soon(backend.readv, held_read.fd, 0, [arena[:BLOCK]])
            await _wait_until(lambda: backend.statistics().in_flight == 1)
            with anyio.move_on_after(0.02) as waiting:
                await backend.readv(held_read.fd, 0, [arena[BLOCK : 2 * BLOCK]])
            assert waiting.cancelled_caught
            assert backend.statistics().submitted == 1
            held_read.release()
        assert backend.statistics().completed == 1


async def test_caller_can_unmap_its_buffers_after_close(
    backend_kind: IoBackendKind, data_fd: int
) -> None:
    fd = os.memfd_create("scratch")
    os.ftruncate(fd, 2 * BLOCK)
    mapping = mmap.mmap(fd, 2 * BLOCK)
    view = memoryview(mapping)
    async with open_io_backend(backend_kind, queue_depth=QUEUE_DEPTH) as backend:
        backend.register_buffer(view)
        await backend.writev(data_fd, 0, [view])
        await backend.readv(data_fd, 0, [view[:BLOCK], view[BLOCK:]])  # slices export the mmap
    view.release()
    mapping.close()  # raises BufferError if the backend (or its worker threads) kept an export
    os.close(fd)
