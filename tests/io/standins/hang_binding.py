"""A stand-in liburing binding whose ring set-up never returns (a wedged kernel call). It
writes its pid to the file named by ``$KVTIERD_TEST_HANG_PIDFILE`` first, so a test can check
that the probe killed it."""

from __future__ import annotations

import os
import time
from pathlib import Path


def open_ring(entries: int) -> object:
    if pidfile := os.environ.get("KVTIERD_TEST_HANG_PIDFILE"):
        Path(pidfile).write_text(str(os.getpid()))
    while True:
        time.sleep(60)


def describe() -> str:
    return "a binding that hangs"
