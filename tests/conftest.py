"""Test-suite wide fixtures: every async test runs on asyncio and on trio."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvtierd.io.probe import BindingVerdict, probe_binding

#: Stand-in liburing bindings that crash or hang on purpose (``tests/io/standins``).
STANDIN_BINDINGS = Path(__file__).parent / "io" / "standins"


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def daemon(tmp_path):  # type: ignore[no-untyped-def]
    """A real kvtierd on a 64 MiB arena and a 256 MiB NVMe tier, stopped after the test."""
    from tests.support.daemon import DaemonProcess

    with DaemonProcess(tmp_path / "kvtierd") as process:
        yield process


@pytest.fixture(scope="session")
def uring_verdict() -> BindingVerdict:
    """What the probe says of the liburing binding set-up installed, found once, in a child
    process: a binding that crashes must fail its one test, not kill pytest."""
    return probe_binding()


@pytest.fixture
def uring_works(uring_verdict: BindingVerdict) -> None:
    """Skip a test that loads the liburing binding in-process unless its probe passed."""
    if not uring_verdict.ok:
        pytest.skip(
            "the liburing binding failed its probe (test_the_installed_binding_passes_its_probe "
            f"says why): {uring_verdict.detail}"
        )


@pytest.fixture
def standins(monkeypatch: pytest.MonkeyPatch) -> Path:
    """Make the stand-in bindings importable by name in child processes (the probe's, the
    daemon's); returns their directory."""
    monkeypatch.setenv("PYTHONPATH", str(STANDIN_BINDINGS))
    return STANDIN_BINDINGS
