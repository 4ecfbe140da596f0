"""The liburing binding is proven in a child process: whatever it does there (die by a signal,
hang, fail) becomes a verdict with a reason, and the caller lives on."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import msgspec
import pytest

import kvtierd.io
from kvtierd.io.probe import BindingVerdict, FileStamp, _interpret, cached_probe, probe_binding
from tests.support.emulator import emulated_cpu

#: READV_FIXED/WRITEV_FIXED arrived in Linux 6.15.
KERNEL_HAS_FIXED_VECTORED = tuple(map(int, os.uname().release.split(".")[:2])) >= (6, 15)


def test_the_installed_binding_passes_its_probe(uring_verdict: BindingVerdict) -> None:
    assert uring_verdict.ok, f"the liburing binding set-up installed is unusable: {uring_verdict}"
    if KERNEL_HAS_FIXED_VECTORED:
        assert uring_verdict.fixed_buffers, "Linux 6.15+ has the fixed vectored opcodes"
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
@pytest.mark.parametrize("cpu", ["Haswell", "Nehalem"])  # x86-64-v3 without AVX-512; v2, no AVX
def test_the_installed_binding_survives_an_older_cpu(
    cpu: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The PyPI liburing wheel died here with SIGILL. Under the emulator io_uring itself is
    # missing (ENOSYS), but everything up to the first system call runs on the emulated CPU.
    launcher = emulated_cpu(cpu, monkeypatch)
    verdict = probe_binding(launcher=launcher, timeout_s=120)
    if verdict.signal:  # an instruction the CPU lacks kills every run; the emulator's slips do not
        again = probe_binding(launcher=launcher, timeout_s=120)
        assert not again.signal, f"twice: {verdict.detail}; {again.detail}"
        verdict = again
    assert not verdict.hung, verdict.detail
    assert verdict.ok or "Function not implemented" in verdict.detail, verdict.detail


#: An instruction of the VEX or EVEX encodings (AVX, AVX2, AVX-512): its mnemonic starts with
#: "v" (the few legacy "v" instructions are virtualisation and segment checks: excluded).
_VEX = re.compile(r"^\s*[0-9a-f]+:\s+v(?!m|err|erw)[a-z0-9]+\s", re.MULTILINE)


def _disassembly(path: str) -> str:
    command = ["objdump", "-d", "--no-show-raw-insn", path]
    return subprocess.run(command, capture_output=True, text=True, check=True).stdout


@pytest.mark.skipif(shutil.which("objdump") is None, reason="needs objdump (binutils)")
def test_the_binding_uses_no_avx(uring_verdict: BindingVerdict) -> None:
    """No AVX or AVX-512 instruction in any native object the binding loads: it runs on
    x86-64-v2 CPUs too (the emulator cannot reach the code behind io_uring_setup)."""
    objects = [s.path for s in uring_verdict.files if ".so" in Path(s.path).name]
    assert objects, uring_verdict
    for path in objects:
        listing = subprocess.run(
            ["objdump", "-d", "--no-show-raw-insn", path],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        assert not _VEX.findall(listing), f"{path}: {_VEX.findall(listing)[:3]}"


def test_the_build_is_generic_whatever_cflags_say(tmp_path: Path) -> None:
    """CFLAGS asking for AVX-512 (a build host's habit) do not reach the module."""
    if shutil.which("objdump") is None or shutil.which("gcc") is None:
        pytest.skip("needs gcc and objdump")
    build = Path(kvtierd.io.__file__).with_name("_liburing_build.py")
    script = (
        "import importlib.util, sys; "
        f"spec = importlib.util.spec_from_file_location('b', {str(build)!r}); "
        "b = importlib.util.module_from_spec(spec); spec.loader.exec_module(b); "
        "print(b.ffibuilder.compile(tmpdir=sys.argv[1]))"
    )
    env = dict(os.environ, CFLAGS="-O3 -march=native -mavx512f -mavx2")
    built = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path)], env=env, capture_output=True, text=True
    )
    if built.returncode != 0 and "liburing.h" in built.stderr:
        pytest.skip("liburing's headers are not installed")
    assert built.returncode == 0, built.stderr
    listing = _disassembly(built.stdout.strip().splitlines()[-1])
    assert not _VEX.findall(listing), _VEX.findall(listing)[:3]


@pytest.mark.usefixtures("uring_works")
def test_an_ok_verdict_is_cached_until_what_it_rests_on_changes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
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

    # The dynamic linker told to look elsewhere may load another liburing: probe again.
    assert cached_probe(cache, directory=tmp_path).cached
    monkeypatch.setenv("LD_LIBRARY_PATH", str(tmp_path))
    assert not cached_probe(cache, directory=tmp_path).cached


@pytest.mark.usefixtures("standins")
def test_a_failed_verdict_is_not_cached(tmp_path: Path) -> None:
    cache = tmp_path / "io_uring.verdict"
    assert not cached_probe(cache, "sigill_binding").ok
    assert not cache.exists()


def test_the_child_prints_one_json_verdict(tmp_path: Path) -> None:
    child = subprocess.run(
        [sys.executable, "-c", "import sys; from kvtierd.io.selftest import main; "
         "sys.exit(main(sys.argv[1:]))", "no_such_binding", str(tmp_path), str(os.getpid()),
         "10"],
        capture_output=True, check=True,
    )  # fmt: skip
    verdict = msgspec.json.decode(child.stdout, type=BindingVerdict)
    assert (verdict.binding, verdict.ok) == ("no_such_binding", False)


def test_only_a_clean_exit_that_names_the_binding_is_a_verdict() -> None:
    ok = msgspec.json.encode(BindingVerdict("other", True, "fine")) + b"\n"
    assert not _interpret("mine", 0, ok, b"").ok  # about another binding
    ok = msgspec.json.encode(BindingVerdict("mine", True, "fine")) + b"\n"
    assert _interpret("mine", 0, ok, b"").ok
    assert not _interpret("mine", 3, ok, b"").ok  # a verdict, but not a clean exit
    died = _interpret("mine", -35, b"", b"")  # a real-time signal has no Signals member
    assert (died.ok, died.signal) == (False, "signal 35")


@pytest.mark.usefixtures("standins")
def test_the_child_dies_with_its_parent(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pidfile = tmp_path / "pid"
    monkeypatch.setenv("KVTIERD_TEST_HANG_PIDFILE", str(pidfile))
    parent = subprocess.Popen(
        [sys.executable, "-c", "from kvtierd.io.probe import probe_binding; "
         "probe_binding('hang_binding', timeout_s=60)"],
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 30
        while not (pidfile.exists() and pidfile.read_text()):
            assert time.monotonic() < deadline
            time.sleep(0.02)
        parent.kill()  # as SIGTERM or the OOM killer would, leaving no time to clean up
        parent.wait()
        child = int(pidfile.read_text())
        while _alive(child):
            assert time.monotonic() < deadline, "the probe's child outlived its parent"
            time.sleep(0.02)
    finally:
        parent.kill()


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"
