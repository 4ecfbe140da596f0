"""Copying a block and taking the xxh3-64 of the copy in one pass over memory.

Every reader verifies what it copies (a client's ``read_into``, the daemon's copy into a slot at
COMMIT and from a NIXL landing buffer): the checksum must describe the bytes the caller got,
never a second read of a source that another client of the same tenant may write meanwhile.
Copying a block whole and then hashing the copy reads every byte from memory twice once the
block is larger than the L2 cache, which held DRAM hits to 0.65-0.73 of a plain copy's speed.

The native module :mod:`kvtierd.store._copyhash` (built from ``_copyhash_build.py``, which says
how) stores each 64-byte stripe of the source from vector registers and feeds the same registers
to xxh3's accumulator: one read of the source, non-temporal writes of the destination, the value
``xxhash.xxh3_64_intdigest`` gives. It is native code, so a process that cannot afford to die
uses it only after :func:`probe` ran its self-test in a child that survived and agreed with
xxhash on every size and alignment tried. The probe runs in a background thread on first use
(about 0.1 s; a client starts it when it maps a region, before its first copy); until its
verdict, and for good if it fails or the module is missing, copies are hashed in Python 256 KiB
at a time (each piece hashed while it is still in the cache). Nothing ever waits for the
probe except a caller that asks to (:meth:`CopyHasher.verdict`).

The module also hashes many small pieces in one call (:meth:`CopyHasher.each`): recovery checks
the 84-byte header of every slot it scans, which cost a Python call (about 1 us) a slot.

``KVTIERD_COPYHASH_MODULE`` names another module to probe and use (tests point it at stand-ins
that crash); set to the empty string it turns the native path off.
"""

from __future__ import annotations

import array
import importlib
import os
import random
import sys
import threading
from collections.abc import Sequence
from typing import Any

import msgspec
import numpy as np
import numpy.typing as npt
import xxhash

from kvtierd.childprobe import bind_to_parent, died_of, last_error_line, run_child, verdict_line

__all__ = [
    "DEFAULT_MODULE",
    "MODULE_ENV",
    "CopyHashVerdict",
    "CopyHasher",
    "checksums_each",
    "copy_checksum",
    "copy_checksum_runs",
    "copy_checksum_scatter",
    "default_hasher",
    "probe",
]

DEFAULT_MODULE = "kvtierd.store._copyhash"
MODULE_ENV = "KVTIERD_COPYHASH_MODULE"
#: How long the probe's child may take before it counts as hung (it needs about 0.1 s).
PROBE_TIMEOUT_S = 10.0
#: Below this many bytes a copy and a hash in Python cost no more than the call into C.
NATIVE_MIN_BYTES = 4096
#: The Python path's piece: hashed right after its copy, while it is in the L2 cache (256 KiB
#: pieces ran at 0.90 of a copy alone, 1 MiB pieces at 0.75).
PIECE_BYTES = 256 << 10

_CHILD = (
    "import sys; from kvtierd.store.copyhash import _selftest; sys.exit(_selftest(sys.argv[1:]))"
)


class CopyHashVerdict(msgspec.Struct, frozen=True):
    """What a probe found: ``ok`` when the module ran and agreed with xxhash everywhere;
    ``kernel`` is the instruction set it chose ("avx2", "sse2"); ``detail`` says why not."""

    module: str
    ok: bool
    detail: str
    kernel: str = ""
    signal: str = ""


def probe(
    module: str, *, timeout_s: float = PROBE_TIMEOUT_S, launcher: Sequence[str] = ()
) -> CopyHashVerdict:
    """Run ``module``'s self-test (:func:`_selftest`) in a child process and say how it ended;
    ``launcher`` is prepended to the child's command line (an emulator of an older CPU, such as
    ``qemu-x86_64 -cpu Nehalem``). Never raises for anything the child does."""
    args = [module, str(os.getpid()), str(timeout_s)]
    run = run_child(_CHILD, args, timeout_s=timeout_s, launcher=launcher)
    if run.start_error:
        return CopyHashVerdict(module, False, f"the probe could not start: {run.start_error}")
    if run.timed_out:
        return CopyHashVerdict(module, False, f"{module} hung in its self-test ({timeout_s:g} s)")
    died = died_of(run.returncode)
    if died is not None:
        name, meaning = died
        return CopyHashVerdict(module, False, f"{module} died with {name}: {meaning}", signal=name)
    verdict = verdict_line(run, CopyHashVerdict)
    if verdict is not None and verdict.module == module:
        return verdict
    return CopyHashVerdict(
        module, False, f"the probe exited with {run.returncode}: {last_error_line(run)}"
    )


