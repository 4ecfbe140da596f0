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

import enum
import os
from collections.abc import Mapping

import msgspec

from kvtierd.childprobe import ChildRun, died_of, last_error_line, run_child, verdict_line

__all__ = ["PROBE_TIMEOUT_S", "NixlOutcome", "NixlVerdict", "probe_nixl"]

#: How long the child may take before it counts as hung (it needs about 1-2 s, mostly imports).
PROBE_TIMEOUT_S = 30.0

_CHILD = (
    "import sys; from kvtierd.nixl.selftest import main; "
    "from kvtierd.nixl.agent import exit_process; exit_process(main(sys.argv[1:]))"
)


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
    args = [str(os.getpid()), str(timeout_s)]
    run = run_child(_CHILD, args, timeout_s=timeout_s, env=env)
    if run.start_error:
        return NixlVerdict(NixlOutcome.EXIT, f"the NIXL probe could not start: {run.start_error}")
    if run.timed_out:
        return NixlVerdict(
            NixlOutcome.TIMEOUT, f"the NIXL self-test did not finish in {timeout_s:g} s (hung)"
        )
    return _interpret(run.returncode, run.out, run.err)


def _interpret(returncode: int, out: bytes, err: bytes) -> NixlVerdict:
    """A verdict counts only from a child that exited 0 (NIXL logs to stdout before it)."""
    run = ChildRun(returncode, out, err)
    died = died_of(run.returncode)
    if died is not None:
        name, meaning = died
        return NixlVerdict(NixlOutcome.SIGNAL, f"the NIXL self-test died with {name}: {meaning}",
                           signal=name)  # fmt: skip
    verdict = verdict_line(run, NixlVerdict)
    if verdict is not None:
        return msgspec.structs.replace(verdict, exit_code=0)
    return NixlVerdict(
        NixlOutcome.EXIT,
        f"the NIXL self-test exited with {run.returncode}: {last_error_line(run)}",
        exit_code=run.returncode,
    )
