"""Holding a store's disk reads at a chosen moment, so a test can act while one is in flight."""

from __future__ import annotations

from typing import Any

import anyio
import pytest


def gate(
    monkeypatch: pytest.MonkeyPatch, owner: object, name: str
) -> tuple[anyio.Event, anyio.Event]:
    """Replace the async method ``owner.name`` with one that sets ``started`` when a call
    arrives and goes on (to the real method) once ``proceed`` is set."""
    real = getattr(owner, name)
    started, proceed = anyio.Event(), anyio.Event()

    async def gated(*args: Any) -> Any:
        started.set()
        await proceed.wait()
        return await real(*args)

    monkeypatch.setattr(owner, name, gated)
    return started, proceed
