"""Pytest fixtures shared by the tests of the package and those of the tools: the NIXL verdict,
found once in a child process (the pytest process never loads NIXL: every process that does
segfaults at interpreter exit). A conftest imports the ones it offers."""

from __future__ import annotations

import importlib.util

import pytest

from kvtierd.nixl.probe import NixlVerdict, probe_nixl

__all__ = ["NOT_INSTALLED", "nixl_verdict", "nixl_works"]

NOT_INSTALLED = (
    "NIXL is not installed: pip install 'kvtierd[nixl]', then pip install --no-deps nixl==1.5.1 "
    "(tools/setup.sh does both)"
)


@pytest.fixture(scope="session")
def nixl_verdict() -> NixlVerdict:
    """What the probe says of the NIXL installed; skips when none is."""
    if importlib.util.find_spec("nixl") is None:
        pytest.skip(NOT_INSTALLED)
    return probe_nixl()


@pytest.fixture
def nixl_works(nixl_verdict: NixlVerdict) -> None:
    """Skip a test that runs NIXL (in children) unless its probe passed."""
    if not nixl_verdict.ok:
        pytest.skip(
            "NIXL failed its probe (test_the_installed_nixl_passes_its_probe says why): "
            f"{nixl_verdict.detail}"
        )
