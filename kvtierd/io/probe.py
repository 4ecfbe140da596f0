"""Proving an io_uring binding in a child process before the daemon loads it.

Theory of operation
-------------------
A binding is native code. Built for an instruction this CPU lacks, its first call kills the
whole process with SIGILL: no exception, no log line, and under systemd's ``Restart=`` a restart
loop. So no process that cannot afford to die runs a binding first: :func:`probe_binding`
starts a child Python (:mod:`kvtierd.io.selftest`, given the binding's name and a directory),
which imports the binding and makes every call the backend will make (ring set-up, eventfd
registration, the opcode probe, buffer registration, fixed and plain vectored ``O_DIRECT``
writes and reads of a scratch file in the directory, ``fdatasync``, a NOP, a cancellation),
waiting for each completion through the eventfd, and prints a verdict as one JSON line. The
parent reads how the child ended: a verdict, a signal, a non-zero exit, or nothing before the
timeout (a hang; the child is killed). Only an ``ok`` verdict lets a caller import the binding.

:func:`cached_probe` keeps an ``ok`` verdict in a file, keyed on everything that could change
it: the binding's name, kvtierd's version, the interpreter, the kernel, the CPU's feature flags,
what steers the dynamic linker (``LD_LIBRARY_PATH``, ``LD_PRELOAD``, ``/etc/ld.so.cache``), and
the contents (SHA-256) of the self-test and of every file the binding loaded in the child. Any
change, and any failed verdict, probes again.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import platform
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

import msgspec

import kvtierd
from kvtierd.childprobe import ChildRun, died_of, last_error_line, run_child, verdict_line
from kvtierd.io.binding import configured_binding

__all__ = ["PROBE_TIMEOUT_S", "BindingVerdict", "FileStamp", "cached_probe", "probe_binding"]

#: How long the child may take before it counts as hung (it needs about 0.1 s).
PROBE_TIMEOUT_S = 10.0

_CHILD = "import sys; from kvtierd.io.selftest import main; sys.exit(main(sys.argv[1:]))"


class FileStamp(msgspec.Struct, frozen=True):
    """A file a verdict depends on, by the SHA-256 of its contents when the verdict was reached
    (a size and a time can be forged by ``touch``; the few hundred KiB hash in about a ms)."""

    path: str
    sha256: str

    @classmethod
    def of(cls, path: str) -> FileStamp:
        with open(path, "rb") as file:
            return cls(path, hashlib.file_digest(file, "sha256").hexdigest())

    def unchanged(self) -> bool:
        try:
            return FileStamp.of(self.path) == self
        except OSError:
            return False


class BindingVerdict(msgspec.Struct, frozen=True):
    """What a probe found. ``detail`` is one line: what ran, or why it cannot.

    ``signal`` names the signal that killed the child ("" when none did); ``hung`` is true when
    it was killed for taking longer than the timeout.
    """

    binding: str
    ok: bool
    detail: str
    fixed_buffers: bool = False
    signal: str = ""
    hung: bool = False
    files: tuple[FileStamp, ...] = ()
    cached: bool = False


class _CacheEntry(msgspec.Struct, frozen=True):
    key: str
    verdict: BindingVerdict
    #: Files the verdict rests on besides the binding's own: the self-test, the linker's cache.
    context: tuple[FileStamp, ...] = ()


def probe_binding(
    binding: str | None = None,
    *,
    directory: Path | None = None,
    timeout_s: float = PROBE_TIMEOUT_S,
    launcher: Sequence[str] = (),
) -> BindingVerdict:
    """Run the self-test of ``binding`` in a child process and say how it ended.

    ``binding`` defaults to :func:`kvtierd.io.binding.configured_binding`. ``directory`` holds
    the scratch file (it should be where the data file lives, so that
    ``O_DIRECT`` is tried on that file system; default: the system's temporary directory).
    ``launcher`` is prepended to the child's command line (an emulator such as
    ``qemu-x86_64 -cpu Haswell``). Never raises for anything the child does.
    """
    binding = binding or configured_binding()
    scratch = directory if directory is not None else Path(tempfile.gettempdir())
    args = [binding, str(scratch), str(os.getpid()), str(timeout_s)]
    run = run_child(_CHILD, args, timeout_s=timeout_s, launcher=launcher)
    if run.start_error:
        return BindingVerdict(
            binding, False, f"the io_uring probe could not start: {run.start_error}"
        )
    if run.timed_out:
        return BindingVerdict(
            binding,
            False,
            f"the liburing binding {binding} did not finish its self-test in {timeout_s:g} s "
            "(hung)",
            hung=True,
        )
    return _interpret(binding, run.returncode, run.out, run.err)


def _interpret(binding: str, returncode: int, out: bytes, err: bytes) -> BindingVerdict:
    """A verdict counts only from a child that exited 0 and spoke of ``binding``."""
    run = ChildRun(returncode, out, err)
    died = died_of(run.returncode)
    if died is not None:
        name, meaning = died
        return BindingVerdict(
            binding,
            False,
            f"the liburing binding {binding} died with {name}: {meaning}",
            signal=name,
        )
    verdict = verdict_line(run, BindingVerdict)
    if verdict is not None and verdict.binding == binding:
        return msgspec.structs.replace(verdict, cached=False)
    return BindingVerdict(
        binding, False, f"the io_uring probe exited with {run.returncode}: {last_error_line(run)}"
    )


def cached_probe(
    cache: Path,
    binding: str | None = None,
    *,
    directory: Path | None = None,
    timeout_s: float = PROBE_TIMEOUT_S,
) -> BindingVerdict:
    """:func:`probe_binding`, unless ``cache`` holds an ``ok`` verdict reached under the same
    conditions (see the module docstring). Stores a new ``ok`` verdict in ``cache`` when it can
    (a cache that cannot be written only costs the next start a probe)."""
    binding = binding or configured_binding()
    key = _cache_key(binding)
    with contextlib.suppress(OSError, msgspec.DecodeError, msgspec.ValidationError):
        entry = msgspec.json.decode(cache.read_bytes(), type=_CacheEntry)
        stamps = (*entry.verdict.files, *entry.context)
        if entry.key == key and entry.verdict.ok and all(f.unchanged() for f in stamps):
            return msgspec.structs.replace(entry.verdict, cached=True)
    verdict = probe_binding(binding, directory=directory, timeout_s=timeout_s)
    if verdict.ok:
        with contextlib.suppress(OSError):
            partial = cache.with_name(cache.name + ".tmp")
            partial.write_bytes(msgspec.json.encode(_CacheEntry(key, verdict, _context())))
            os.replace(partial, cache)
    return verdict


def _cache_key(binding: str) -> str:
    uname = os.uname()
    parts = [
        binding, kvtierd.__version__, sys.executable, sys.version, uname.release, uname.version,
        _cpu_flags(), os.environ.get("LD_LIBRARY_PATH", ""), os.environ.get("LD_PRELOAD", ""),
    ]  # fmt: skip
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()


def _context() -> tuple[FileStamp, ...]:
    """The files besides the binding's that a verdict rests on: the self-test that reached it,
    and the dynamic linker's cache (a new liburing in /usr/local, then ldconfig)."""
    paths = [str(Path(__file__).with_name("selftest.py")), "/etc/ld.so.cache"]
    return tuple(FileStamp.of(path) for path in paths if os.path.exists(path))


def _cpu_flags() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line.split(":", 1)[1].strip()
    return platform.processor()
