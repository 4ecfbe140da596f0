"""Run Python as another numeric uid and gid: for tests of what the daemon does per peer.

How the child becomes the other uid. ``subprocess``'s ``user=`` changes ids before ``exec``, and
this interpreter lives under ``/root`` (mode 0700), where uid 1234 may not even execute it; its
site-packages are as unreachable. So the child starts as root, imports what it needs
(``preload``, the client library by default, and the module of any function it is to call)
while it can still read every file, and only then drops to the ids: ``setgroups`` (no
supplementary group unless ``groups`` names some), ``setgid``, ``setuid`` (real, effective and
saved ids alike, so nothing of root is left but the modules already loaded and no descriptor
beyond its pipes). Ids need no ``/etc/passwd`` entry. What the child imports after the drop it
must be able to read: the checkout is world-readable here, the interpreter's site-packages are
not, so code that needs more than the client library names it in ``preload``. It runs in the
checkout, with the checkout on ``PYTHONPATH``, because the editable install does not point at
this tree.

How it reaches the daemon. The kernel takes ``SO_PEERCRED`` at ``connect()``, so the child
connects after the drop and the daemon sees the new uid; for that the uid must be able to
search every directory on the socket's path (pytest's ``tmp_path`` sits in a 0700 directory:
start the daemon in :func:`reachable_directory` instead) and write the socket: set
``socket_mode = "0666"`` in the daemon's config, or a ``socket_group`` the child is given in
``groups`` (a group known by name to ``/etc/group``).

Everything here needs root: :func:`require_root` skips the test, with the reason, otherwise.
"""

from __future__ import annotations

import base64
import contextlib
import os
import pickle
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, TypeVar

import pytest

import kvtierd

__all__ = [
    "ChildError",
    "call_as",
    "client_as",
    "reachable_directory",
    "require_root",
    "run_as",
    "start_as",
]

T = TypeVar("T")

#: What the child imports before it drops root: the client library and what it loads lazily.
DEFAULT_PRELOAD = ("kvtierd.client", "kvtierd.client.aio", "numpy")
CHECKOUT = Path(kvtierd.__file__).resolve().parent.parent


class ChildError(RuntimeError):
    """The child failed in a way that is not an exception of the called function (it could not
    drop its ids, it was killed, or its exception could not travel back); ``stderr`` says why."""

    def __init__(self, message: str, stderr: str) -> None:
        super().__init__(f"{message}\n{stderr}")
        self.stderr = stderr


def require_root() -> None:
    """Skip the calling test unless this process is root (only root can become another uid)."""
    if os.geteuid() != 0:
        pytest.skip("needs root: only root may run a child process as another uid and gid")


@contextlib.contextmanager
def reachable_directory() -> Iterator[Path]:
    """A new empty directory that every uid can search (mode 0755, in the system temporary
    directory), for a daemon whose socket other uids must reach; removed afterwards."""
    path = Path(tempfile.mkdtemp(prefix="kvtierd-uids-"))
    try:
        path.chmod(0o755)
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def run_as(
    uid: int,
    gid: int,
    code: str,
    *,
    groups: Sequence[int] = (),
    preload: Sequence[str] = DEFAULT_PRELOAD,
    timeout_s: float = 60.0,
) -> subprocess.CompletedProcess[str]:
    """Run ``code`` (a Python snippet, as ``__main__``) as ``uid``/``gid`` with supplementary
    ``groups``; its status, stdout and stderr. Raises ``subprocess.TimeoutExpired`` (the child
    killed) after ``timeout_s``."""
    require_root()
    return subprocess.run(
        _command(uid, gid, groups, preload, ("code", code)),
        capture_output=True,
        text=True,
        timeout=timeout_s,
        cwd=CHECKOUT,
        env=_environment(),
        check=False,
    )


def start_as(
    uid: int,
    gid: int,
    code: str,
    *,
    groups: Sequence[int] = (),
    preload: Sequence[str] = DEFAULT_PRELOAD,
) -> subprocess.Popen[str]:
    """:func:`run_as` in the background, stdin, stdout and stderr piped (text, line-buffered
    stdout is up to ``code``: ``print(..., flush=True)``), for a child that must hold something
    while the test goes on. The caller kills it; it also dies with the test process."""
    require_root()
    return subprocess.Popen(
        _command(uid, gid, groups, preload, ("code", code)),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=CHECKOUT,
        env=_environment(),
    )


