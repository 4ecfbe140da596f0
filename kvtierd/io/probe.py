"""Proving an io_uring binding in a child process before the daemon loads it.

Theory of operation
-------------------
A binding is native code. Built for an instruction this CPU lacks, its first call kills the
whole process with SIGILL: no exception, no log line, and under systemd's ``Restart=`` a restart
loop. So no process that cannot afford to die runs a binding first: :func:`probe_binding`
starts a child Python (:func:`child_main`, given the binding's name and a directory), which
imports the binding and makes every call the backend will make (ring set-up, eventfd
registration, the opcode probe, buffer registration, fixed and plain vectored ``O_DIRECT``
writes and reads of a scratch file in the directory, ``fdatasync``, a NOP, a cancellation),
waiting for each completion through the eventfd, and prints a verdict as one JSON line. The
parent reads how the child ended: a verdict, a signal, a non-zero exit, or nothing before the
timeout (a hang; the child is killed). Only an ``ok`` verdict lets a caller import the binding.

:func:`cached_probe` keeps an ``ok`` verdict in a file, keyed on everything that could change
it: the binding's name, the interpreter, the kernel, the CPU's feature flags, and the size and
modification time of every shared object the binding loaded in the child. Any change, and any
failed verdict, probes again.
"""

from __future__ import annotations

import contextlib
import hashlib
import mmap
import os
import platform
import resource
import select
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path

import msgspec

import kvtierd
from kvtierd.io.binding import (
    FSYNC_DATASYNC,
    RawRing,
    RingOp,
    configured_binding,
    load_binding,
)
from kvtierd.io.buffers import buffer_address

__all__ = ["PROBE_TIMEOUT_S", "BindingVerdict", "FileStamp", "cached_probe", "probe_binding"]

#: How long the child may take before it counts as hung (it needs about 0.1 s).
PROBE_TIMEOUT_S = 10.0
#: How long the child waits for one completion to arrive through the eventfd.
COMPLETION_TIMEOUT_S = 5.0
_PAGE = 4096

_CHILD = "import sys; from kvtierd.io.probe import child_main; sys.exit(child_main(sys.argv[1:]))"
_SIGNAL_MEANING = {
    signal.SIGILL: "this CPU lacks an instruction it was built for",
    signal.SIGSEGV: "it accessed memory it does not own",
    signal.SIGBUS: "it accessed memory that is not there",
    signal.SIGABRT: "it aborted",
}


class FileStamp(msgspec.Struct, frozen=True):
    """A file a verdict depends on, as it was when the verdict was reached."""

    path: str
    size: int
    mtime_ns: int

    @classmethod
    def of(cls, path: str) -> FileStamp:
        st = os.stat(path)
        return cls(path, st.st_size, st.st_mtime_ns)

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


