"""The daemon's side of systemd's file-descriptor store (:mod:`kvtierd.server.fdstore`), against
the harness that reads the notify socket as systemd does (:class:`kvtierd.testing.ServiceManager`):
what a stop hands over, what a start takes back and checks, what it refuses."""

from __future__ import annotations

import fcntl
import logging
import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvtierd.server import fdstore
from kvtierd.server.fdstore import IMAGE_NAME, FdStore, region_name
from kvtierd.store.kept import IMAGE_VERSION, DramImage, KeptRegion, encode_image
from kvtierd.testing import ServiceManager

SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
SIZE = 2 << 20


def region_memfd(size: int = SIZE, seals: int = SEALS) -> int:
    fd = os.memfd_create("kvtierd-test", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, size)
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
    return fd


def image_for(fds: dict[int, int], version: int = IMAGE_VERSION) -> bytes:
    regions = []
    for region_id, fd in fds.items():
        info = os.fstat(fd)
        regions.append(
            KeptRegion(region_id, f"t{region_id}", SIZE, False, info.st_ino, info.st_dev)
        )
    return encode_image(DramImage(version, time.time(), os.getpid(), regions, []))


@pytest.fixture
def manager(tmp_path: Path) -> Iterator[ServiceManager]:
    with ServiceManager(tmp_path) as manager:
        yield manager


def _passed(manager: ServiceManager) -> dict[str, int]:
    """What the next start would be handed: a duplicate of each stored descriptor (the process
    owns what it is passed)."""
    return {name: os.dup(fd) for name, fd in manager.stored()}


def test_a_stop_hands_every_region_then_the_image_and_a_start_takes_them_back(
    manager: ServiceManager,
) -> None:
    regions = {1: region_memfd(), 2: region_memfd()}
    try:
        assert FdStore({}, manager.environment()).keep(list(regions.items()), image_for(regions))
        assert manager.names() == [region_name(1), region_name(2), IMAGE_NAME]
        assert manager.messages[-1] == "BARRIER=1"
        store = FdStore(_passed(manager), manager.environment())
        handed = store.handed()
        assert handed is not None
        assert {shape: r.kept.id for shape, r in handed.regions.items()} == {
            ("t1", SIZE): 1,
            ("t2", SIZE): 2,
        }
        kept = [r.fd for r in handed.regions.values()][:1]
        sent = len(manager.messages)
        store.settle(kept)
        # removed at once, every one: a crash now is handed nothing
        assert manager.names_after(sent + 3) == []
        os.fstat(kept[0])  # the caller's now
        closed = [r.fd for r in handed.regions.values()][1]
        with pytest.raises(OSError):
            os.fstat(closed)
        os.close(kept[0])
    finally:
        for fd in regions.values():
            os.close(fd)


def test_without_a_notify_socket_or_when_off_nothing_is_kept(manager: ServiceManager) -> None:
    fd = region_memfd()
    try:
        assert not FdStore({}, {}).keep([(1, fd)], image_for({1: fd}))
        assert not FdStore({}, manager.environment(), enabled=False).keep(
            [(1, fd)], image_for({1: fd})
        )
        assert manager.messages == []
    finally:
        os.close(fd)


def test_a_store_too_small_is_not_used_and_named(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    fd = region_memfd()
    with ServiceManager(tmp_path, fdstore_max=1) as manager:
        try:
            assert not FdStore({}, manager.environment()).keep([(1, fd)], image_for({1: fd}))
        finally:
            os.close(fd)
        assert manager.messages == []
    assert "FileDescriptorStoreMax= allows 1" in caplog.text


def test_a_manager_that_never_confirms_does_not_hold_the_stop(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """systemd older than 246 ignores BARRIER=1 (and closes its descriptor); a manager that
    keeps it open forever costs the stop at most the barrier's timeout."""
    monkeypatch.setattr(fdstore, "BARRIER_TIMEOUT_S", 0.3)
    path = tmp_path / "silent.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as silent:
        silent.bind(str(path))
        silent.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 20)
        fd = region_memfd()
        try:
            started = time.monotonic()
            kept = FdStore({}, {"NOTIFY_SOCKET": str(path)}).keep([(1, fd)], image_for({1: fd}))
            assert not kept
            assert time.monotonic() - started < 5
        finally:
            os.close(fd)


@pytest.mark.parametrize(
    "damage",
    ["not sealed", "not an image", "another version"],
)
def test_an_unusable_image_starts_empty(
    manager: ServiceManager, caplog: pytest.LogCaptureFixture, damage: str
) -> None:
    fd = region_memfd()
    data = image_for({1: fd})
    if damage == "not an image":
        data = b"\x93not msgpack of an image"
    elif damage == "another version":
        data = image_for({1: fd}, version=IMAGE_VERSION + 1)
    image = os.memfd_create("image", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.write(image, data)
    if damage != "not sealed":
        fcntl.fcntl(image, fcntl.F_ADD_SEALS, SEALS | fcntl.F_SEAL_WRITE)
    store = FdStore({region_name(1): fd, IMAGE_NAME: image}, manager.environment())
    with caplog.at_level(logging.WARNING):
        assert store.handed() is None
    assert "not usable" in caplog.text
    store.settle([])
    for closed in (fd, image):
        with pytest.raises(OSError):
            os.fstat(closed)


@pytest.mark.parametrize("damage", ["another file", "another size", "not sealed", "missing"])
def test_a_region_that_is_not_the_one_the_image_describes_is_left_out(
    manager: ServiceManager, caplog: pytest.LogCaptureFixture, damage: str
) -> None:
    good, other = region_memfd(), region_memfd(seals=0)
    data = image_for({1: good, 2: other})
    image = os.memfd_create("image", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.write(image, data)
    fcntl.fcntl(image, fcntl.F_ADD_SEALS, SEALS | fcntl.F_SEAL_WRITE)
    passed = {region_name(1): good, IMAGE_NAME: image}
    if damage == "another file":
        passed[region_name(2)] = region_memfd()
        os.close(other)
    elif damage == "another size":
        os.close(other)
        passed[region_name(2)] = region_memfd(size=2 * SIZE)
    elif damage == "not sealed":
        passed[region_name(2)] = other
    else:
        os.close(other)
    store = FdStore(passed, manager.environment())
    with caplog.at_level(logging.WARNING):
        handed = store.handed()
    assert handed is not None
    assert list(handed.regions) == [("t1", SIZE)]
    assert "region 2 (t2)" in caplog.text
    store.settle([])
