"""The namespace catalog on disk (:mod:`kvtierd.store.catalog`) and the registry's saves: every
flipped bit of a copy is detected, one damaged copy loses nothing and is rewritten at the next
save, the old unchecksummed format is still read, and a save that fails (a full file system)
raises and leaves the namespace unsaved so that the next OPEN_NS retries."""

from __future__ import annotations

import errno
import logging
import os
from pathlib import Path

import msgspec
import pytest

from kvtierd.errors import NoSpaceError, StorageIOError
from kvtierd.store import catalog, durable
from kvtierd.store.catalog import CopyState, CorruptCatalog, copy_paths, read_copies
from kvtierd.store.namespaces import NamespaceRegistry, NamespaceSpec, PeerCredentials
from tests.support.filesystems import fill, small_file_system

ROOT = PeerCredentials(pid=1, uid=0, gid=0)
pytestmark = pytest.mark.timeout(60)


def spec(name: str, block_bytes: int = 1 << 20) -> NamespaceSpec:
    return NamespaceSpec(name, "default", block_bytes, None, 0, 1)


def registry(path: Path) -> NamespaceRegistry:
    return NamespaceRegistry(path, [], secret=bytes(range(32)))


def names(reg: NamespaceRegistry) -> set[str]:
    return {ns.spec.name for ns in reg}


def saved(path: Path, *specs: NamespaceSpec) -> NamespaceRegistry:
    reg = registry(path)
    for one in specs:
        reg.open(one, ROOT)
    reg.save()
    return reg


