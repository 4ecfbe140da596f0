"""Fixtures for the io backend tests: an O_DIRECT data file, a memfd arena, and a read that the
test can hold in the kernel for as long as it likes (to cancel an operation mid-flight)."""

from __future__ import annotations

import gc
import mmap
import os
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from kvtierd.io import IoBackendKind

BLOCK = 4096
ARENA_BYTES = 4 << 20


@pytest.fixture(params=[IoBackendKind.IO_URING, IoBackendKind.THREADS], ids=str)
def backend_kind(request: pytest.FixtureRequest) -> IoBackendKind:
    kind: IoBackendKind = request.param
    if kind is IoBackendKind.IO_URING:
        request.getfixturevalue("uring_works")
    return kind


@pytest.fixture
def data_path(tmp_path: Path) -> Path:
    return tmp_path / "data"


@pytest.fixture
def data_fd(data_path: Path) -> Iterator[int]:
    """A fresh, empty file at ``data_path`` opened O_RDWR | O_DIRECT."""
    fd = os.open(data_path, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600)
    yield fd
    os.close(fd)


def _mapping(name: str, nbytes: int) -> tuple[int, mmap.mmap]:
    fd = os.memfd_create(name, os.MFD_CLOEXEC)
    os.ftruncate(fd, nbytes)
    return fd, mmap.mmap(fd, nbytes)


@pytest.fixture
def arena() -> Iterator[memoryview]:
    """A 4 MiB memfd mapping, like the daemon's arena (page-aligned, shareable).

    Teardown closes the mmap, which fails if anything (a leaked ``Iovec`` export) still holds it.
    """
    fd, mapping = _mapping("arena", ARENA_BYTES)
    view = memoryview(mapping)
    yield view
    gc.collect()
    view.release()
    mapping.close()
    os.close(fd)


@pytest.fixture
def outside() -> Iterator[memoryview]:
    """A second aligned mapping, never registered with a backend."""
    fd, mapping = _mapping("outside", 1 << 20)
    view = memoryview(mapping)
    yield view
    gc.collect()
    view.release()
    mapping.close()
    os.close(fd)


@dataclass
class HeldRead:
    """A read the test controls: ``readv(fd, 0, [4096 bytes])`` stays in the kernel (or in a
    worker thread) until :meth:`release` is called, then returns ``expected``."""

    fd: int
    expected: bytes
    release: Callable[[], None]


@pytest.fixture
def held_read(
    backend_kind: IoBackendKind, data_fd: int, monkeypatch: pytest.MonkeyPatch
) -> Iterator[HeldRead]:
    expected = bytes(range(256)) * (BLOCK // 256)
    if backend_kind is IoBackendKind.IO_URING:
        # io_uring reads a pipe at "offset 0" as a stream: the request waits for data.
        read_end, write_end = os.pipe()
        yield HeldRead(read_end, expected, lambda: _write_all(write_end, expected))
        os.close(read_end)
        os.close(write_end)
        return
    fd, mapping = _mapping("expected", BLOCK)
    mapping[:] = expected
    os.pwrite(data_fd, mapping, 0)
    gate = threading.Event()
    real_preadv = os.preadv

    def gated_preadv(fd: int, buffers: list[memoryview], offset: int) -> int:
        if not gate.wait(timeout=60):
            raise TimeoutError("the test never released the held read")
        return real_preadv(fd, buffers, offset)

    monkeypatch.setattr(os, "preadv", gated_preadv)
    yield HeldRead(data_fd, expected, gate.set)
    gate.set()
    mapping.close()
    os.close(fd)


def _write_all(fd: int, data: bytes) -> None:
    written = os.write(fd, data)
    assert written == len(data)
