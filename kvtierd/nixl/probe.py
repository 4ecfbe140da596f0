"""Proving NIXL in a child process before a process that cannot die loads it.

Theory of operation
-------------------
NIXL is native code (its own libraries, UCX and its transports, CUDA stubs) that can fail at
import, refuse to start a backend, crash, or wait forever on a transport that never answers;
and every process that loaded it crashes at interpreter exit (see
:func:`kvtierd.nixl.agent.exit_process`). So :func:`probe_nixl` never imports it: it starts a
child Python (:mod:`kvtierd.nixl.selftest`), which imports NIXL, creates two agents with UCX
backends, registers a memfd buffer in each, has one READ a few KiB out of the other through the
same calls :class:`~kvtierd.nixl.agent.NixlAgent` makes for a peer in another process,
compares the bytes, prints its verdict as one JSON line and ends with ``os._exit``. The parent
reads how the child ended: a verdict, a signal, another exit status, or nothing before the
timeout (the child's process group is killed). Only an ``ok`` verdict lets a caller load NIXL.
"""

from __future__ import annotations

import contextlib
import enum
import os
import signal
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

import msgspec

import kvtierd

__all__ = ["PROBE_TIMEOUT_S", "NixlOutcome", "NixlVerdict", "probe_nixl"]

#: How long the child may take before it counts as hung (it needs about 1-2 s, mostly imports).
PROBE_TIMEOUT_S = 30.0

_CHILD = (
    "import sys; from kvtierd.nixl.selftest import main; "
    "from kvtierd.nixl.agent import exit_process; exit_process(main(sys.argv[1:]))"
)
_SIGNAL_MEANING: dict[int, str] = {
    signal.SIGILL: "this CPU lacks an instruction it was built for",
    signal.SIGSEGV: "it accessed memory it does not own",
    signal.SIGBUS: "it accessed memory that is not there",
    signal.SIGABRT: "it aborted",
}


class NixlOutcome(enum.Enum):
    """How a probe ended."""

    OK = "ok"
    #: ``import nixl`` failed in the child (not installed, a library missing).
    IMPORT_ERROR = "import_error"
    #: NIXL imported, but an agent, backend, registration or transfer failed.
    SELFTEST_FAILED = "selftest_failed"
    #: A signal killed the child.
    SIGNAL = "signal"
    #: The child did not finish within the timeout.
    TIMEOUT = "timeout"
    #: The child exited without a verdict, or could not start.
    EXIT = "exit"


class NixlVerdict(msgspec.Struct, frozen=True):
    """What a probe found. ``detail`` is one line: what ran, or why it cannot.

    ``signal`` names the signal that killed the child ("" when none did); ``exit_code`` is the
    child's exit status (``None`` when a signal or the timeout ended it).
    """

    outcome: NixlOutcome
    detail: str
    signal: str = ""
    exit_code: int | None = None

    @property
    def ok(self) -> bool:
        return self.outcome is NixlOutcome.OK


def probe_nixl(
    *, timeout_s: float = PROBE_TIMEOUT_S, env: Mapping[str, str] | None = None
) -> NixlVerdict:
    """Run the NIXL self-test in a child process and say how it ended.

    ``env`` adds to (or overrides) the child's environment, such as ``UCX_TLS``; kvtierd's own
    directory is put first on its ``PYTHONPATH`` after that. Never raises for anything the
    child does.
    """
    child_env = dict(os.environ)
    child_env.update(env or {})
    root = str(Path(kvtierd.__file__).resolve().parent.parent)
    child_env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, child_env.get("PYTHONPATH")]))
    command = [sys.executable, "-c", _CHILD, str(os.getpid()), str(timeout_s)]
    try:
        child = subprocess.Popen(
            command,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            stdin=subprocess.DEVNULL,
            env=child_env,
            start_new_session=True,
        )
    except OSError as exc:
        return NixlVerdict(NixlOutcome.EXIT, f"the NIXL probe could not start: {exc}")
    try:
        out, err = child.communicate(timeout=timeout_s)
    except BaseException as exc:  # a timeout, or the caller interrupted (Ctrl-C): never orphan it
        with contextlib.suppress(ProcessLookupError):
            os.killpg(child.pid, signal.SIGKILL)
        child.communicate()
        if not isinstance(exc, subprocess.TimeoutExpired):
            raise
        return NixlVerdict(
            NixlOutcome.TIMEOUT, f"the NIXL self-test did not finish in {timeout_s:g} s (hung)"
        )
    return _interpret(child.returncode, out, err)


def _interpret(returncode: int, out: bytes, err: bytes) -> NixlVerdict:
    """A verdict counts only from a child that exited 0; its last line of stdout is the verdict
    (NIXL logs to stdout too)."""
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        meaning = _SIGNAL_MEANING.get(-returncode, "it was killed")
        return NixlVerdict(NixlOutcome.SIGNAL, f"the NIXL self-test died with {name}: {meaning}",
                           signal=name)  # fmt: skip
    lines = out.decode(errors="replace").strip().splitlines()
    if returncode == 0 and lines:
        with contextlib.suppress(msgspec.DecodeError, msgspec.ValidationError):
            verdict = msgspec.json.decode(lines[-1], type=NixlVerdict)
            return msgspec.structs.replace(verdict, exit_code=0)
    last = (err.decode(errors="replace").strip().splitlines() or ["no verdict"])[-1]
    return NixlVerdict(
        NixlOutcome.EXIT, f"the NIXL self-test exited with {returncode}: {last}",
        exit_code=returncode,
    )  # fmt: skip