def _selftest(args: list[str]) -> int:
    """The probe's child: load the module, copy and hash every awkward size at every alignment
    the kernels tell apart, scatter too, and print a verdict (one JSON line)."""
    module, parent, timeout_s = args[0], int(args[1]), float(args[2])
    bind_to_parent(parent, timeout_s)
    try:
        native = importlib.import_module(module)
        problem = _disagreement(native)
        kernel = native.ffi.string(native.lib.kvt_kernel()).decode()
    except Exception as exc:  # anything but a crash: the verdict says what
        verdict = CopyHashVerdict(module, False, f"{module} failed: {exc!r}")
    else:
        ok = problem is None
        verdict = CopyHashVerdict(module, ok, problem or f"{module} agrees with xxhash", kernel)
    sys.stdout.write(msgspec.json.encode(verdict).decode() + "\n")
    return 0


#: Sizes around every boundary of the kernels: xxh3's 240-byte short path, its 64-byte stripes
#: and 1024-byte blocks, the one-pass kernel's 64 KiB minimum, the 16 KiB piece.
_SIZES = (0, 1, 17, 64, 240, 241, 1023, 1024, 1025, 16385, 65535, 65536, 65601, 1 << 20, 3 << 20)


def _disagreement(native: Any) -> str | None:
    """Where ``native`` and xxhash differ (a copy or a hash), or ``None``."""
    ffi, lib = native.ffi, native.lib
    rng = random.Random(32)
    source = bytearray(rng.randbytes(max(_SIZES) + 64))
    for size in _SIZES:
        for shift in (0, 1, 8, 16):  # 16-byte aligned or not
            src = memoryview(source)[shift : shift + size]
            dest = bytearray(size + 64)
            offset = (shift - int(ffi.cast("uintptr_t", ffi.from_buffer(dest)))) % 64
            target = memoryview(dest)[offset : offset + size]
            got = lib.kvt_copy_xxh3(ffi.from_buffer(target), ffi.from_buffer(src), size)
            if bytes(target) != bytes(src) or got != xxhash.xxh3_64_intdigest(src):
                return f"copy of {size} bytes at offset {offset} differs from xxhash"
        cuts = sorted(rng.randrange(size + 1) for _ in range(3))
        lengths = [b - a for a, b in zip([0, *cuts], [*cuts, size], strict=True)]
        parts = [bytearray(n) for n in lengths]
        pointers = [ffi.from_buffer(p) for p in parts]
        got = lib.kvt_copy_xxh3_scatter(pointers, lengths, len(parts), ffi.from_buffer(source))
        if b"".join(parts) != source[:size] or got != xxhash.xxh3_64_intdigest(source[:size]):
            return f"scatter copy of {size} bytes into {lengths} differs from xxhash"
        problem = _runs_disagreement(native, memoryview(source)[:size], rng)
        if problem is not None:
            return problem
    return _each_disagreement(native, source, rng)


def _each_disagreement(native: Any, source: bytearray, rng: random.Random) -> str | None:
    """Where ``kvt_xxh3_each`` and xxhash differ: pieces of xxh3's short and middle paths
    (a record header is 84 bytes) and longer, at odd offsets, overlapping or not."""
    ffi, lib = native.ffi, native.lib
    for length in (0, 1, 16, 17, 84, 128, 129, 240, 241, 4096):
        offsets = array.array("Q", (rng.randrange(len(source) - length) for _ in range(33)))
        out = array.array("Q", bytes(8 * len(offsets)))
        lib.kvt_xxh3_each(
            ffi.from_buffer(source),
            ffi.from_buffer("uint64_t[]", offsets),
            length,
            len(offsets),
            ffi.from_buffer("uint64_t[]", out, require_writable=True),
        )
        if list(out) != [xxhash.xxh3_64_intdigest(source[o : o + length]) for o in offsets]:
            return f"checksums of {length}-byte pieces differ from xxhash"
    return None


