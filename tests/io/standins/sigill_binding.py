"""A stand-in liburing binding built "for another CPU": its first call dies with SIGILL, as a
native binding does on a CPU that lacks an instruction it was compiled for."""

from __future__ import annotations

import os
import signal


def open_ring(entries: int) -> object:
    os.kill(os.getpid(), signal.SIGILL)
    raise AssertionError("SIGILL did not end the process")


def describe() -> str:
    return "a binding that dies with SIGILL"
