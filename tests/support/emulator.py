"""Children run on an older CPU: qemu-user's model of it, for the tests that prove a native
module survives a CPU without the instructions of the build machine."""

from __future__ import annotations

import pytest

__all__ = ["emulated_cpu"]


def emulated_cpu(cpu: str, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The launcher that runs a child on qemu-user's ``cpu`` (``"Haswell"``, ``"Nehalem"``).

    numpy's OpenBLAS, which the child imports, is told the same CPU and one thread: left to
    itself it picked AVX kernels under ``-cpu Nehalem`` on an AVX-512 host and died with
    SIGILL before the module under test ran, and a thread per core makes qemu-user's threaded
    guests less reliable; neither is what these tests are about."""
    monkeypatch.setenv("OPENBLAS_NUM_THREADS", "1")
    monkeypatch.setenv("OPENBLAS_CORETYPE", cpu)
    return ["qemu-x86_64", "-cpu", cpu]
