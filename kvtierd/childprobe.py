"""Running native code's self-test in a child process, from both ends.

A probe (:mod:`kvtierd.io.probe` for an io_uring binding, :mod:`kvtierd.nixl.probe` for NIXL)
starts a child Python that loads the native code, exercises it and prints a verdict as its last
line of stdout. :func:`run_child` is the parent's half: it starts the child in a session of its
own, waits up to a timeout, and on a timeout, or the caller's interruption, kills the child's
whole process group (never an orphan). :func:`died_of`, :func:`verdict_line` and
:func:`last_error_line` read how it ended. :func:`bind_to_parent` is the child's half: die with
the parent, on our own once the parent would have given up, and without a core file. Each
probe keeps its own verdict type and words; only the process handling lives here.
"""

from __future__ import annotations

import contextlib
import ctypes
import math
import os
import resource
import signal
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import msgspec

import kvtierd

__all__ = [
    "ChildRun",
    "bind_to_parent",
    "child_environment",
    "died_of",
    "last_error_line",
    "run_child",
    "verdict_line",
]

T = TypeVar("T")

_PR_SET_PDEATHSIG = 1
_SIGNAL_MEANING: dict[int, str] = {
    signal.SIGILL: "this CPU lacks an instruction it was built for",
    signal.SIGSEGV: "it accessed memory it does not own",
    signal.SIGBUS: "it accessed memory that is not there",
    signal.SIGABRT: "it aborted",
}


@dataclass(frozen=True, slots=True)
class ChildRun:
    """How a child ended: ``returncode`` (negative: the signal that killed it), or
    ``timed_out`` (killed by :func:`run_child`), or ``start_error`` (it never started)."""

    returncode: int = 0
    out: bytes = b""
    err: bytes = b""
    timed_out: bool = False
    start_error: str = ""


def run_child(
    code: str,
    args: Sequence[str],
    *,
    timeout_s: float,
    env: Mapping[str, str] | None = None,
    launcher: Sequence[str] = (),
) -> ChildRun:
    """Run ``python -c code args...`` (behind ``launcher``, an emulator for instance) in a
    session of its own, with kvtierd's own directory first on its ``PYTHONPATH`` and ``env``
    added to its environment. Never raises for anything the child does; re-raises only the
    caller's own interruption, after killing the child."""
    try:
        child = subprocess.Popen(
            [*launcher, sys.executable, "-c", code, *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            stdin=subprocess.DEVNULL,
            env=child_environment(env),
            start_new_session=True,
        )
    except OSError as exc:
        return ChildRun(start_error=str(exc))
    try:
        out, err = child.communicate(timeout=timeout_s)
    except BaseException as exc:  # a timeout, or the caller interrupted (Ctrl-C): never orphan it
        with contextlib.suppress(ProcessLookupError):
            os.killpg(child.pid, signal.SIGKILL)
        out, err = child.communicate()
        if not isinstance(exc, subprocess.TimeoutExpired):
            raise
        return ChildRun(child.returncode, out, err, timed_out=True)
    return ChildRun(child.returncode, out, err)


def child_environment(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """This process's environment with ``env`` added and kvtierd's own directory first on
    ``PYTHONPATH``: what a child Python running kvtierd's code gets."""
    child_env = dict(os.environ)
    child_env.update(env or {})
    root = str(Path(kvtierd.__file__).resolve().parent.parent)
    child_env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, child_env.get("PYTHONPATH")]))
    return child_env


def died_of(returncode: int) -> tuple[str, str] | None:
    """The name of the signal that killed a child and what it means for native code, or
    ``None`` when no signal did."""
    if returncode >= 0:
        return None
    try:
        name = signal.Signals(-returncode).name
    except ValueError:
        name = f"signal {-returncode}"
    return name, _SIGNAL_MEANING.get(-returncode, "it was killed")


def verdict_line(run: ChildRun, verdict_type: type[T]) -> T | None:
    """The verdict on the child's last line of stdout (native libraries may log there before
    it), counted only from a child that exited 0; ``None`` when there is none."""
    lines = run.out.decode(errors="replace").strip().splitlines()
    if run.timed_out or run.returncode != 0 or not lines:
        return None
    with contextlib.suppress(msgspec.DecodeError, msgspec.ValidationError):
        return msgspec.json.decode(lines[-1], type=verdict_type)
    return None


def last_error_line(run: ChildRun) -> str:
    """The child's last line of stderr (or "no verdict")."""
    return (run.err.decode(errors="replace").strip().splitlines() or ["no verdict"])[-1]


def bind_to_parent(parent: int, timeout_s: float) -> None:
    """The child's first call: die with the parent (it may be killed while this runs, and this
    runs in a session of its own), and on our own once the parent would have given up anyway
    (a hang in the native code); a crash is the expected failure, so no core file for it."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:  # the parent died before the request above took effect
        os._exit(1)
    signal.signal(signal.SIGALRM, signal.SIG_DFL)
    signal.alarm(max(1, math.ceil(timeout_s)) + 1)
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
