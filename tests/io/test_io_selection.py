"""How a backend is chosen: by name, once, in :func:`kvtierd.io.open_io_backend`, and only after
the liburing binding survived its probe in a child process."""

from __future__ import annotations

import logging
import os

import pytest

from kvtierd.errors import StorageIOError
from kvtierd.io import IoBackendKind, open_io_backend

pytestmark = pytest.mark.anyio


@pytest.mark.usefixtures("uring_works")
async def test_auto_picks_io_uring_here(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="kvtierd.io")
    async with open_io_backend() as backend:
        assert backend.kind is IoBackendKind.IO_URING
        fixed = backend.supports_fixed_buffers
    kernel = tuple(map(int, os.uname().release.split(".")[:2]))
    assert fixed or kernel < (6, 15)  # the fixed vectored opcodes arrived in Linux 6.15
    shown = "supported" if fixed else "unsupported"
    assert f"io backend: io_uring (queue depth 64, fixed buffers {shown})" in caplog.text
    assert "io_uring binding: liburing" in caplog.text
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


@pytest.mark.parametrize("name", ["threads", IoBackendKind.THREADS])
async def test_threads_by_name_or_member(name: str) -> None:
    async with open_io_backend(name, queue_depth=2) as backend:
        assert backend.kind is IoBackendKind.THREADS
        assert not backend.supports_fixed_buffers


@pytest.mark.usefixtures("standins")
async def test_auto_falls_back_to_threads_when_the_binding_dies(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="kvtierd.io")
    async with open_io_backend("auto", binding="sigill_binding") as backend:
        assert backend.kind is IoBackendKind.THREADS
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == [
        "io_uring unavailable, falling back to threads: the liburing binding sigill_binding "
        "died with SIGILL: this CPU lacks an instruction it was built for"
    ]
    assert "io backend: threads" in caplog.text


@pytest.mark.usefixtures("standins")
async def test_explicit_io_uring_does_not_fall_back() -> None:
    with pytest.raises(StorageIOError, match="sigill_binding died with SIGILL"):
        async with open_io_backend("io_uring", binding="sigill_binding"):
            pass  # pragma: no cover


async def test_a_binding_that_is_not_installed_is_unavailable() -> None:
    with pytest.raises(StorageIOError, match="not installed: No module named 'no_such_binding'"):
        async with open_io_backend("io_uring", binding="no_such_binding"):
            pass  # pragma: no cover


def test_unknown_name_lists_the_valid_ones() -> None:
    with pytest.raises(ValueError, match="'uring'; valid names: io_uring, threads, auto"):
        open_io_backend("uring")


@pytest.mark.parametrize("queue_depth", [0, -1, 4097])
def test_queue_depth_out_of_range(queue_depth: int) -> None:
    with pytest.raises(ValueError, match="queue_depth"):
        open_io_backend("threads", queue_depth=queue_depth)
