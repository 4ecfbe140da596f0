"""kvtierd.server.heap: after a trim, large arrays freed after a larger one was freed (which
raises glibc's dynamic mmap threshold, as a restart's temporary arrays do) no longer stay in the
resident set. Each case runs in a fresh interpreter: the threshold is process-wide."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

_CHILD = """
import sys
import numpy as np
from kvtierd.server import heap

def rss():
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS"):
                return int(line.split()[1]) << 10

mode = sys.argv[1]
big = np.ones(16 << 20, np.uint8)
del big  # a large free raises glibc's dynamic threshold past the arrays below
before = rss()
arrays = [np.ones(1 << 20, np.uint8) for _ in range(200)]
# One array above them holds the heap's top, so glibc cannot give their pages back by
# trimming the top: larger than any free piece below (small ones may land in those, which
# left the top free in some address layouts) and below the raised threshold.
above = np.ones(2 << 20, np.uint8)
del arrays
if mode == "trim":
    assert heap.trim()
print((rss() - before) >> 20)
"""

glibc = pytest.mark.skipif(
    not sys.platform.startswith("linux") or os.confstr("CS_GNU_LIBC_VERSION") is None,
    reason="glibc's allocator",
)


def _kept_mib(mode: str) -> int:
    done = subprocess.run(
        [sys.executable, "-c", _CHILD, mode], capture_output=True, text=True, check=True
    )
    return int(done.stdout)


@glibc
def test_freed_arrays_stay_resident_without_either() -> None:
    assert (
        _kept_mib("none") >= 150
    )  # the case the daemon guards against (else the rest proves nothing)


@glibc
def test_a_trim_returns_them() -> None:
    assert _kept_mib("trim") < 20
