"""Test-suite wide fixtures: every async test runs on asyncio and on trio."""

from __future__ import annotations

import pytest


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def daemon(tmp_path):  # type: ignore[no-untyped-def]
    """A real kvtierd on a 64 MiB arena and a 256 MiB NVMe tier, stopped after the test."""
    from tests.support.daemon import DaemonProcess

    with DaemonProcess(tmp_path / "kvtierd") as process:
        yield process