class _ProbeFailure(Exception):
    """One step of the self-test failed (in the child)."""


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
    command = [*launcher, sys.executable, "-c", _CHILD, binding, str(scratch)]
    env = dict(os.environ)
    root = str(Path(kvtierd.__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
    try:
        child = subprocess.Popen(
            command,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            stdin=subprocess.DEVNULL,
            env=env,
            start_new_session=True,
        )
    except OSError as exc:
        return BindingVerdict(binding, False, f"the io_uring probe could not start: {exc}")
    try:
        out, err = child.communicate(timeout=timeout_s)
    except BaseException as exc:  # a timeout, or the caller interrupted (Ctrl-C): never orphan it
        with contextlib.suppress(ProcessLookupError):
            os.killpg(child.pid, signal.SIGKILL)
        child.communicate()
        if not isinstance(exc, subprocess.TimeoutExpired):
            raise
        return BindingVerdict(
            binding,
            False,
            f"the liburing binding {binding} did not finish its self-test in {timeout_s:g} s "
            "(hung)",
            hung=True,
        )
    return _interpret(binding, child.returncode, out, err)


def _interpret(binding: str, returncode: int, out: bytes, err: bytes) -> BindingVerdict:
    if returncode < 0:
        signum = signal.Signals(-returncode)
        meaning = _SIGNAL_MEANING.get(signum, "it was killed")
        return BindingVerdict(
            binding,
            False,
            f"the liburing binding {binding} died with {signum.name}: {meaning}",
            signal=signum.name,
        )
    lines = out.decode(errors="replace").strip().splitlines()
    if lines:
        with contextlib.suppress(msgspec.DecodeError):
            return msgspec.json.decode(lines[-1], type=BindingVerdict)
    last = (err.decode(errors="replace").strip().splitlines() or ["no output"])[-1]
    return BindingVerdict(binding, False, f"the io_uring probe exited with {returncode}: {last}")


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
        if (
            entry.key == key
            and entry.verdict.ok
            and all(f.unchanged() for f in entry.verdict.files)
        ):
            return msgspec.structs.replace(entry.verdict, cached=True)
    verdict = probe_binding(binding, directory=directory, timeout_s=timeout_s)
    if verdict.ok:
        with contextlib.suppress(OSError):
            partial = cache.with_name(cache.name + ".tmp")
            partial.write_bytes(msgspec.json.encode(_CacheEntry(key, verdict)))
            os.replace(partial, cache)
    return verdict


def _cache_key(binding: str) -> str:
    uname = os.uname()
    parts = [binding, sys.executable, sys.version, uname.release, uname.version, _cpu_flags()]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()


def _cpu_flags() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line.split(":", 1)[1].strip()
    return platform.processor()


# -- the child ------------------------------------------------------------------------------


def _mapped_objects() -> set[str]:
    paths = set()
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and ".so" in fields[5] and fields[5].startswith("/"):
            paths.add(fields[5])
    return paths


@contextlib.contextmanager
def _scratch_file(directory: Path) -> Iterator[int]:
    """An unnamed file in ``directory``, ``O_DIRECT`` where the file system has it."""
    flags = os.O_RDWR | os.O_CLOEXEC
    try:
        fd = os.open(directory, flags | os.O_TMPFILE | os.O_DIRECT, 0o600)
    except OSError:
        handle, name = tempfile.mkstemp(dir=directory, prefix=".io-probe-")
        os.unlink(name)
        fd = handle
    try:
        yield fd
    finally:
        os.close(fd)


class _Runner:
    """Submits one request at a time and waits for it through the eventfd, as the daemon does."""

    def __init__(self, ring: RawRing, efd: int) -> None:
        self.ring = ring
        self.efd = efd
        self.tag = 0

    def run(self, step: str) -> int:
        submitted = self.ring.submit()
        if submitted != 1:
            raise _ProbeFailure(f"{step}: io_uring_submit consumed {submitted} entries, not 1")
        readable, _, _ = select.select([self.efd], [], [], COMPLETION_TIMEOUT_S)
        if not readable:
            raise _ProbeFailure(f"{step}: no completion through the eventfd")
        os.eventfd_read(self.efd)
        completions = self.ring.reap()
        if [tag for tag, _ in completions] != [self.tag]:
            raise _ProbeFailure(f"{step}: unexpected completions {completions}")
        return completions[0][1]

    def next_tag(self) -> int:
        self.tag += 1
        return self.tag


def _transfer(runner: _Runner, step: str, op: RingOp, fd: int, address: int, index: int) -> None:
    iovecs = runner.ring.prep_rw(op, fd, [(address, _PAGE)], 0, index, runner.next_tag())
    result = runner.run(step)
    del iovecs  # referenced until the completion was reaped
    if result != _PAGE:
        detail = os.strerror(-result) if result < 0 else f"moved {result} of {_PAGE} bytes"
        raise _ProbeFailure(f"{step}: {detail}")


def _exercise(ring: RawRing, directory: Path) -> bool:
    """Every call the backend makes, once; returns whether fixed vectored buffers work."""
    efd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
    memfd = os.memfd_create("kvtierd-io-probe", os.MFD_CLOEXEC)
    try:
        ring.register_eventfd(efd)
        fixed = ring.supports(RingOp.READV_FIXED) and ring.supports(RingOp.WRITEV_FIXED)
        os.ftruncate(memfd, 3 * _PAGE)
        with mmap.mmap(memfd, 3 * _PAGE) as arena, _scratch_file(directory) as fd:
            address = buffer_address(memoryview(arena))
            if fixed:
                ring.register_buffers([(address, 2 * _PAGE)])
            pattern = os.urandom(_PAGE)
            arena[:_PAGE] = pattern
            runner = _Runner(ring, efd)
            write = RingOp.WRITEV_FIXED if fixed else RingOp.WRITEV
            read = RingOp.READV_FIXED if fixed else RingOp.READV
            _transfer(runner, "write", write, fd, address, 0 if fixed else -1)
            _transfer(runner, "read", read, fd, address + _PAGE, 0 if fixed else -1)
            _transfer(runner, "plain read", RingOp.READV, fd, address + 2 * _PAGE, -1)
            if not arena[_PAGE : 2 * _PAGE] == arena[2 * _PAGE :] == pattern:
                raise _ProbeFailure("read back other bytes than were written")
            ring.prep_fsync(fd, FSYNC_DATASYNC, runner.next_tag())
            if (result := runner.run("fdatasync")) < 0:
                raise _ProbeFailure(f"fdatasync: {os.strerror(-result)}")
            ring.prep_nop(runner.next_tag())
            runner.run("nop")
            ring.prep_cancel_all(runner.next_tag())
            runner.run("cancel")  # nothing to cancel: -ENOENT is the expected answer
        return fixed
    finally:
        os.close(memfd)
        os.close(efd)


def _unavailable_hint(exc: OSError) -> str:
    if exc.errno == 1:  # EPERM
        with contextlib.suppress(OSError):
            setting = Path("/proc/sys/kernel/io_uring_disabled").read_text().strip()
            if setting != "0":
                return f" (kernel.io_uring_disabled = {setting})"
        return " (seccomp or a container may forbid io_uring)"
    if exc.errno == 38:  # ENOSYS
        return " (this kernel, or the emulator running it, has no io_uring)"
    return ""


def _self_test(binding_name: str, directory: Path) -> BindingVerdict:
    before = _mapped_objects()
    try:
        binding = load_binding(binding_name)
    except ImportError as exc:
        return BindingVerdict(binding_name, False, f"the liburing binding is not installed: {exc}")
    try:
        ring = binding.open_ring(8)
    except OSError as exc:
        return BindingVerdict(
            binding_name, False, f"io_uring unavailable: {exc}{_unavailable_hint(exc)}"
        )
    try:
        fixed = _exercise(ring, directory)
    except (OSError, _ProbeFailure) as exc:
        return BindingVerdict(binding_name, False, f"io_uring self-test failed: {exc}")
    finally:
        ring.close()
    spec = sys.modules[binding_name].__file__
    files = sorted((_mapped_objects() - before) | ({spec} if spec else set()))
    mode = "fixed vectored buffers" if fixed else "no fixed vectored buffers (Linux < 6.15)"
    return BindingVerdict(
        binding_name,
        True,
        f"{binding.describe()}; {mode}",
        fixed_buffers=fixed,
        files=tuple(FileStamp.of(path) for path in files),
    )


def child_main(argv: list[str]) -> int:
    """The child's entry point: ``BINDING DIR``; prints the verdict as one JSON line."""
    # A crash of the binding is the expected failure here: no core file for it.
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    binding_name, directory = argv
    verdict = _self_test(binding_name, Path(directory))
    sys.stdout.write(msgspec.json.encode(verdict).decode() + "\n")
    return 0