def call_as(
    uid: int,
    gid: int,
    fn: Callable[..., T],
    *args: Any,
    groups: Sequence[int] = (),
    preload: Sequence[str] = DEFAULT_PRELOAD,
    timeout_s: float = 60.0,
) -> T:
    """``fn(*args)`` in a child running as ``uid``/``gid``: its return value, or the exception it
    raised, raised here (a ``BusyError`` from the daemon arrives as a ``BusyError``). ``fn``
    must be a module-level function and its arguments and result picklable; its module is
    imported before the drop. Raises :class:`ChildError` when the child itself failed."""
    require_root()
    with tempfile.TemporaryFile() as result:
        completed = subprocess.run(
            _command(uid, gid, groups, preload, ("call", fn, args, result.fileno())),
            capture_output=True,
            text=True,
            timeout=timeout_s,
            cwd=CHECKOUT,
            env=_environment(),
            pass_fds=(result.fileno(),),
            check=False,
        )
        result.seek(0)
        outcome = result.read()
    if completed.returncode != 0 or not outcome:
        status = completed.returncode
        raise ChildError(f"the child as uid {uid} exited with {status}", completed.stderr)
    ok, value = pickle.loads(outcome)
    if not ok:
        raise value
    return value  # type: ignore[no-any-return]


def client_as(
    uid: int,
    gid: int,
    socket: str | os.PathLike[str],
    fn: Callable[..., T],
    *args: Any,
    groups: Sequence[int] = (),
    timeout_s: float = 60.0,
) -> T:
    """``fn(client, *args)`` with ``client`` a :class:`kvtierd.client.Client` connected to
    ``socket`` as ``uid``/``gid``, closed afterwards: :func:`call_as` for the usual case. A
    refused connection raises its error here (``BusyError``, ``AccessDeniedError``...)."""
    return call_as(
        uid, gid, _with_client, os.fspath(socket), fn, *args, groups=groups, timeout_s=timeout_s
    )


def _with_client(socket: str, fn: Callable[..., T], *args: Any) -> T:
    from kvtierd.client import connect

    with connect(socket, timeout_s=30) as client:
        return fn(client, *args)


def _command(
    uid: int, gid: int, groups: Sequence[int], preload: Sequence[str], task: tuple[Any, ...]
) -> list[str]:
    # The task is pickled apart: unpickling it imports the modules of the functions it names,
    # which the child can do only once it has this process's sys.path (pytest's rootdir-relative
    # test modules are not importable otherwise).
    spec = (uid, gid, tuple(groups), tuple(preload), sys.path, pickle.dumps(task))
    encoded = base64.b64encode(pickle.dumps(spec)).decode()
    return [sys.executable, "-c", "from tests.support.uids import _child; _child()", encoded]


def _environment() -> dict[str, str]:
    path = os.environ.get("PYTHONPATH")
    return dict(
        os.environ,
        PYTHONPATH=f"{CHECKOUT}{os.pathsep}{path}" if path else str(CHECKOUT),
        PYTHONDONTWRITEBYTECODE="1",  # the child cannot write root's __pycache__ anyway
    )


def _child() -> None:
    """The child's side: load, unpickle (which imports the function's module), drop, run."""
    import ctypes
    import importlib
    import traceback

    uid, gid, groups, preload, path, pickled = pickle.loads(base64.b64decode(sys.argv[1]))
    # After the child's own entries: the parent's may carry a package's vendored copies
    # (setuptools puts setuptools/_vendor on sys.path when imported), which must not shadow the
    # installed packages (an old typing_extensions breaks anyio).
    sys.path.extend(entry for entry in path if entry not in sys.path)
    for name in preload:
        importlib.import_module(name)
    task = pickle.loads(pickled)
    if task[0] == "call":
        _, fn, args, result_fd = task  # unpickled already: fn's module is loaded
    os.setgroups(list(groups))
    os.setgid(gid)
    os.setuid(uid)
    assert os.getresuid() == (uid, uid, uid)
    assert os.getresgid() == (gid, gid, gid)
    # Die with the test process (set after the drop: a change of ids clears it).
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if task[0] == "code":
        sys.argv = ["-c"]
        exec(compile(task[1], "<run_as>", "exec"), {"__name__": "__main__"})
        return
    try:
        outcome: tuple[bool, Any] = (True, fn(*args))
    except Exception as exc:
        traceback.print_exc()
        outcome = (False, exc)
    with os.fdopen(result_fd, "wb") as out:
        try:
            out.write(pickle.dumps(outcome))
        except Exception:  # an unpicklable result or exception: the traceback above says it
            traceback.print_exc()
            sys.exit(1)
