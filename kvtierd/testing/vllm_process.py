"""A vLLM engine in a child process, driven line by line: what the vLLM tests and the TTFT
benchmark's ``vllm`` engine (``tools/ttft/vllm.py``) use to run "a fresh ``LLM``" while the
caller restarts daemons between requests.

vLLM spawns workers and must be built under ``if __name__ == "__main__":``; its start-up takes
45-80 s on 2 cores, so one child serves many requests. At the end it is asked to stop (its
stdin closes: it shuts its engine core down and exits), given :data:`STOP_TIMEOUT_S`, then its
whole session is killed; what vLLM's processes leave behind goes with them: their IPC sockets
and files live in a temporary directory of the engine's own (``TMPDIR`` and
``VLLM_RPC_BASE_PATH``), removed, and the shared memory they made and no process holds any
more (:func:`kvtierd.testing.shm.remove_orphans`) is unlinked.

The parent writes one JSON command per line on the child's stdin and reads one JSON answer per
line from a pipe of its own (vLLM and torch log on stdout and stderr, which go to
``log_path``)::

    {"op": "generate", "prompt": [ids], "max_tokens": n, "logprobs": k}
        -> {"tokens": [...], "logprobs": [[[id, logprob], ...], ...], "seconds": s,
            "cached_tokens": c}
    {"op": "reset", "connector": bool}  -> {"reset": bool}   (vLLM's reset_prefix_cache)

Nothing here imports vLLM in the parent.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import IO, Any

from kvtierd.testing import shm

__all__ = ["EngineError", "EngineProcess", "Generation", "total_variation"]

#: The CPU backend's KV space (GiB): enough for SmolLM2 at 8K tokens, small enough for 2 engines.
DEFAULT_KV_SPACE_GIB = "1"
#: How long a child asked to stop may take before its session is killed.
STOP_TIMEOUT_S = 30.0


class EngineError(RuntimeError):
    """The engine child failed or exited; the message ends with its log's last lines."""


@dataclass(frozen=True)
class Generation:
    """One greedy generation: tokens, each step's top log-probs, the call's wall time (with
    ``max_tokens=1``: time to first token) and how many prompt tokens vLLM did not compute
    (its own prefix cache plus what a connector loaded)."""

    tokens: list[int]
    logprobs: list[dict[int, float]]
    seconds: float
    cached_tokens: int = 0


def total_variation(a: Sequence[dict[int, float]], b: Sequence[dict[int, float]]) -> float:
    """The largest total-variation distance between two runs' top-k distributions, step by
    step (a token missing from one top-k counts as probability 0 there)."""
    import math

    worst = 0.0
    for pa, pb in zip(a, b, strict=False):
        tokens = set(pa) | set(pb)
        tv = 0.5 * sum(
            abs(math.exp(pa.get(t, -math.inf)) - math.exp(pb.get(t, -math.inf))) for t in tokens
        )
        worst = max(worst, tv)
    return worst


class EngineProcess:
    """``vllm.LLM(**engine_args)`` in a child process (a context manager that kills it).

    ``engine_args`` must be JSON: ``kv_transfer_config`` as a dict (the child builds vLLM's
    ``KVTransferConfig``). ``env`` is added to the child's environment.
    """

    def __init__(
        self,
        engine_args: dict[str, Any],
        *,
        log_path: Path,
        env: dict[str, str] | None = None,
        start_timeout_s: float = 600.0,
    ) -> None:
        self.log_path = log_path
        self._closed = False
        self._shm_before = shm.snapshot()
        # Short: vLLM's IPC socket paths (its ZMQ endpoints) must fit in sun_path.
        self._tmp = tempfile.mkdtemp(prefix="kvtierd-vllm-", dir="/tmp")
        read_fd, write_fd = os.pipe()
        child_env = dict(os.environ)
        child_env.setdefault("VLLM_CPU_KVCACHE_SPACE", DEFAULT_KV_SPACE_GIB)
        child_env.update({"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"})
        child_env.update(env or {})
        child_env.update(
            {"TMPDIR": self._tmp, "VLLM_RPC_BASE_PATH": self._tmp},
            KVTIERD_ENGINE_REPLY_FD=str(write_fd),
        )
        self._log = log_path.open("ab")
        try:
            self._proc = subprocess.Popen(
                [sys.executable, "-m", "kvtierd.testing.vllm_process", json.dumps(engine_args)],
                stdin=subprocess.PIPE,
                stdout=self._log,
                stderr=subprocess.STDOUT,
                env=child_env,
                pass_fds=(write_fd,),
                # vLLM's engine core and workers are the child's children: a session of their
                # own lets close() kill them all (killing the child alone orphans them).
                start_new_session=True,
            )
        except BaseException:
            os.close(read_fd)
            self._log.close()
            shutil.rmtree(self._tmp, ignore_errors=True)
            raise
        finally:
            os.close(write_fd)
        self._replies: IO[str] = os.fdopen(read_fd, "r")
        try:
            self.start_seconds = float(self._answer(start_timeout_s)["started_s"])
        except BaseException:
            self.close()
            raise

    def _answer(self, timeout_s: float) -> dict[str, Any]:
        import select

        ready, _, _ = select.select([self._replies], [], [], timeout_s)
        line = self._replies.readline() if ready else ""
        if not line:
            self.close(stop_timeout_s=0)  # it answers nothing: no use asking it to stop
            why = "timed out" if not ready else f"exited with {self._proc.returncode}"
            raise EngineError(f"the vLLM engine {why}; its log ends with:\n{self.log_tail()}")
        answer: dict[str, Any] = json.loads(line)
        if "error" in answer:
            raise EngineError(f"{answer['error']}\n{self.log_tail()}")
        return answer

    def _command(self, timeout_s: float = 600.0, **command: Any) -> dict[str, Any]:
        stdin = self._proc.stdin
        assert stdin is not None
        try:
            stdin.write((json.dumps(command) + "\n").encode())
            stdin.flush()
        except BrokenPipeError as exc:
            raise EngineError(f"the vLLM engine is gone; log:\n{self.log_tail()}") from exc
        return self._answer(timeout_s)

    def generate(
        self, prompt: Sequence[int], *, max_tokens: int = 1, logprobs: int = 20
    ) -> Generation:
        """Greedy generation of ``max_tokens`` after ``prompt`` (token ids)."""
        answer = self._command(
            op="generate", prompt=list(prompt), max_tokens=max_tokens, logprobs=logprobs
        )
        return Generation(
            tokens=list(answer["tokens"]),
            logprobs=[{int(t): float(lp) for t, lp in step} for step in answer["logprobs"]],
            seconds=float(answer["seconds"]),
            cached_tokens=int(answer.get("cached_tokens") or 0),
        )

    def reset_prefix_cache(self, *, connector: bool = False) -> bool:
        """Empty vLLM's own prefix cache (so the next request cannot hit it); with
        ``connector`` also the connector's (vLLM's CPU offloading tier)."""
        return bool(self._command(op="reset", connector=connector)["reset"])

    def log_tail(self, lines: int = 40) -> str:
        self._log.flush()
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def close(self, *, stop_timeout_s: float = STOP_TIMEOUT_S) -> None:
        """Stop the engine (asked first, given ``stop_timeout_s``, then killed with every
        process it started) and remove what its processes left behind (module docstring);
        idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._proc.stdin is not None:
            with contextlib.suppress(OSError):
                self._proc.stdin.close()  # the child's command loop ends: it shuts down
        with contextlib.suppress(subprocess.TimeoutExpired):
            self._proc.wait(stop_timeout_s)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self._proc.pid, signal.SIGKILL)  # whatever of its session is left
        self._proc.wait()
        _wait_for_group(self._proc.pid)  # their mappings go with them, then the sweep
        self._replies.close()
        self._log.close()
        shm.remove_orphans(self._shm_before)
        shutil.rmtree(self._tmp, ignore_errors=True)

    def __enter__(self) -> EngineProcess:
        return self

    def __exit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


def _wait_for_group(pgid: int, timeout_s: float = 10.0) -> None:
    """Return once no live process of group ``pgid`` is left (SIGKILLed ones take a moment to
    release their memory; zombies hold none, and an orphan's may never be reaped where nothing
    reaps for PID 1), or after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while _group_alive(pgid) and time.monotonic() < deadline:
        time.sleep(0.05)


