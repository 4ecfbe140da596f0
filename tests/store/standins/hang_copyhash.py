"""A stand-in copy+hash module whose import never returns (native code wedged in its
initialisation). It writes its pid to the file named by ``$KVTIERD_TEST_HANG_PIDFILE`` first, so
a test can check what became of the probe's child."""

from __future__ import annotations

import os
import time
from pathlib import Path

if pidfile := os.environ.get("KVTIERD_TEST_HANG_PIDFILE"):
    Path(pidfile).write_text(str(os.getpid()))
while True:
    time.sleep(60)