def _runs_disagreement(native: Any, source: memoryview, rng: random.Random) -> str | None:
    """Where ``kvt_copy_xxh3_runs`` and xxhash differ, for runs of whole stripes (the one-pass
    kernel) and of odd lengths (the streaming one), in shuffled order with gaps between."""
    ffi, lib, size = native.ffi, native.lib, len(source)
    for run in (64 * rng.randrange(1, 64), rng.randrange(1, 5000)):
        count = -(-size // run) if size else 1
        order = list(range(count))
        rng.shuffle(order)
        offsets = array.array("Q", (16 + i * (run + 48) for i in order))
        dest = bytearray(16 + count * (run + 48))
        got = lib.kvt_copy_xxh3_runs(
            ffi.from_buffer(dest),
            ffi.from_buffer("uint64_t[]", offsets),
            run,
            count,
            ffi.from_buffer(source),
            size,
        )
        stored = b"".join(dest[o : o + run] for o in offsets)[:size]
        if stored != source or got != xxhash.xxh3_64_intdigest(source):
            return f"runs copy of {size} bytes into runs of {run} differs from xxhash"
    return None


class CopyHasher:
    """Copies that return the xxh3-64 of what they stored, natively once ``module`` (default:
    ``KVTIERD_COPYHASH_MODULE``, else :data:`DEFAULT_MODULE`) passed its probe, in Python
    until then. Thread-safe; the probe starts on first use, in a background thread."""

    def __init__(self, module: str | None = None) -> None:
        self.module = os.environ.get(MODULE_ENV, DEFAULT_MODULE) if module is None else module
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._started = False
        self._verdict: CopyHashVerdict | None = None
        self._ffi: Any = None
        self._lib: Any = None

    def verdict(
        self, *, wait: bool = False, timeout_s: float = 2 * PROBE_TIMEOUT_S
    ) -> CopyHashVerdict | None:
        """The probe's verdict (starting the probe if it has not run), ``None`` while it runs;
        ``wait`` blocks until it is known (for start-up reports, benchmarks and tests)."""
        self._start()
        if wait:
            self._done.wait(timeout_s)
        return self._verdict

    @property
    def native(self) -> bool:
        """Whether copies run in the native module now."""
        return self._lib is not None

    def _start(self) -> None:
        with self._lock:
            if self._started:
                return
            self._started = True
        if not self.module:
            why = f"{MODULE_ENV} is empty: copies are hashed in Python"
            self._settle(CopyHashVerdict("", False, why))
            return
        threading.Thread(target=self._probe, name="kvtierd-copyhash-probe", daemon=True).start()

    def _probe(self) -> None:
        verdict = probe(self.module)
        if verdict.ok:
            try:  # the child survived the same import and calls: this process may make them
                native = importlib.import_module(self.module)
                self._ffi, self._lib = native.ffi, native.lib
            except Exception as exc:
                verdict = CopyHashVerdict(self.module, False, f"import failed here: {exc!r}")
        self._settle(verdict)

    def _settle(self, verdict: CopyHashVerdict) -> None:
        self._verdict = verdict
        self._done.set()

    def _native_lib(self, length: int) -> Any:
        if length < NATIVE_MIN_BYTES:
            return None
        if not self._started:
            self._start()
        return self._lib

    def copy(self, dest: memoryview, source: memoryview) -> int:
        """Copy ``source`` into ``dest`` (the same length, not overlapping) and return the
        xxh3-64 of the bytes stored in ``dest``."""
        if len(dest) != len(source):
            raise ValueError(f"copy of {len(source)} bytes into {len(dest)}")
        lib = self._native_lib(len(source))
        if lib is not None:
            ffi = self._ffi
            target = ffi.from_buffer(dest, require_writable=True)
            return int(lib.kvt_copy_xxh3(target, ffi.from_buffer(source), len(source)))
        if len(source) <= PIECE_BYTES:
            dest[:] = source
            return xxhash.xxh3_64_intdigest(dest)
        state = xxhash.xxh3_64()
        for start in range(0, len(source), PIECE_BYTES):
            piece = dest[start : start + PIECE_BYTES]
            piece[:] = source[start : start + PIECE_BYTES]
            state.update(piece)
        return state.intdigest()

    def scatter(self, targets: Sequence[memoryview], source: memoryview) -> tuple[int, int]:
        """Copy ``source`` into ``targets`` in order, filling each before the next, until the
        source or the targets run out; return (bytes copied, xxh3-64 of the bytes stored)."""
        lengths, left = [], len(source)
        for target in targets:
            lengths.append(min(len(target), left))
            left -= lengths[-1]
        copied = len(source) - left
        lib = self._native_lib(copied)
        if lib is not None:
            ffi = self._ffi
            pointers = [ffi.from_buffer(t, require_writable=True) for t in targets]
            return copied, int(
                lib.kvt_copy_xxh3_scatter(pointers, lengths, len(lengths), ffi.from_buffer(source))
            )
        state, done = xxhash.xxh3_64(), 0
        for target, n in zip(targets, lengths, strict=False):
            for start in range(0, n, PIECE_BYTES):
                piece = target[start : min(n, start + PIECE_BYTES)]
                piece[:] = source[done : done + len(piece)]
                state.update(piece)
                done += len(piece)
        return copied, state.intdigest()

    def runs(
        self, storage: memoryview, offsets: Sequence[int], length: int, source: memoryview
    ) -> tuple[int, int]:
        """Copy ``source`` into the runs ``storage[o : o + length]`` for each ``o`` in
        ``offsets`` (not overlapping), filling each before the next, until the source or the
        runs run out; return (bytes copied, xxh3-64 of the bytes stored). One call into the
        native module for any number of runs (a strided page of a host pool), in one pass
        over memory when the runs are whole 64-byte stripes at 16-byte aligned addresses.
        Raises ``ValueError`` for a run outside ``storage``."""
        used = min(len(offsets), -(-len(source) // length)) if length > 0 else 0
        try:
            starts = array.array("Q", offsets[:used])
        except OverflowError:
            raise ValueError("a run at a negative offset") from None
        if used and max(starts) + length > len(storage):
            raise ValueError(f"a run of {length} bytes past the end of {len(storage)}")
        copied = min(len(source), used * length)
        lib = self._native_lib(copied)
        if lib is None:
            return self.scatter([storage[o : o + length] for o in starts], source)
        ffi = self._ffi
        digest = lib.kvt_copy_xxh3_runs(
            ffi.from_buffer(storage, require_writable=True),
            ffi.from_buffer("uint64_t[]", starts),
            length,
            used,
            ffi.from_buffer(source),
            copied,
        )
        return copied, int(digest)

    def each(
        self, storage: memoryview, offsets: npt.NDArray[np.integer], length: int
    ) -> npt.NDArray[np.uint64]:
        """The xxh3-64 of ``storage[o : o + length]`` for each ``o`` in ``offsets``: one call
        into the native module (recovery checks a run of record headers at once), one hash a
        piece in Python until it passed its probe. Raises ``ValueError`` for a piece outside
        ``storage``."""
        starts = np.ascontiguousarray(offsets, dtype=np.int64)
        if len(starts) and (int(starts.min()) < 0 or int(starts.max()) + length > len(storage)):
            raise ValueError(f"a piece of {length} bytes outside {len(storage)}")
        if length < 0:
            raise ValueError("a negative length")
        out = np.zeros(len(starts), np.uint64)
        if not self._started:
            self._start()
        lib = self._lib
        if lib is None or not len(starts):
            for i, at in enumerate(starts.tolist()):
                out[i] = xxhash.xxh3_64_intdigest(storage[at : at + length])
            return out
        ffi = self._ffi
        lib.kvt_xxh3_each(
            ffi.from_buffer(storage),
            ffi.cast("uint64_t *", starts.ctypes.data),
            length,
            len(starts),
            ffi.cast("uint64_t *", out.ctypes.data),
        )
        return out


_default: CopyHasher | None = None
_default_lock = threading.Lock()


def default_hasher() -> CopyHasher:
    """The process's :class:`CopyHasher` (its module named by the environment)."""
    global _default
    if _default is None:
        with _default_lock:
            if _default is None:
                _default = CopyHasher()
    return _default


def _after_fork_in_child() -> None:
    """A fork during the probe leaves the child without the probe's thread: probe again there
    (else the child would copy in Python for good)."""
    hasher = _default
    if hasher is not None and not hasher._done.is_set():
        hasher._lock = threading.Lock()
        hasher._started = False


os.register_at_fork(after_in_child=_after_fork_in_child)


def copy_checksum(dest: memoryview, source: memoryview) -> int:
    """:meth:`CopyHasher.copy` of the process's hasher."""
    return default_hasher().copy(dest, source)


def copy_checksum_scatter(targets: Sequence[memoryview], source: memoryview) -> tuple[int, int]:
    """:meth:`CopyHasher.scatter` of the process's hasher."""
    return default_hasher().scatter(targets, source)


def checksums_each(
    storage: memoryview, offsets: npt.NDArray[np.integer], length: int
) -> npt.NDArray[np.uint64]:
    """:meth:`CopyHasher.each` of the process's hasher."""
    return default_hasher().each(storage, offsets, length)


def copy_checksum_runs(
    storage: memoryview, offsets: Sequence[int], length: int, source: memoryview
) -> tuple[int, int]:
    """:meth:`CopyHasher.runs` of the process's hasher."""
    return default_hasher().runs(storage, offsets, length, source)