def _group_alive(pgid: int) -> bool:
    """Whether a process of group ``pgid`` is there and not a zombie (``/proc/PID/stat``)."""
    for pid in (p for p in os.listdir("/proc") if p.isdigit()):
        try:
            with open(f"/proc/{pid}/stat") as stat:
                # "pid (comm) state ppid pgrp ...": comm may hold anything but the last ")"
                state, _, pgrp = stat.read().rpartition(")")[2].split()[:3]
        except (OSError, ValueError):
            continue  # gone meanwhile
        if int(pgrp) == pgid and state != "Z":
            return True
    return False


def _serve(engine_args: dict[str, Any], replies: IO[str]) -> None:
    """The child: build the engine, then answer commands from stdin until it closes."""
    started = time.perf_counter()
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    def reply(**answer: Any) -> None:
        replies.write(json.dumps(answer) + "\n")
        replies.flush()

    args = dict(engine_args)
    if isinstance(args.get("kv_transfer_config"), dict):
        args["kv_transfer_config"] = KVTransferConfig(**args["kv_transfer_config"])
    try:
        llm = LLM(**args)
    except Exception as exc:  # reported to the parent, which shows the log
        reply(error=f"engine start-up failed: {exc!r}")
        return
    reply(started_s=time.perf_counter() - started)
    for line in sys.stdin:
        command = json.loads(line)
        try:
            if command["op"] == "generate":
                params = SamplingParams(
                    max_tokens=command["max_tokens"],
                    temperature=0.0,
                    logprobs=command["logprobs"],
                )
                t0 = time.perf_counter()
                (out,) = llm.generate(
                    {"prompt_token_ids": command["prompt"]}, params, use_tqdm=False
                )
                seconds = time.perf_counter() - t0
                completion = out.outputs[0]
                steps = [
                    [[int(t), float(lp.logprob)] for t, lp in step.items()]
                    for step in (completion.logprobs or [])
                ]
                reply(
                    tokens=list(completion.token_ids),
                    logprobs=steps,
                    seconds=seconds,
                    cached_tokens=out.num_cached_tokens,
                )
            elif command["op"] == "reset":
                connector = bool(command.get("connector", False))
                reply(reset=bool(llm.reset_prefix_cache(reset_connector=connector)))
            else:
                reply(error=f"unknown command {command['op']!r}")
        except Exception as exc:
            reply(error=f"{command['op']} failed: {exc!r}")
    # stdin closed: stop the engine core and its workers, so that they release (unlink) their
    # message queues' shared memory themselves.
    llm.llm_engine.engine_core.shutdown()


if __name__ == "__main__":
    _reply_fd = int(os.environ.pop("KVTIERD_ENGINE_REPLY_FD"))
    # vLLM's processes must not inherit it: the parent sees EOF when this one dies.
    os.set_inheritable(_reply_fd, False)
    with os.fdopen(_reply_fd, "w") as _replies:
        _serve(json.loads(sys.argv[1]), _replies)
    # vLLM's atexit shutdown can hang on a spawned worker: the answers are out, leave now.
    os._exit(0)
