"""The liburing binding is proven in a child process: whatever it does there (die by a signal,
hang, fail) becomes a verdict with a reason, and the caller lives on."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest

from kvtierd.io.probe import BindingVerdict, FileStamp, cached_probe, probe_binding

STANDINS = Path(__file__).parent / "standins"
#: QEMU's user-mode CPU models have no AVX-512 (and Haswell has AVX2, as x86-64-v3 does).
EMULATED_CPU = ["qemu-x86_64", "-cpu", "Haswell"]


@pytest.fixture
def standins(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTHONPATH", str(STANDINS))


def test_the_installed_binding_passes_its_probe(uring_verdict: BindingVerdict) -> None:
    assert uring_verdict.ok, f"the liburing binding set-up installed is unusable: {uring_verdict}"
    assert uring_verdict.fixed_buffers, "this kernel (6.15+) has the fixed vectored opcodes"
    assert uring_verdict.detail.startswith("liburing ")
    loaded = {Path(stamp.path).name for stamp in uring_verdict.files}
    assert "liburing_cffi.py" in loaded
    assert any(name.startswith("liburing.so") for name in loaded)


@pytest.mark.usefixtures("standins")
def test_a_binding_that_dies_with_sigill_is_a_verdict() -> None:
    verdict = probe_binding("sigill_binding")
    assert not verdict.ok
    assert verdict.signal == "SIGILL"
    assert verdict.detail == (
        "the liburing binding sigill_binding died with SIGILL: "
        "this CPU lacks an instruction it was built for"
    )


@pytest.mark.usefixtures("standins")
def test_a_binding_that_hangs_is_killed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pidfile = tmp_path / "pid"
    monkeypatch.setenv("KVTIERD_TEST_HANG_PIDFILE", str(pidfile))
    verdict = probe_binding("hang_binding", timeout_s=2.0)
    assert not verdict.ok
    assert verdict.hung
    assert "did not finish its self-test in 2 s (hung)" in verdict.detail
    pid = int(pidfile.read_text())
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)  # killed and reaped, not left behind


def test_a_missing_binding_is_a_verdict() -> None:
    verdict = probe_binding("no_such_binding")
    assert not verdict.ok
    assert not verdict.signal
    assert "not installed" in verdict.detail


@pytest.mark.skipif(shutil.which("qemu-x86_64") is None, reason="needs qemu-user (qemu-x86_64)")
def test_the_installed_binding_survives_a_cpu_without_avx512() -> None:
    # The PyPI liburing wheel died here with SIGILL. Under the emulator io_uring itself is
    # missing (ENOSYS), but everything up to the first system call runs on the emulated CPU.
    verdict = probe_binding(launcher=EMULATED_CPU, timeout_s=120)
    assert not verdict.signal, verdict.detail
    assert not verdict.hung, verdict.detail
    assert verdict.ok or "Function not implemented" in verdict.detail, verdict.detail


@pytest.mark.skipif(shutil.which("objdump") is None, reason="needs objdump (binutils)")
def test_the_binding_uses_no_avx(uring_verdict: BindingVerdict) -> None:
    """No AVX or AVX-512 register in any native object the binding loads: it runs on
    x86-64-v2 CPUs too (the emulator test cannot reach the code behind io_uring_setup)."""
    objects = [s.path for s in uring_verdict.files if ".so" in Path(s.path).name]
    assert objects, uring_verdict
    for path in objects:
        listing = subprocess.run(
            ["objdump", "-d", "--no-show-raw-insn", path],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        wide = [line for line in listing.splitlines() if "%ymm" in line or "%zmm" in line]
        assert not wide, f"{path}: {wide[:3]}"


@pytest.mark.usefixtures("uring_works")
def test_an_ok_verdict_is_cached_until_what_it_rests_on_changes(tmp_path: Path) -> None:
    cache = tmp_path / "io_uring.verdict"
    first = cached_probe(cache, directory=tmp_path)
    assert first.ok
    assert not first.cached
    assert cached_probe(cache, directory=tmp_path).cached

    # A file the verdict rests on changes (a rebuilt binding, an upgraded liburing): probe again.
    witness = tmp_path / "witness.so"
    witness.write_bytes(b"one")
    entry = msgspec.json.decode(cache.read_bytes())
    entry["verdict"]["files"].append(msgspec.to_builtins(FileStamp.of(str(witness))))
    cache.write_bytes(msgspec.json.encode(entry))
    assert cached_probe(cache, directory=tmp_path).cached
    witness.write_bytes(b"other")
    assert not cached_probe(cache, directory=tmp_path).cached

    cache.write_bytes(b"{not json")
    assert not cached_probe(cache, directory=tmp_path).cached


@pytest.mark.usefixtures("standins")
def test_a_failed_verdict_is_not_cached(tmp_path: Path) -> None:
    cache = tmp_path / "io_uring.verdict"
    assert not cached_probe(cache, "sigill_binding").ok
    assert not cache.exists()


def test_the_child_prints_one_json_verdict(tmp_path: Path) -> None:
    child = subprocess.run(
        [sys.executable, "-c", "import sys; from kvtierd.io.selftest import main; "
         "sys.exit(main(sys.argv[1:]))", "no_such_binding", str(tmp_path)],
        capture_output=True, check=True,
    )  # fmt: skip
    verdict = msgspec.json.decode(child.stdout, type=BindingVerdict)
    assert (verdict.binding, verdict.ok) == ("no_such_binding", False)
