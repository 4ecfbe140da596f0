"""The host readers on kernel files laid out as cgroup v1 and v2 hosts lay them out, and on
this machine's own."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvtierd import host


@pytest.fixture
def fake_kernel(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, Path]:
    proc, cgroup = tmp_path / "proc", tmp_path / "cgroup"
    (proc / "self").mkdir(parents=True)
    cgroup.mkdir()
    monkeypatch.setattr(host, "_PROC", proc)
    monkeypatch.setattr(host, "_CGROUP_ROOT", cgroup)
    return proc, cgroup


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_cgroup_v2_headroom_is_the_tightest_ancestor(fake_kernel: tuple[Path, Path]) -> None:
    proc, cgroup = fake_kernel
    _write(proc / "self" / "cgroup", "0::/system.slice/kvtierd.service\n")
    _write(cgroup / "cgroup.controllers", "memory\n")
    _write(cgroup / "system.slice" / "memory.max", "8589934592\n")  # 8 GiB
    _write(cgroup / "system.slice" / "memory.current", "7516192768\n")  # 7 GiB used
    _write(cgroup / "system.slice" / "kvtierd.service" / "memory.max", "max\n")
    _write(cgroup / "system.slice" / "kvtierd.service" / "memory.current", "1\n")
    assert host.cgroup_memory_headroom() == 1 << 30


def test_cgroup_v1_with_no_limit_is_none(fake_kernel: tuple[Path, Path]) -> None:
    proc, cgroup = fake_kernel
    _write(proc / "self" / "cgroup", "5:devices:/\n4:memory:/job\n")
    _write(cgroup / "memory" / "job" / "memory.limit_in_bytes", "9223372036854771712\n")
    _write(cgroup / "memory" / "job" / "memory.usage_in_bytes", "1000\n")
    assert host.cgroup_memory_headroom() is None
    (cgroup / "memory" / "job" / "memory.limit_in_bytes").write_text("5000\n")
    assert host.cgroup_memory_headroom() == 4000
    # Usage counts page cache; the part the kernel reclaims first is headroom too.
    _write(cgroup / "memory" / "job" / "memory.stat", "cache 900\ntotal_inactive_file 600\n")
    assert host.cgroup_memory_headroom() == 4600


def test_a_hidden_cgroup_path_falls_back_to_the_mount(fake_kernel: tuple[Path, Path]) -> None:
    """Inside a container /proc/self/cgroup names a path the container cannot see."""
    proc, cgroup = fake_kernel
    _write(proc / "self" / "cgroup", "4:memory:/docker/abc\n")
    _write(cgroup / "memory" / "memory.limit_in_bytes", "2048\n")
    _write(cgroup / "memory" / "memory.usage_in_bytes", "2049\n")
    assert host.cgroup_memory_headroom() == 0


def test_meminfo_and_capabilities(fake_kernel: tuple[Path, Path]) -> None:
    proc, _ = fake_kernel
    _write(
        proc / "meminfo",
        "MemAvailable:    2048 kB\nHugePages_Free:        3\nHugepagesize:       2048 kB\n",
    )
    _write(proc / "self" / "status", "Name:\tx\nCapEff:\t0000000000004000\n")
    assert host.memory_available() == 2 << 20
    assert host.free_hugepage_bytes() == 3 * (2 << 20)
    assert host.has_capability(host.CAP_IPC_LOCK)
    assert not host.has_capability(0)


def test_unreadable_files_promise_least(fake_kernel: tuple[Path, Path]) -> None:
    assert host.memory_available() is None
    assert host.free_hugepage_bytes() == 0
    assert host.cgroup_memory_headroom() is None
    assert not host.has_capability(host.CAP_IPC_LOCK)


def test_this_machine() -> None:
    available = host.memory_available()
    assert available is not None
    assert available > 0
    assert host.shmem_thp_mode() in ("always", "within_size", "advise", "never", "deny", "force")
    assert host.nearest_existing(Path("/no/such/dir")) == Path("/")
    assert host.io_uring_disabled() in ("0", "1", "2")
