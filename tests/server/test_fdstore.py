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
from kvtierd.server.fdstore import IMAGE_NAME, IMAGE_SEALS, FdStore, region_name
from kvtierd.store.kept import (
    IMAGE_VERSION,
    REGION_SEALS,
    DramImage,
    KeptRegion,
    encode_image,
    region_file_name,
)
from kvtierd.testing import ServiceManager

SIZE = 2 << 20


def region_memfd(tenant: str, size: int = SIZE, seals: int = REGION_SEALS) -> int:
    """A region's memory file as the arena makes it for ``tenant``."""
    fd = os.memfd_create(region_file_name(tenant), os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, size)
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
    return fd


def image_file(data: bytes, *, sealed: bool = True) -> int:
    """A memory file holding ``data``, sealed as a stopping daemon seals its image."""
    fd = os.memfd_create("image", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.write(fd, data)
    if sealed:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, IMAGE_SEALS)
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


def _passed(manager: ServiceManager) -> dict[str, list[int]]:
    """What the next start would be handed: a duplicate of each stored descriptor (the process
    owns what it is passed)."""
    out: dict[str, list[int]] = {}
    for name, fd in manager.stored():
        out.setdefault(name, []).append(os.dup(fd))
    return out


def test_a_stop_hands_every_region_then_the_image_and_a_start_takes_them_back(
    manager: ServiceManager,
) -> None:
    regions = {1: region_memfd("t1"), 2: region_memfd("t2")}
    try:
        assert FdStore({}, manager.environment()).keep(list(regions.items()), image_for(regions))
        assert sorted(manager.names()) == sorted([region_name(1), region_name(2), IMAGE_NAME])
        assert manager.messages[-1] == "BARRIER=1"
        store = FdStore(_passed(manager), manager.environment())
        sent = len(manager.messages)
        handed = store.handed()
        assert handed is not None
        # removed before anything was read, every one: a crash now is handed nothing
        assert manager.names_after(sent + 3) == []
        assert {shape: r.kept.id for shape, r in handed.regions.items()} == {
            ("t1", SIZE): 1,
            ("t2", SIZE): 2,
        }
        kept = [r.fd for r in handed.regions.values()][:1]
        store.settle(kept)
        os.fstat(kept[0])  # the caller's now
        closed = [r.fd for r in handed.regions.values()][1]
        with pytest.raises(OSError):
            os.fstat(closed)
        os.close(kept[0])
    finally:
        for fd in regions.values():
            os.close(fd)


def test_without_a_notify_socket_or_when_off_nothing_is_kept(manager: ServiceManager) -> None:
    fd = region_memfd("t1")
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
    fd = region_memfd("t1")
    with ServiceManager(tmp_path, fdstore_max=1) as manager:
        try:
            assert not FdStore({}, manager.environment()).keep([(1, fd)], image_for({1: fd}))
        finally:
            os.close(fd)
        assert manager.messages == []
    assert "FileDescriptorStoreMax= allows 1" in caplog.text


@pytest.mark.timeout(60)  # a barrier that waited for the silent manager would hang here
def test_a_manager_that_never_confirms_does_not_hold_the_stop(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """systemd older than 246 ignores BARRIER=1 (and closes its descriptor); a manager that
    keeps it open forever costs the stop at most the barrier's timeout, and nothing counts as
    handed over."""
    monkeypatch.setattr(fdstore, "BARRIER_TIMEOUT_S", 0.3)
    path = tmp_path / "silent.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as silent:
        silent.bind(str(path))
        silent.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 20)
        fd = region_memfd("t1")
        try:
            kept = FdStore({}, {"NOTIFY_SOCKET": str(path)}).keep([(1, fd)], image_for({1: fd}))
            assert not kept
        finally:
            os.close(fd)


@pytest.mark.parametrize(
    "damage",
    ["not sealed", "not an image", "another version"],
)
def test_an_unusable_image_starts_empty(
    manager: ServiceManager, caplog: pytest.LogCaptureFixture, damage: str
) -> None:
    fd = region_memfd("t1")
    data = image_for({1: fd})
    if damage == "not an image":
        data = b"\x93not msgpack of an image"
    elif damage == "another version":
        data = image_for({1: fd}, version=IMAGE_VERSION + 1)
    image = image_file(data, sealed=damage != "not sealed")
    store = FdStore({region_name(1): [fd], IMAGE_NAME: [image]}, manager.environment())
    with caplog.at_level(logging.WARNING):
        assert store.handed() is None
    assert "not usable" in caplog.text
    store.settle([])
    for closed in (fd, image):
        with pytest.raises(OSError):
            os.fstat(closed)


@pytest.mark.parametrize(
    "damage",
    ["another file", "another size", "not sealed", "another tenant's", "read-only", "missing"],
)
def test_a_region_that_is_not_the_one_the_image_describes_is_left_out(
    manager: ServiceManager, caplog: pytest.LogCaptureFixture, damage: str
) -> None:
    """Region 2 as the image describes it, and what is handed under its name instead."""
    good = region_memfd("t1")
    described = {
        "not sealed": lambda: region_memfd("t2", seals=0),
        "another tenant's": lambda: region_memfd("t1"),  # its name says whose it is
    }.get(damage, lambda: region_memfd("t2"))()
    data = image_for({1: good, 2: described})
    handed_instead = {
        "another file": lambda: region_memfd("t2"),
        "another size": lambda: region_memfd("t2", size=2 * SIZE),
        "read-only": lambda: os.open(f"/proc/self/fd/{described}", os.O_RDONLY),
        "missing": lambda: None,
    }.get(damage, lambda: os.dup(described))()
    os.close(described)
    image = image_file(data)
    passed = {region_name(1): [good], IMAGE_NAME: [image]}
    if handed_instead is not None:
        passed[region_name(2)] = [handed_instead]
    store = FdStore(passed, manager.environment())
    with caplog.at_level(logging.WARNING):
        handed = store.handed()
    assert handed is not None
    assert list(handed.regions) == [("t1", SIZE)]
    assert "region 2 (t2)" in caplog.text
    store.settle([])


def test_a_name_handed_twice_is_trusted_for_neither(
    manager: ServiceManager, caplog: pytest.LogCaptureFixture
) -> None:
    good = region_memfd("t1")
    image = image_file(image_for({1: good}))
    store = FdStore(
        {region_name(1): [good, os.dup(good)], IMAGE_NAME: [image]}, manager.environment()
    )
    handed = store.handed()
    assert handed is not None
    assert handed.regions == {}
    assert f"more than one descriptor named {region_name(1)}" in caplog.text
    store.settle([])


def test_a_start_that_systemd_does_not_confirm_let_go_uses_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A removal nobody confirmed may have been lost: what this start then changed could be
    handed to the next after a crash. So nothing handed is used, and everything is closed."""
    monkeypatch.setattr(fdstore, "BARRIER_TIMEOUT_S", 0.3)
    good = region_memfd("t1")
    image = image_file(image_for({1: good}))
    path = tmp_path / "silent.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as silent:  # reads nothing, ever
        silent.bind(str(path))
        for environ in ({"NOTIFY_SOCKET": str(path)}, {}):
            store = FdStore({region_name(1): [os.dup(good)], IMAGE_NAME: [os.dup(image)]}, environ)
            assert store.handed() is None
            store.settle([])
    assert caplog.text.count("did not confirm it let go") == 2
    os.close(good)
    os.close(image)