def flip_bit(path: Path, bit: int) -> None:
    data = bytearray(path.read_bytes())
    data[bit // 8] ^= 1 << (bit % 8)
    path.write_bytes(bytes(data))


# -- the format ---------------------------------------------------------------------------------


def test_a_copy_round_trips_and_every_flipped_bit_is_detected() -> None:
    payload = msgspec.msgpack.encode([spec("a"), spec("b", 4096)])
    data = catalog.encode(payload)
    assert catalog.decode(data) == payload
    for bit in range(len(data) * 8):
        damaged = bytearray(data)
        damaged[bit // 8] ^= 1 << (bit % 8)
        with pytest.raises(CorruptCatalog):
            catalog.decode(bytes(damaged))


@pytest.mark.parametrize("cut", [0, 1, 15, 16, 23, -1])
def test_a_short_or_long_copy_is_damaged(cut: int) -> None:
    data = catalog.encode(b"\x90")
    with pytest.raises(CorruptCatalog):
        catalog.decode(data[:cut])
    with pytest.raises(CorruptCatalog):
        catalog.decode(data + b"\x00")


def test_a_save_writes_two_checksummed_copies(tmp_path: Path) -> None:
    path = tmp_path / "namespaces.catalog"
    saved(path, spec("a"), spec("b"))
    copies = read_copies(path)
    assert [c.state for c in copies] == [CopyState.INTACT, CopyState.INTACT]
    assert [c.path for c in copies] == list(copy_paths(path))
    assert copies[0].payload == copies[1].payload
    assert sorted(os.listdir(tmp_path)) == ["namespaces.catalog", "namespaces.catalog.1"]
    assert names(registry(path)) == {"a", "b"}


# -- damage ---------------------------------------------------------------------------------


@pytest.mark.parametrize("copy", [0, 1])
def test_one_damaged_copy_loses_nothing_and_is_rewritten(
    tmp_path: Path, copy: int, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "namespaces.catalog"
    saved(path, spec("a"), spec("b"))
    damaged = copy_paths(path)[copy]
    for bit in (3, 8 * 20 + 1, 8 * (damaged.stat().st_size - 9)):  # magic, payload, checksum
        flip_bit(damaged, bit)
        caplog.clear()
        with caplog.at_level(logging.WARNING, "kvtierd.namespaces"):
            reg = registry(path)
        assert names(reg) == {"a", "b"}
        assert any("damaged namespace catalog copy" in r.getMessage() for r in caplog.records)
        # the damage asks for a save, and the save rewrites the copy
        assert all(reg.needs_save(ns) for ns in reg)
        reg.save()
        assert [c.state for c in read_copies(path)] == [CopyState.INTACT, CopyState.INTACT]
        assert not any(reg.needs_save(ns) for ns in reg)


def test_two_damaged_copies_lose_the_catalog_without_an_exception(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "namespaces.catalog"
    saved(path, spec("a"))
    for copy in copy_paths(path):
        flip_bit(copy, 8 * 20)
    with caplog.at_level(logging.ERROR, "kvtierd.namespaces"):
        reg = registry(path)
    assert len(reg) == 0
    assert any("no readable copy" in r.getMessage() for r in caplog.records)
    ns, _ = reg.open(spec("new"), ROOT)
    assert reg.needs_save(ns)
    reg.save()
    assert names(registry(path)) == {"new"}


def test_copies_that_differ_are_united_and_rewritten(tmp_path: Path) -> None:
    """A crash between the two writes of a save leaves the copies one save apart."""
    path = tmp_path / "namespaces.catalog"
    saved(path, spec("a"))
    older = copy_paths(path)[1].read_bytes()
    saved(path, spec("a"), spec("b"))
    copy_paths(path)[1].write_bytes(older)
    reg = registry(path)
    assert names(reg) == {"a", "b"}
    assert all(reg.needs_save(ns) for ns in reg)
    reg.save()
    first, second = read_copies(path)
    assert first.payload == second.payload


def test_the_old_unchecksummed_format_is_read_and_upgraded(tmp_path: Path) -> None:
    path = tmp_path / "namespaces.catalog"
    path.write_bytes(msgspec.msgpack.encode([spec("old"), spec("older", 8192)]))
    reg = registry(path)
    assert names(reg) == {"old", "older"}
    assert read_copies(path)[0].state is CopyState.LEGACY
    assert all(reg.needs_save(ns) for ns in reg)
    reg.save()
    assert [c.state for c in read_copies(path)] == [CopyState.INTACT, CopyState.INTACT]
    assert names(registry(path)) == {"old", "older"}


# -- durability and failures ---------------------------------------------------------------------


def test_a_namespace_needs_a_save_until_one_that_includes_it_succeeds(tmp_path: Path) -> None:
    path = tmp_path / "namespaces.catalog"
    reg = saved(path, spec("a"))
    (a,) = list(reg)
    assert not reg.needs_save(a)
    b, new = reg.open(spec("b"), ROOT)
    assert new
    assert reg.needs_save(b)
    assert not reg.needs_save(a)
    again, new = reg.open(spec("b"), ROOT)  # a retry of the OPEN_NS: not new, still unsaved
    assert again is b
    assert not new
    assert reg.needs_save(b)
    reg.save()
    assert not reg.needs_save(b)
    assert not registry(path).needs_save(next(iter(registry(path))))


def test_without_a_catalog_nothing_needs_saving(tmp_path: Path) -> None:
    reg = NamespaceRegistry(None, [], secret=bytes(range(32)))
    ns, _ = reg.open(spec("a"), ROOT)
    assert not reg.needs_save(ns)
    reg.save()


@pytest.mark.parametrize(
    ("code", "raised"),
    [(errno.ENOSPC, NoSpaceError), (errno.EDQUOT, NoSpaceError), (errno.EIO, StorageIOError)],
)
@pytest.mark.parametrize("failing_copy", [0, 1])
def test_a_failed_save_raises_and_leaves_the_namespace_unsaved(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    code: int,
    raised: type[Exception],
    failing_copy: int,
) -> None:
    path = tmp_path / "namespaces.catalog"
    reg = saved(path, spec("a"))
    ns, _ = reg.open(spec("b"), ROOT)
    real_fsync = os.fsync
    fsyncs = 0

    def fsync(fd: int) -> None:
        nonlocal fsyncs
        fsyncs += 1
        # per copy: the temporary file, then the directory
        if fsyncs == 2 * failing_copy + 1:
            raise OSError(code, os.strerror(code))
        real_fsync(fd)

    monkeypatch.setattr(durable.os, "fsync", fsync)
    with pytest.raises(raised):
        reg.save()
    assert reg.needs_save(ns)
    assert not [p for p in os.listdir(tmp_path) if p.endswith(".tmp")]
    # every copy is whole, old or new
    assert {c.state for c in read_copies(path)} == {CopyState.INTACT}
    monkeypatch.setattr(durable.os, "fsync", real_fsync)
    reg.save()
    assert not reg.needs_save(ns)
    assert names(registry(path)) == {"a", "b"}


def test_a_failed_rewrite_of_a_damaged_copy_is_only_logged(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Every namespace is durable in the intact copy: nothing depends on the rewrite."""
    path = tmp_path / "namespaces.catalog"
    saved(path, spec("a"))
    flip_bit(copy_paths(path)[1], 8 * 20)
    reg = registry(path)

    def fsync(fd: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(durable.os, "fsync", fsync)
    with caplog.at_level(logging.WARNING, "kvtierd.namespaces"):
        reg.save()
    assert any("rewritten at the next save" in r.getMessage() for r in caplog.records)
    (a,) = list(reg)
    assert reg.needs_save(a)  # the next OPEN_NS tries the rewrite again


def test_a_full_file_system_fails_the_save_with_enospc(tmp_path: Path) -> None:
    with small_file_system(tmp_path / "fs", "1m") as fs:
        path = fs / "namespaces.catalog"
        reg = saved(path, spec("a"))
        filler = fs / "filler"
        fill(filler)
        ns, _ = reg.open(spec("b" * 200), ROOT)
        with pytest.raises(NoSpaceError):
            reg.save()
        assert reg.needs_save(ns)
        assert names(registry(path)) == {"a"}
        filler.unlink()
        reg.save()
        assert not reg.needs_save(ns)
        assert names(registry(path)) == {"a", "b" * 200}


# -- a catalog changed under the running daemon -------------------------------------------------


def test_a_removed_replaced_or_edited_copy_is_rewritten_from_memory(tmp_path: Path) -> None:
    path = tmp_path / "namespaces.catalog"
    reg = saved(path, spec("a"), spec("b"))
    assert reg.restore_catalog() is None  # nothing changed: nothing written
    first, second = copy_paths(path)
    first.unlink()
    second.unlink()
    found = reg.restore_catalog()
    assert found is not None
    assert f"{first} was removed" in found
    assert f"{second} was removed" in found
    assert "rewritten from memory (2 namespaces)" in found
    assert names(registry(path)) == {"a", "b"}
    assert reg.restore_catalog() is None
    # another file renamed over a copy (an old backup), and one edited in place
    stale = tmp_path / "old"
    stale.write_bytes(catalog.encode(msgspec.msgpack.encode([spec("a")])))
    os.replace(stale, first)
    with open(second, "r+b") as out:
        out.write(b"\0" * 8)
    found = reg.restore_catalog()
    assert found is not None
    assert f"another file was put at the namespace catalog copy {first}" in found
    assert f"{second} was changed in place" in found
    assert [c.state for c in read_copies(path)] == [CopyState.INTACT] * 2
    assert names(registry(path)) == {"a", "b"}


def test_no_namespace_no_catalog_to_keep(tmp_path: Path) -> None:
    reg = registry(tmp_path / "namespaces.catalog")
    assert reg.restore_catalog() is None
    assert not (tmp_path / "namespaces.catalog").exists()


def test_a_rewrite_that_fails_raises_naming_what_was_found(tmp_path: Path) -> None:
    path = tmp_path / "namespaces.catalog"
    reg = saved(path, spec("a"))
    path.unlink()
    path.mkdir()  # the rename over it fails
    with pytest.raises(StorageIOError, match="was put at the namespace catalog copy"):
        reg.restore_catalog()
    path.rmdir()
    found = reg.restore_catalog()
    assert found is not None
    assert names(registry(path)) == {"a"}
