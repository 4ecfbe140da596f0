"""Shared plumbing for the benchmarks under ``tools/``: machine description, JSON output and
recording results into ``docs/benchmarks.md``.

Each benchmark owns one section of ``docs/benchmarks.md`` delimited by
``<!-- BEGIN name -->`` / ``<!-- END name -->`` and rewrites only that section, so benchmarks
can be re-run one at a time. Raw JSON goes to ``docs/benchmarks/<name>.json`` and plots to
``docs/benchmarks/<name>.png``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from kvtierd import config

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "benchmarks.md"
ASSETS = ROOT / "docs" / "benchmarks"

_HEADER = """# Benchmarks

Every figure here was written by a tool under `tools/`, which prints the same numbers as JSON.
Ratios compare kvtierd with a reference measured in the same run (fio on the same file, a numpy
memcpy, recomputation), because absolute figures on these machines drift (the virtual disk is
bimodal: see `../shared/PLATFORM.md`). Tests never assert on these numbers.

"""


def machine() -> dict[str, Any]:
    """A short description of the machine a benchmark ran on."""
    cpu = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "memory_gib": round(mem_gib, 1),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "commit": _git_commit(),
        # the arena's page size follows it (docs/operations.md, huge pages)
        "shmem_thp": _shmem_thp(),
    }


def _shmem_thp() -> str:
    try:
        text = Path("/sys/kernel/mm/transparent_hugepage/shmem_enabled").read_text()
    except OSError:
        return "unknown"
    return next((w.strip("[]") for w in text.split() if w.startswith("[")), "unknown")


def _git_commit() -> str:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
        )
    except OSError:
        return "unknown"
    return out.stdout.strip() or "unknown"


@contextlib.contextmanager
def bench_workdir(name: str) -> Iterator[Path]:
    """A temporary directory for one benchmark's daemons and data files, removed afterwards:
    under ``$BENCH_DIR`` (default ``/var/tmp``, a real disk: ``/tmp`` may be memory, which
    would make every disk figure a memory figure)."""
    with tempfile.TemporaryDirectory(
        prefix=f"kvtierd-{name}-", dir=os.environ.get("BENCH_DIR", "/var/tmp")
    ) as tmp:
        yield Path(tmp)


def drop_page_cache() -> bool:
    """Drop clean page-cache pages (root only); whether it was done."""
    try:
        with open("/proc/sys/vm/drop_caches", "w") as handle:
            handle.write("1\n")
    except OSError:
        return False
    return True


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0-100) of ``values`` by linear interpolation (numpy's default
    method); raises ``ValueError`` for no values."""
    if not values:
        raise ValueError("no values")
    return float(np.percentile(values, q, method="linear"))


def median(values: Sequence[float]) -> float:
    return statistics.median(values)


def emit(result: dict[str, Any], as_json: bool) -> None:
    """Print ``result`` as one JSON object (``--json``) or indented for people."""
    print(json.dumps(result, indent=None if as_json else 2, sort_keys=False))


def record(name: str, markdown: str, result: dict[str, Any]) -> Path:
    """Replace section ``name`` of ``docs/benchmarks.md`` and store the raw JSON beside it."""
    ASSETS.mkdir(parents=True, exist_ok=True)
    (ASSETS / f"{name}.json").write_text(json.dumps(result, indent=2) + "\n")
    text = DOC.read_text() if DOC.exists() else _HEADER
    begin, end = f"<!-- BEGIN {name} -->", f"<!-- END {name} -->"
    block = f"{begin}\n{markdown.strip()}\n{end}"
    pattern = re.compile(re.escape(begin) + r".*?" + re.escape(end), re.S)
    if pattern.search(text):
        text = pattern.sub(lambda _m: block, text)
    else:
        text = text.rstrip() + "\n\n" + block + "\n"
    DOC.write_text(text)
    return DOC


def save_figure(fig: Any, name: str, dpi: int = 110) -> str:
    """Lay ``fig`` out, write it to ``docs/benchmarks/<name>`` and close it; returns the path
    ``docs/benchmarks.md`` links it by."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    ASSETS.mkdir(parents=True, exist_ok=True)
    fig.savefig(ASSETS / name, dpi=dpi)
    plt.close(fig)
    return f"benchmarks/{name}"


def machine_line(info: dict[str, Any]) -> str:
    return (
        f"Machine: {info['cpu']}, {info['cores']} cores, {info['memory_gib']} GiB, "
        f"kernel {info['kernel']}, Python {info['python']}, "
        f"shmem THP {info.get('shmem_thp', 'unknown')}; {info['date']}, commit {info['commit']}."
    )


def log(message: str) -> None:
    """Progress for people, on stderr (stdout carries the JSON)."""
    print(message, file=sys.stderr, flush=True)


def positive_int(text: str) -> int:
    """An argparse type: a whole number of at least 1 (rounds, samples)."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text} is not at least 1")
    return value


def parse_size(text: str) -> int:
    """``256K``, ``2M``, ``1G`` or a plain byte count: the daemon's size syntax."""
    return config.parse_size(text)


def size_name(nbytes: int) -> str:
    """``2 MiB``, ``448 KiB``: a block size as the tables name it."""
    return f"{nbytes >> 20} MiB" if nbytes >= 1 << 20 else f"{nbytes >> 10} KiB"
