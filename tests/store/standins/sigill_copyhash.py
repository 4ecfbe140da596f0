"""A stand-in copy+hash module built "for another CPU": importing it dies with SIGILL, as a
native module does on a CPU that lacks an instruction it was compiled for."""

from __future__ import annotations

import os
import signal

os.kill(os.getpid(), signal.SIGILL)
raise AssertionError("SIGILL did not end the process")
