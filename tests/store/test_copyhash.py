"""The one-pass copy and xxh3-64 (kvtierd.store.copyhash): the native kernels agree with
xxhash on every size, alignment and split of the destination, the hash describes the bytes the
destination got even while the source is being written, and a module that crashes or hashes
wrongly is refused by its probe, leaving the Python path in use."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import threading

import numpy as np
import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtierd.childprobe import child_environment
from kvtierd.client.arena import copy_verified
from kvtierd.store.copyhash import (
    DEFAULT_MODULE,
    MODULE_ENV,
    NATIVE_MIN_BYTES,
    CopyHasher,
    probe,
)
from tests.support.emulator import emulated_cpu

BUILT = importlib.util.find_spec(DEFAULT_MODULE) is not None
needs_module = pytest.mark.skipif(not BUILT, reason=f"{DEFAULT_MODULE} is not built here")


@pytest.fixture(scope="module")
def native() -> CopyHasher:
    hasher = CopyHasher(DEFAULT_MODULE)
    verdict = hasher.verdict(wait=True)
    assert verdict is not None
    assert verdict.ok, verdict.detail
    assert hasher.native
    return hasher


@pytest.fixture(scope="module")
def python() -> CopyHasher:
    hasher = CopyHasher("")
    verdict = hasher.verdict(wait=True)
    assert verdict is not None
    assert not verdict.ok
    assert MODULE_ENV in verdict.detail
    assert not hasher.native
    return hasher


def _aligned(size: int, misalign: int) -> memoryview:
    """A writable buffer of ``size`` bytes whose address is ``misalign`` past a 64-byte line."""
    raw = np.zeros(size + 128, np.uint8)
    start = (misalign - raw.ctypes.data) % 64
    return memoryview(raw[start : start + size])


#: xxh3's boundaries (240-byte short path, 64-byte stripes, 1024-byte blocks), the native
#: kernels' (16 KiB pieces, 64 KiB one-pass minimum) and odd lengths around them.
sizes = st.one_of(
    st.sampled_from([0, 1, 3, 63, 64, 65, 240, 241, 1023, 1024, 1025, 16383, 65535, 65536]),
    st.integers(0, 3 << 20),
)


@needs_module
@settings(max_examples=150, deadline=None)
@given(size=sizes, misalign=st.sampled_from([0, 1, 8, 16, 32, 48]), seed=st.integers(0, 99))
def test_native_copy_agrees_with_xxhash(
    native: CopyHasher, size: int, misalign: int, seed: int
) -> None:
    source = np.random.default_rng(seed).integers(0, 256, size, np.uint8).tobytes()
    dest = _aligned(size, misalign)
    assert native.copy(dest, memoryview(source)) == xxhash.xxh3_64_intdigest(source)
    assert bytes(dest) == source


@st.composite
def scatter(draw: st.DrawFn) -> tuple[bytes, list[int]]:
    size = draw(st.integers(0, 1 << 20))
    cuts = sorted(draw(st.lists(st.integers(0, size), max_size=6)))
    lengths = [b - a for a, b in zip([0, *cuts], [*cuts, size], strict=True)]
    spare = draw(st.integers(0, 100))  # room past the block, which must stay untouched
    return os.urandom(size), [*lengths[:-1], lengths[-1] + spare]


@pytest.mark.parametrize("kind", [pytest.param("native", marks=needs_module), "python"])
@settings(max_examples=60, deadline=None)
@given(case=scatter())
def test_scatter_copies_in_order_and_hashes_what_it_stored(
    kind: str, request: pytest.FixtureRequest, case: tuple[bytes, list[int]]
) -> None:
    hasher: CopyHasher = request.getfixturevalue(kind)
    source, lengths = case
    targets = [memoryview(bytearray(b"\xee" * n)) for n in lengths]
    copied, digest = hasher.scatter(targets, memoryview(source))
    assert copied == len(source)
    assert digest == xxhash.xxh3_64_intdigest(source)
    joined = b"".join(bytes(t) for t in targets)
    assert joined[: len(source)] == source
    assert set(joined[len(source) :]) <= {0xEE}


@st.composite
def runs(draw: st.DrawFn) -> tuple[bytes, int, list[int]]:
    """A block, a run length (whole stripes or not), and runs in any order with gaps, at any
    alignment: the page of a strided host pool."""
    length = draw(st.one_of(st.sampled_from([64, 8192, 16384, 229376]), st.integers(1, 70000)))
    count = draw(st.integers(1, 12))
    size = draw(st.integers(max(0, (count - 1) * length), count * length))
    order = draw(st.permutations(range(count)))
    gap = draw(st.sampled_from([0, 16, 48, 4096, 5]))
    misalign = draw(st.sampled_from([0, 8, 16]))
    offsets = [misalign + i * (length + gap) for i in order]
    return os.urandom(size), length, offsets


@pytest.mark.parametrize("kind", [pytest.param("native", marks=needs_module), "python"])
@settings(max_examples=60, deadline=None)
@given(case=runs())
def test_runs_copy_in_order_and_hash_what_they_stored(
    kind: str, request: pytest.FixtureRequest, case: tuple[bytes, int, list[int]]
) -> None:
    hasher: CopyHasher = request.getfixturevalue(kind)
    source, length, offsets = case
    raw = np.full(max(offsets) + length + 64, 0xEE, np.uint8)
    storage = memoryview(raw)
    copied, digest = hasher.runs(storage, offsets, length, memoryview(source))
    assert copied == len(source)
    assert digest == xxhash.xxh3_64_intdigest(source)
    joined = b"".join(bytes(storage[o : o + length]) for o in offsets)
    assert joined[: len(source)] == source
    assert set(joined[len(source) :]) <= {0xEE}
    outside = np.ones(len(raw), bool)
    for o in offsets:
        outside[o : o + length] = False
    assert set(raw[outside].tolist()) <= {0xEE}, "a run's copy wrote outside the runs"


@pytest.mark.parametrize("kind", [pytest.param("native", marks=needs_module), "python"])
def test_runs_outside_their_storage_are_refused(kind: str, request: pytest.FixtureRequest) -> None:
    hasher: CopyHasher = request.getfixturevalue(kind)
    storage = memoryview(bytearray(1 << 20))
    source = memoryview(os.urandom(1 << 18))
    with pytest.raises(ValueError, match="past the end"):
        hasher.runs(storage, [0, (1 << 20) - 1000], 1 << 17, source)
    with pytest.raises(ValueError, match="negative"):
        hasher.runs(storage, [-64, 0], 1 << 17, source)
    assert bytes(storage) == bytes(1 << 20)  # refused before anything was copied


@pytest.mark.parametrize("kind", [pytest.param("native", marks=needs_module), "python"])
@settings(max_examples=60, deadline=None)
@given(
    data=st.binary(min_size=1, max_size=20000),
    length=st.sampled_from([0, 1, 84, 128, 129, 240, 241, 1000]),
    picks=st.lists(st.integers(0, 1 << 30), max_size=40),
)
def test_each_piece_is_hashed_as_xxhash_hashes_it(
    kind: str, data: bytes, length: int, picks: list[int], request: pytest.FixtureRequest
) -> None:
    hasher: CopyHasher = request.getfixturevalue(kind)
    storage = memoryview(data)
    offsets = np.array([p % max(1, len(data) - length + 1) for p in picks], np.int64)
    if length > len(data):
        offsets = offsets[:0]
    got = hasher.each(storage, offsets, length)
    assert got.dtype == np.uint64
    assert got.tolist() == [xxhash.xxh3_64_intdigest(data[o : o + length]) for o in offsets]


@pytest.mark.parametrize("kind", [pytest.param("native", marks=needs_module), "python"])
def test_pieces_outside_their_storage_are_refused(
    kind: str, request: pytest.FixtureRequest
) -> None:
    hasher: CopyHasher = request.getfixturevalue(kind)
    storage = memoryview(bytes(4096))
    for offsets in ([4013], [-1], [0, 5000]):
        with pytest.raises(ValueError):
            hasher.each(storage, np.array(offsets), 84)


@settings(max_examples=40, deadline=None)
@given(size=sizes)
def test_python_path_agrees_with_xxhash(python: CopyHasher, size: int) -> None:
    source = os.urandom(size)
    dest = memoryview(bytearray(size))
    assert python.copy(dest, memoryview(source)) == xxhash.xxh3_64_intdigest(source)
    assert bytes(dest) == source


@pytest.mark.parametrize("kind", [pytest.param("native", marks=needs_module), "python"])
@pytest.mark.parametrize("misalign", [0, 8, "runs"])  # one-pass, piecewise, one-pass in runs
def test_the_hash_describes_the_copy_while_the_source_is_scribbled(
    kind: str, misalign: int | str, request: pytest.FixtureRequest
) -> None:
    """Another client of the tenant writes the arena during the copy: whatever bytes the
    destination got, the checksum returned is theirs (never a second read of the source)."""
    hasher: CopyHasher = request.getfixturevalue(kind)
    size = 8 << 20
    source = np.zeros(size, np.uint8)
    patterns = [np.full(size, v, np.uint8) for v in (0x11, 0x22, 0x33)]
    stop = threading.Event()

    def scribble() -> None:
        i = 0
        while not stop.is_set():
            np.copyto(source, patterns[i % 3])  # releases the GIL, as the copy does
            i += 1

    writer = threading.Thread(target=scribble)
    writer.start()
    torn = 0
    try:
        for _ in range(20):
            if misalign == "runs":  # 64 runs of 128 KiB, every other one of the storage
                storage = _aligned(2 * size, 0)
                offsets = [(2 * i + 1) * (size >> 6) for i in reversed(range(64))]
                copied, digest = hasher.runs(storage, offsets, size >> 6, memoryview(source))
                assert copied == size
                dest = memoryview(b"".join(storage[o : o + (size >> 6)] for o in offsets))
            else:
                dest = _aligned(size, misalign)
                digest = hasher.copy(dest, memoryview(source))
            assert digest == xxhash.xxh3_64_intdigest(dest)
            torn += len(set(bytes(dest[:: 1 << 16]))) > 1
    finally:
        stop.set()
        writer.join()
    # Not asserted (timing): how many copies caught the writer mid-block, for the log.
    print(f"{torn} of 20 copies were torn by the writer")


@needs_module
def test_copy_verified_uses_the_native_path(native: CopyHasher) -> None:
    # The process's own hasher: once its probe is done, large copies run natively.
    from kvtierd.store.copyhash import default_hasher

    verdict = default_hasher().verdict(wait=True)
    if os.environ.get(MODULE_ENV, DEFAULT_MODULE) == DEFAULT_MODULE:
        assert verdict is not None
        assert verdict.ok
        assert default_hasher().native
    source = os.urandom(NATIVE_MIN_BYTES * 100 + 7)
    dest = memoryview(bytearray(len(source)))
    assert copy_verified(memoryview(source), [dest], xxhash.xxh3_64_intdigest(source))
    assert not copy_verified(memoryview(source), [dest], xxhash.xxh3_64_intdigest(source) ^ 1)


def test_a_module_that_dies_is_refused_and_python_copies(python: CopyHasher) -> None:
    hasher = CopyHasher("tests.store.standins.sigill_copyhash")
    verdict = hasher.verdict(wait=True)
    assert verdict is not None
    assert not verdict.ok
    assert verdict.signal == "SIGILL", verdict.detail
    assert not hasher.native
    source = os.urandom(1 << 20)
    dest = memoryview(bytearray(len(source)))
    assert hasher.copy(dest, memoryview(source)) == xxhash.xxh3_64_intdigest(source)
    assert bytes(dest) == source


def test_a_module_that_hashes_wrongly_is_refused() -> None:
    hasher = CopyHasher("tests.store.standins.wrong_copyhash")
    verdict = hasher.verdict(wait=True)
    assert verdict is not None
    assert not verdict.ok
    assert "differs from xxhash" in verdict.detail
    assert not hasher.native
    source = os.urandom(300)
    dest = memoryview(bytearray(len(source)))
    assert hasher.copy(dest, memoryview(source)) == xxhash.xxh3_64_intdigest(source)


def test_a_missing_module_is_refused() -> None:
    verdict = probe("tests.store.standins.no_such_module")
    assert not verdict.ok
    assert not verdict.signal
    assert "ModuleNotFoundError" in verdict.detail


@needs_module
@pytest.mark.skipif(shutil.which("qemu-x86_64") is None, reason="needs qemu-user (qemu-x86_64)")
@pytest.mark.parametrize(("cpu", "kernel"), [("Haswell", "avx2"), ("Nehalem", "sse2")])
def test_the_module_runs_and_agrees_on_older_cpus(
    cpu: str, kernel: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Built for the x86-64 baseline with AVX2 kernels chosen at run time: an AVX2 CPU without
    # AVX-512 and a CPU without AVX both run it, each with the kernels it has.
    launcher = emulated_cpu(cpu, monkeypatch)
    verdict = probe(DEFAULT_MODULE, launcher=launcher, timeout_s=180)
    assert verdict.ok, verdict.detail
    assert verdict.kernel == kernel


_FORK_DURING_PROBE = """
import os
from kvtierd.store import copyhash
copyhash.default_hasher().verdict()  # the probe starts in a thread, which a fork leaves behind
pid = os.fork()
if pid == 0:
    verdict = copyhash.default_hasher().verdict(wait=True)
    os._exit(0 if verdict is not None and verdict.ok and copyhash.default_hasher().native else 3)
_, status = os.waitpid(pid, 0)
raise SystemExit(os.waitstatus_to_exitcode(status))
"""


@needs_module
def test_a_child_forked_during_the_probe_probes_again() -> None:
    env = child_environment({MODULE_ENV: DEFAULT_MODULE})
    run = subprocess.run(
        [sys.executable, "-c", _FORK_DURING_PROBE], env=env, capture_output=True, timeout=60
    )
    assert run.returncode == 0, run.stderr.decode()
