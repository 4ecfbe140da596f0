"""The self-test a liburing binding runs in a child process (see :mod:`kvtierd.io.probe`).

Every call the io_uring backend makes, once, in the order the backend makes them: ring set-up,
eventfd registration, the opcode probe, buffer registration over a memfd, a fixed (where the
kernel has the opcodes) ``O_DIRECT`` write and read of an unnamed scratch file, a plain read,
``fdatasync``, a NOP and a cancellation, each completion awaited through the eventfd as the
event loop would. :func:`main` prints the :class:`~kvtierd.io.probe.BindingVerdict` as one JSON
line. Whatever kills this process (the point of running it here) is read by the parent from
the exit status.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import select
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import msgspec

from kvtierd.childprobe import bind_to_parent
from kvtierd.host import io_uring_disabled
from kvtierd.io.binding import FSYNC_DATASYNC, RawRing, RingOp, load_binding
from kvtierd.io.buffers import buffer_address
from kvtierd.io.probe import BindingVerdict, FileStamp

__all__ = ["main"]

#: How long the child waits for one completion to arrive through the eventfd.
COMPLETION_TIMEOUT_S = 5.0
_PAGE = 4096


class _ProbeFailure(Exception):
    """One step of the self-test failed."""


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
        if (setting := io_uring_disabled()) not in ("", "0"):
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
    mode = (
        "fixed vectored buffers"
        if fixed
        else "no fixed vectored buffers (READV_FIXED/WRITEV_FIXED: Linux 6.15, or the binding)"
    )
    return BindingVerdict(
        binding_name,
        True,
        f"{binding.describe()}; {mode}",
        fixed_buffers=fixed,
        files=tuple(FileStamp.of(path) for path in files),
    )


def main(argv: list[str]) -> int:
    """The child's entry point: ``BINDING DIR PARENT_PID TIMEOUT_S``; prints the verdict as one
    JSON line."""
    binding_name, directory, parent, timeout_s = argv
    bind_to_parent(int(parent), float(timeout_s))
    verdict = _self_test(binding_name, Path(directory))
    sys.stdout.write(msgspec.json.encode(verdict).decode() + "\n")
    return 0
