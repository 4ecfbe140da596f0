"""A root directory ``systemd-analyze verify --root=`` can judge the shipped units in: systemd's
own units and the system's commands the units name besides kvtierd's (``kill`` for
``ExecReload=``), as an installed host has them."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

__all__ = ["give_systemd"]


def give_systemd(root: Path) -> None:
    """Put systemd's own units (``sysinit.target`` and the rest) and ``kill`` into ``root``;
    skips the test where systemd's units are not installed."""
    units = next(
        (p for p in map(Path, ("/usr/lib/systemd/system", "/lib/systemd/system"))
         if (p / "sysinit.target").is_file()),
        None,
    )  # fmt: skip
    if units is None:
        pytest.skip("systemd's own units (sysinit.target) are not installed")
    own = root / "usr/lib/systemd/system"
    if not own.exists():
        shutil.copytree(units, own, symlinks=True)
    kill = shutil.which("kill")
    assert kill is not None, "kill is not installed"
    (root / "usr/bin").mkdir(parents=True, exist_ok=True)
    shutil.copy(kill, root / "usr/bin/kill")
