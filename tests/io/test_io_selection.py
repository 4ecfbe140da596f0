"""How a backend is chosen: by name, once, in :func:`kvtierd.io.open_io_backend`."""

from __future__ import annotations

import contextlib
import logging

import pytest

import kvtierd.io
from kvtierd.errors import StorageIOError
from kvtierd.io import IoBackend, IoBackendKind, open_io_backend

pytestmark = pytest.mark.anyio


async def test_auto_picks_io_uring_here(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="kvtierd.io")
    async with open_io_backend() as backend:
        assert backend.kind is IoBackendKind.IO_URING
        assert backend.supports_fixed_buffers
    assert "io backend: io_uring (queue depth 64, fixed buffers supported)" in caplog.text
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


@pytest.mark.parametrize("name", ["threads", IoBackendKind.THREADS])
async def test_threads_by_name_or_member(name: str) -> None:
    async with open_io_backend(name, queue_depth=2) as backend:
        assert backend.kind is IoBackendKind.THREADS
        assert not backend.supports_fixed_buffers


async def test_auto_falls_back_to_threads_and_says_why(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def unavailable(queue_depth: int) -> contextlib.AbstractAsyncContextManager[IoBackend]:
        raise StorageIOError("io_uring set-up failed: [Errno 1] Operation not permitted")

    monkeypatch.setattr(kvtierd.io, "_open_uring", unavailable)
    caplog.set_level(logging.INFO, logger="kvtierd.io")
    async with open_io_backend("auto") as backend:
        assert backend.kind is IoBackendKind.THREADS
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "falling back to threads" in warnings[0].getMessage()
    assert "Operation not permitted" in warnings[0].getMessage()
    assert "io backend: threads" in caplog.text


async def test_explicit_io_uring_does_not_fall_back(monkeypatch: pytest.MonkeyPatch) -> None:
    def unavailable(queue_depth: int) -> contextlib.AbstractAsyncContextManager[IoBackend]:
        raise StorageIOError("io_uring set-up failed")

    monkeypatch.setattr(kvtierd.io, "_open_uring", unavailable)
    with pytest.raises(StorageIOError, match="set-up failed"):
        async with open_io_backend("io_uring"):
            pass  # pragma: no cover


def test_unknown_name_lists_the_valid_ones() -> None:
    with pytest.raises(ValueError, match="'uring'; valid names: io_uring, threads, auto"):
        open_io_backend("uring")


@pytest.mark.parametrize("queue_depth", [0, -1, 4097])
def test_queue_depth_out_of_range(queue_depth: int) -> None:
    with pytest.raises(ValueError, match="queue_depth"):
        open_io_backend("threads", queue_depth=queue_depth)
