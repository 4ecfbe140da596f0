"""Attacks on DRAM kept across restarts (systemd's file-descriptor store, commits 1ade781 and
d28bc1e): a forged or damaged image, descriptors that are not what their names say, names given
twice, too many descriptors, a service manager that never answers, tenants' regions swapped.

The image and the store are the daemon's and systemd's only, but what they hand back is treated
as untrusted input anyway: whatever it holds, the daemon starts, serves every block byte-exact
(from DRAM or NVMe), never hands one tenant's region to another, and leaks no descriptor. Eleven
of these attacks succeeded when they were written (a swapped or duplicated region label, a block
over another key's bytes, an oversized slot, a region that cannot be mapped writable, a name
stored twice, a manager that stops reading, a huge image, a refused region held beside the new
one, a forged sequence number, an error exit that kept its DRAM); each asserts the mended
behaviour.
"""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import anyio
import msgspec
import pytest

from kvtierd.client import connect
from kvtierd.server.fdstore import IMAGE_NAME, IMAGE_SEALS, region_name
from kvtierd.store.kept import REGION_SEALS, DramImage, KeptBlock, decode_image, encode_image
from kvtierd.testing import DaemonProcess, ServiceManager
from tests.support.configs import config_text, tenant_table
from tests.support.kept_dram import BLOCK, pattern, put_blocks
from tests.support.kept_dram import read_blocks as _read
from tests.support.kept_dram import tiers_of as _tiers

pytestmark = pytest.mark.timeout(240)

COUNT = 8
TENANTS = [tenant_table("alpha", uids=(2001,)), tenant_table("beta", uids=(2002,))]
TWO_TENANTS = config_text(*TENANTS, dram={"size": "96M"})


def _put(daemon: DaemonProcess, name: str = "kept", tenant: str = "default") -> list[bytes]:
    return put_blocks(daemon, COUNT, name, tenant)


@pytest.fixture
def manager(tmp_path: Path) -> Iterator[ServiceManager]:
    with ServiceManager(tmp_path) as manager:
        yield manager


# -- the harness's store, tampered with ---------------------------------------------------------


def _sealed(data: bytes, seals: int = IMAGE_SEALS, name: str = "forged") -> int:
    fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    if data:
        os.write(fd, data)
    if seals:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
    return fd


def _replace(manager: ServiceManager, name: str, fd: int) -> None:
    """The store's descriptor under ``name`` becomes ``fd`` (the old one is closed)."""
    with manager._lock:
        stored = manager._stored
        index = next(i for i, (n, _) in enumerate(stored) if n == name)
        os.close(stored[index][1])
        stored[index] = (name, fd)


def _add(manager: ServiceManager, name: str, fd: int) -> None:
    with manager._lock:
        manager._stored.append((name, fd))


def _image(manager: ServiceManager) -> DramImage:
    fd = dict(manager.stored())[IMAGE_NAME]
    return decode_image(os.pread(fd, os.fstat(fd).st_size, 0))


def _forge(manager: ServiceManager, image: DramImage | bytes) -> None:
    data = image if isinstance(image, bytes) else encode_image(image)
    _replace(manager, IMAGE_NAME, _sealed(data))


# -- the daemon, as its clients see it ----------------------------------------------------------


def _region_of(daemon: DaemonProcess, tenant: str) -> tuple[int, bytes]:
    """The inode of ``tenant``'s region as its clients get it, and every byte in it."""
    with connect(daemon.socket) as client:
        arena = client.namespace(tenant, block_bytes=BLOCK, tenant=tenant).arena
        size = os.fstat(arena.fd).st_size
        with mmap.mmap(arena.fd, size, prot=mmap.PROT_READ) as memory:
            return os.fstat(arena.fd).st_ino, bytes(memory)


def _descriptors(daemon: DaemonProcess) -> list[str]:
    assert daemon.process is not None
    directory = Path(f"/proc/{daemon.process.pid}/fd")
    out = []
    for entry in directory.iterdir():
        with contextlib.suppress(OSError):
            out.append(os.readlink(entry))
    return sorted(out)


def _memfds(daemon: DaemonProcess) -> list[str]:
    return [link for link in _descriptors(daemon) if link.startswith("/memfd:")]


def _stopped_with_blocks(
    directory: Path, manager: ServiceManager, **options: object
) -> tuple[DaemonProcess, list[bytes]]:
    daemon = DaemonProcess(directory, manager=manager, **options)  # type: ignore[arg-type]
    daemon.start()
    keys = _put(daemon)
    assert daemon.stop() == 0
    assert sorted(manager.names()) == sorted([region_name(1), IMAGE_NAME])
    return daemon, keys


def _served_right(daemon: DaemonProcess, keys: list[bytes]) -> list[str | None]:
    """The tiers that hold the blocks (before anything promotes them); every block byte-exact,
    wherever it comes from; nothing left in the store."""
    tiers = _tiers(daemon, keys)
    assert _read(daemon, keys) == [pattern(b"kept", k) for k in keys]
    assert manager_empty(daemon)
    return tiers


def manager_empty(daemon: DaemonProcess) -> bool:
    assert daemon.manager is not None
    return daemon.manager.names() == []


@contextlib.contextmanager
def _running(daemon: DaemonProcess) -> Iterator[DaemonProcess]:
    try:
        daemon.start()
        yield daemon
    finally:
        daemon.kill()


# -- 1. images that are no image ------------------------------------------------------------------


def _huge_array_header(image: DramImage) -> bytes:
    """A map whose ``blocks`` array claims 2**32 - 1 elements and holds none."""
    head = msgspec.msgpack.encode(
        {"version": 1, "written_at": 0.0, "pid": 1, "regions": [], "blocks": []}
    )
    assert head.endswith(b"\x90")
    return head[:-1] + b"\xdd\xff\xff\xff\xff"


def _pipe_holding(data: bytes) -> int:
    read, write = os.pipe2(os.O_CLOEXEC)
    os.write(write, data[:4096])
    os.close(write)
    return read


def _socket_fd() -> int:
    one, other = socket.socketpair()
    other.close()
    return one.detach()


def _sparse_memfd(size: int, seals: int) -> int:
    fd = os.memfd_create("forged", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, size)
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
    return fd


def _regular_file(path: Path, data: bytes) -> int:
    path.write_bytes(data)
    return os.open(path, os.O_RDONLY | os.O_CLOEXEC)


_IMAGES: dict[str, Callable[[DramImage, Path], int]] = {
    "not msgpack": lambda image, tmp: _sealed(b"\xc1" * 64),
    "empty": lambda image, tmp: _sealed(b""),
    "truncated": lambda image, tmp: _sealed(encode_image(image)[:-7]),
    "version 2": lambda image, tmp: _sealed(
        encode_image(msgspec.structs.replace(image, version=2))
    ),
    "a 2**32 block count": lambda image, tmp: _sealed(_huge_array_header(image)),
    "a region of the wrong type": lambda image, tmp: _sealed(
        msgspec.msgpack.encode(
            {"version": 1, "written_at": 0, "pid": 1, "regions": [[1, 7, 7, 7]], "blocks": []}
        )
    ),
    "unsealed": lambda image, tmp: _sealed(encode_image(image), seals=0),
    "sealed but writable": lambda image, tmp: _sealed(encode_image(image), seals=REGION_SEALS),
    "a pipe": lambda image, tmp: _pipe_holding(encode_image(image)),
    "a socket": lambda image, tmp: _socket_fd(),
    "a regular file": lambda image, tmp: _regular_file(tmp / "image", encode_image(image)),
    "a directory": lambda image, tmp: os.open(tmp, os.O_RDONLY | os.O_DIRECTORY),
    "over 1 GiB": lambda image, tmp: _sparse_memfd((1 << 30) + 1, IMAGE_SEALS),
}


@pytest.mark.parametrize("kind", list(_IMAGES))
def test_an_unusable_image_starts_empty_and_serves_nvme(
    tmp_path: Path, manager: ServiceManager, kind: str
) -> None:
    daemon, keys = _stopped_with_blocks(tmp_path / "d", manager)
    _replace(manager, IMAGE_NAME, _IMAGES[kind](_image(manager), tmp_path))
    with _running(daemon):
        assert _served_right(daemon, keys) == ["nvme"] * COUNT
        assert _memfds(daemon) == ["/memfd:kvtierd-default (deleted)"]
        assert daemon.stop() == 0
    assert "Traceback" not in daemon.log()


# -- 2. an image whose blocks lie ---------------------------------------------------------------


def _blocks(image: DramImage, change: Callable[[list[KeptBlock]], list[KeptBlock]]) -> DramImage:
    return msgspec.structs.replace(image, blocks=change(list(image.blocks)))


def _at(index: int, **fields: object) -> Callable[[list[KeptBlock]], list[KeptBlock]]:
    def change(blocks: list[KeptBlock]) -> list[KeptBlock]:
        blocks[index] = msgspec.structs.replace(blocks[index], **fields)
        return blocks

    return change


def _onto_first(blocks: list[KeptBlock]) -> list[KeptBlock]:
    """Block 1 placed on block 0's bytes, with block 0's checksum: two blocks in one slot."""
    first = blocks[0]
    blocks[1] = msgspec.structs.replace(
        blocks[1], offset=first.offset, slot_bytes=first.slot_bytes, checksum=first.checksum
    )
    return blocks


def _other_seq_onto_first(blocks: list[KeptBlock]) -> list[KeptBlock]:
    """Block 0 dropped, block 1 (another sequence number) claiming its slot and checksum."""
    first = blocks.pop(0)
    blocks[0] = msgspec.structs.replace(
        blocks[0],
        offset=first.offset,
        slot_bytes=first.slot_bytes,
        checksum=first.checksum,
        seq=blocks[0].seq + 1000,
    )
    return blocks


_BLOCKS: dict[str, Callable[[list[KeptBlock]], list[KeptBlock]]] = {
    "a negative offset": _at(0, offset=-BLOCK),
    "an offset past the region": _at(0, offset=1 << 40),
    "an offset of 2**64 - 1": _at(0, offset=(1 << 64) - 1),
    "a negative slot": _at(0, slot_bytes=-BLOCK),
    "a misaligned offset": _at(0, offset=BLOCK + 512),
    "a slot of 0 bytes": _at(0, slot_bytes=0),
    "a slot smaller than the block": _at(0, slot_bytes=4096),
    "raw_bytes of another size": _at(0, raw_bytes=4096),
    "an unknown namespace": _at(0, ns_digest=b"\x00" * 16),
    "an unknown region": _at(0, region=99),
    "a negative region": _at(0, region=-1),
    "two blocks in one slot": _onto_first,
    "another sequence in another's slot": _other_seq_onto_first,
    "every block twice": lambda blocks: blocks + blocks,
    # a renamed copy of block 0 with its sequence number: write-back knows blocks by it
    "two blocks of one sequence number": lambda blocks: [
        *blocks,
        msgspec.structs.replace(blocks[0], key=b"\x02" * 16),
    ],
    "one block 200000 times": lambda blocks: blocks[:1] * 200_000,
}


@pytest.mark.parametrize("kind", list(_BLOCKS))
def test_forged_blocks_never_serve_a_wrong_byte(
    tmp_path: Path, manager: ServiceManager, kind: str
) -> None:
    daemon, keys = _stopped_with_blocks(tmp_path / "d", manager)
    _forge(manager, _blocks(_image(manager), _BLOCKS[kind]))
    with _running(daemon):
        _served_right(daemon, keys)
        assert daemon.stop() == 0
    assert "Traceback" not in daemon.log()


def _same_seq_onto_first(blocks: list[KeptBlock]) -> list[KeptBlock]:
    """Block 0 dropped, block 1 (its own key and sequence number, as the NVMe tier has them)
    claiming block 0's slot and checksum."""
    first = blocks.pop(0)
    blocks[0] = msgspec.structs.replace(
        blocks[0], offset=first.offset, slot_bytes=first.slot_bytes, checksum=first.checksum
    )
    return blocks


def test_a_block_pointed_at_another_keys_bytes_is_not_served_them(
    tmp_path: Path, manager: ServiceManager
) -> None:
    daemon, keys = _stopped_with_blocks(tmp_path / "d", manager)
    _forge(manager, _blocks(_image(manager), _same_seq_onto_first))
    with _running(daemon):
        assert _tiers(daemon, keys)[:2] == ["nvme", "nvme"]
        _served_right(daemon, keys)


def test_a_slot_as_large_as_the_region_is_not_adopted(
    tmp_path: Path, manager: ServiceManager
) -> None:
    daemon, keys = _stopped_with_blocks(tmp_path / "d", manager)
    image = _image(manager)
    first = min(image.blocks, key=lambda b: b.offset)
    assert first.offset == 0
    change = _at(image.blocks.index(first), slot_bytes=64 << 20)
    _forge(manager, _blocks(image, change))
    with _running(daemon):
        _served_right(daemon, keys)


# -- 3. tenants -----------------------------------------------------------------------------------


def _two_tenants_stopped(
    directory: Path, manager: ServiceManager
) -> tuple[DaemonProcess, dict[str, list[bytes]], dict[str, int]]:
    """alpha's and beta's blocks kept (two regions of one size); the inode of each region."""
    daemon = DaemonProcess(directory, dram_size=None, config_text=TWO_TENANTS, manager=manager)
    daemon.start()
    keys = {t: _put(daemon, t, tenant=t) for t in ("alpha", "beta")}
    inodes = {t: _region_of(daemon, t)[0] for t in ("alpha", "beta")}
    assert daemon.stop() == 0
    return daemon, keys, inodes


def _tenant_bytes_right(daemon: DaemonProcess, keys: dict[str, list[bytes]]) -> None:
    for t, mine in keys.items():
        assert _read(daemon, mine, t, tenant=t) == [pattern(t.encode(), k) for k in mine]


def _holds_pattern(memory: bytes, tag: bytes, keys: list[bytes]) -> bool:
    return any(pattern(tag, k)[:4096] in memory for k in keys)


def _beta_holds_nothing_of_alpha(
    daemon: DaemonProcess, keys: dict[str, list[bytes]], inodes: dict[str, int]
) -> None:
    """beta's clients map another memory file than alpha's, with none of alpha's bytes in it,
    and each tenant reads its own blocks right."""
    inode, memory = _region_of(daemon, "beta")
    assert not _holds_pattern(memory, b"alpha", keys["alpha"])
    assert inode != inodes["alpha"]
    _tenant_bytes_right(daemon, keys)


def test_an_image_that_swaps_tenant_labels_never_hands_a_region_to_the_other_tenant(
    tmp_path: Path, manager: ServiceManager
) -> None:
    daemon, keys, inodes = _two_tenants_stopped(tmp_path / "d", manager)
    image = _image(manager)
    swap = {"alpha": "beta", "beta": "alpha"}
    regions = [msgspec.structs.replace(r, tenant=swap[r.tenant]) for r in image.regions]
    _forge(manager, msgspec.structs.replace(image, regions=regions))
    with _running(daemon):
        _beta_holds_nothing_of_alpha(daemon, keys, inodes)


def test_one_region_claimed_for_two_tenants_is_given_to_neither_twice(
    tmp_path: Path, manager: ServiceManager
) -> None:
    daemon, keys, inodes = _two_tenants_stopped(tmp_path / "d", manager)
    image = _image(manager)
    alpha = next(r for r in image.regions if r.tenant == "alpha")
    regions = [alpha, msgspec.structs.replace(alpha, tenant="beta")]
    _forge(manager, msgspec.structs.replace(image, regions=regions))
    with _running(daemon):
        _beta_holds_nothing_of_alpha(daemon, keys, inodes)
        assert daemon.stop() == 0
    assert "Traceback" not in daemon.log()


def test_blocks_pointed_into_the_other_tenants_region_are_refused(
    tmp_path: Path, manager: ServiceManager
) -> None:
    """alpha's blocks said to lie in beta's region, and beta's namespace said to own alpha's
    bytes (their offsets and checksums): none of them is adopted, each tenant reads its own."""
    daemon, keys, _ = _two_tenants_stopped(tmp_path / "d", manager)
    image = _image(manager)
    ids = {r.tenant: r.id for r in image.regions}
    beta_ns = next(b.ns_digest for b in image.blocks if b.region == ids["beta"])
    alpha_blocks = [b for b in image.blocks if b.region == ids["alpha"]]
    forged = [msgspec.structs.replace(b, region=ids["beta"]) for b in alpha_blocks] + [
        msgspec.structs.replace(b, ns_digest=beta_ns) for b in alpha_blocks
    ]
    _forge(manager, msgspec.structs.replace(image, blocks=forged))
    with _running(daemon):
        for t in ("alpha", "beta"):
            assert _tiers(daemon, keys[t], t, tenant=t) == ["nvme"] * COUNT
        _tenant_bytes_right(daemon, keys)
        assert "none of its 16 blocks taken" in daemon.log()


# -- 4. region descriptors that are not the region ----------------------------------------------


def _reopened_read_only(fd: int, image: DramImage) -> tuple[int, DramImage]:
    """The very memory file, opened again read-only (same inode, size and seals)."""
    return os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | os.O_CLOEXEC), image


def _write_sealed(fd: int, image: DramImage, seals: int) -> tuple[int, DramImage]:
    """A memory file of the region's size sealed against writing, the image describing it."""
    size = os.fstat(fd).st_size
    forged = _sparse_memfd(size, REGION_SEALS | seals)
    info = os.fstat(forged)
    regions = [msgspec.structs.replace(image.regions[0], inode=info.st_ino, device=info.st_dev)]
    return forged, msgspec.structs.replace(image, regions=regions)


_F_SEAL_FUTURE_WRITE = 0x0010

_REGIONS: dict[str, Callable[[int, DramImage], tuple[int, DramImage]]] = {
    "a pipe": lambda fd, image: (_pipe_holding(b"x"), image),
    "a socket": lambda fd, image: (_socket_fd(), image),
    "another memory file of its size": lambda fd, image: (
        _sparse_memfd(os.fstat(fd).st_size, REGION_SEALS),
        image,
    ),
    "the image's memory file": lambda fd, image: (_sealed(encode_image(image)), image),
}
_CRASHING: dict[str, Callable[[int, DramImage], tuple[int, DramImage]]] = {
    "the region reopened read-only": _reopened_read_only,
    "a write-sealed memory file the image describes": lambda fd, image: _write_sealed(
        fd, image, fcntl.F_SEAL_WRITE
    ),
    "a future-write-sealed memory file the image describes": lambda fd, image: _write_sealed(
        fd, image, _F_SEAL_FUTURE_WRITE
    ),
}


def _region_case(
    tmp_path: Path, manager: ServiceManager, make: Callable[[int, DramImage], tuple[int, DramImage]]
) -> None:
    daemon, keys = _stopped_with_blocks(tmp_path / "d", manager)
    fd, image = make(dict(manager.stored())[region_name(1)], _image(manager))
    _replace(manager, region_name(1), fd)
    _forge(manager, image)
    with _running(daemon):
        assert _served_right(daemon, keys) == ["nvme"] * COUNT
        assert _memfds(daemon) == ["/memfd:kvtierd-default (deleted)"]
        assert daemon.stop() == 0
    assert "Traceback" not in daemon.log()


@pytest.mark.parametrize("kind", list(_REGIONS))
def test_a_region_descriptor_that_is_not_the_region_is_not_mapped(
    tmp_path: Path, manager: ServiceManager, kind: str
) -> None:
    _region_case(tmp_path, manager, _REGIONS[kind])


@pytest.mark.parametrize("kind", list(_CRASHING))
def test_a_region_that_cannot_be_mapped_writable_is_not_taken(
    tmp_path: Path, manager: ServiceManager, kind: str
) -> None:
    _region_case(tmp_path, manager, _CRASHING[kind])


# -- 5. the store: names twice, names unknown, too many ----------------------------------------


@pytest.mark.parametrize("name", [IMAGE_NAME, region_name(1)])
def test_a_name_stored_twice_does_not_stop_the_daemon_from_starting(
    tmp_path: Path, manager: ServiceManager, name: str
) -> None:
    daemon, keys = _stopped_with_blocks(tmp_path / "d", manager)
    _add(manager, name, os.dup(dict(manager.stored())[name]))
    with _running(daemon):
        _served_right(daemon, keys)


def test_unknown_kvtierd_names_are_closed_and_removed(
    tmp_path: Path, manager: ServiceManager
) -> None:
    daemon, keys = _stopped_with_blocks(tmp_path / "d", manager)
    pipe = _pipe_holding(b"x")
    pipe_link = os.readlink(f"/proc/self/fd/{pipe}")
    sock = _socket_fd()
    sock_link = os.readlink(f"/proc/self/fd/{sock}")
    _add(manager, "kvtierd-dram-region-7", pipe)
    _add(manager, "kvtierd-dram-region-1234", sock)
    _add(manager, "kvtierd-dram-", _sealed(b"junk"))
    with _running(daemon):
        assert _served_right(daemon, keys) == ["dram"] * COUNT
        links = _descriptors(daemon)
        assert pipe_link not in links
        assert sock_link not in links
        assert _memfds(daemon) == ["/memfd:kvtierd-default (deleted)"]


def test_too_many_descriptors_are_refused_with_a_message(tmp_path: Path) -> None:
    """More than MAX_PASSED: the start refuses them in words (systemd's store holds at most
    FileDescriptorStoreMax=, which the unit sets far below)."""
    with ServiceManager(tmp_path, fdstore_max=200) as manager:
        daemon, _ = _stopped_with_blocks(tmp_path / "d", manager)
        for n in range(90):
            _add(manager, f"kvtierd-dram-junk-{n}", _sealed(b""))
        with pytest.raises(RuntimeError, match="exited with 2"):
            daemon.start()
        daemon.kill()
        assert "refuses more than" in daemon.log()
        assert "Traceback" not in daemon.log()


def test_names_that_do_not_match_the_count_are_refused_with_a_message(
    tmp_path: Path, manager: ServiceManager
) -> None:
    """LISTEN_FDNAMES naming one descriptor of two: the names are not used, nothing is taken
    as DRAM, and the start says why it refuses the descriptors."""
    daemon, _ = _stopped_with_blocks(tmp_path / "d", manager)
    daemon.command_prefix = ["env", f"LISTEN_FDNAMES={IMAGE_NAME}"]
    with pytest.raises(RuntimeError, match="exited with 2"):
        daemon.start()
    daemon.kill()
    assert "not a socket" in daemon.log()
    assert "Traceback" not in daemon.log()


# -- 6. a service manager that does not answer --------------------------------------------------


class _NoBarrier(ServiceManager):
    """Takes the descriptors in, but never closes a barrier's (an old or stuck systemd)."""

    def __init__(self, directory: Path) -> None:
        self.held: list[int] = []
        super().__init__(directory)

    def _handle(self, text: str, fds: list[int]) -> None:
        if "BARRIER=1" in text.split("\n"):
            self.held += fds
            return
        super()._handle(text, fds)

    def close(self) -> None:
        for fd in self.held:
            os.close(fd)
        super().close()


class _Deaf(ServiceManager):
    """Reads a message only when given a permit once ``deafen`` was called (PID 1 busy):
    ``deafen`` leaves its queue one datagram short of full, room for ``STOPPING=1``."""

    def __init__(self, directory: Path) -> None:
        self.permits = threading.Semaphore(0)
        self.deaf = False
        super().__init__(directory)

    def deafen(self) -> None:
        self.deaf = True
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sender:
            sender.connect(str(self.path))
            sender.send(b"STATUS=first")  # the reader takes it and waits
            time.sleep(0.5)
            with contextlib.suppress(BlockingIOError):
                for _ in range(10_000):
                    sender.send(b"STATUS=filler", socket.MSG_DONTWAIT)
        self.permits.release()  # one more read: one datagram of room
        time.sleep(0.5)

    def _handle(self, text: str, fds: list[int]) -> None:
        if self.deaf:
            self.permits.acquire()
        super()._handle(text, fds)

    def close(self) -> None:
        self.deaf = False
        for _ in range(100_000):
            self.permits.release()
        super().close()


def test_a_barrier_never_answered_does_not_hold_the_stop(tmp_path: Path) -> None:
    with _NoBarrier(tmp_path) as manager:
        daemon, keys = _stopped_with_blocks(tmp_path / "d", manager)
        assert "systemd did not confirm it took the DRAM" in daemon.log()
        with _running(daemon):
            _served_right(daemon, keys)
            assert daemon.stop(timeout_s=20) == 0  # held by the barrier: TimeoutExpired


def test_a_service_manager_that_stops_reading_does_not_hold_the_stop(tmp_path: Path) -> None:
    with _Deaf(tmp_path) as manager:
        daemon = DaemonProcess(tmp_path / "d", manager=manager)
        with _running(daemon):
            _put(daemon)
            manager.deafen()
            # BARRIER_TIMEOUT_S is 5: a stop held by the deaf manager raises TimeoutExpired
            assert daemon.stop(timeout_s=12) == 0


# -- 7. an image of many blocks, and memory ------------------------------------------------------


def _peak_rss(daemon: DaemonProcess) -> int:
    assert daemon.process is not None
    for line in Path(f"/proc/{daemon.process.pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) << 10
    raise AssertionError("no VmHWM")


def test_an_image_of_more_blocks_than_the_dram_holds_is_refused_unread(
    tmp_path: Path, manager: ServiceManager
) -> None:
    daemon, keys = _stopped_with_blocks(tmp_path / "d", manager)
    with _running(daemon):  # what a start costs with an image of its own 8 blocks
        plain = _peak_rss(daemon)
        daemon.stop()
    image = _image(manager)
    blocks = [KeptBlock(1, 0, 4096, b"", b"", 0, 0, 0, False)] * 4_000_000
    data = encode_image(msgspec.structs.replace(image, blocks=blocks))
    _forge(manager, data)
    with _running(daemon):
        assert _served_right(daemon, keys) == ["nvme"] * COUNT
        assert _peak_rss(daemon) - plain < 3 * len(data)


# -- 8. a region of another kind ------------------------------------------------------------------


class _Keeper:
    def __init__(self, handed: object) -> None:
        self._handed = handed
        self.settled: list[int] = []

    def handed(self, limit: int = 0) -> object:
        return self._handed

    def settle(self, taken: object) -> None:
        self.settled = list(taken)  # type: ignore[call-overload]

    def keep(self, regions: object, image: bytes) -> bool:
        return False


def test_a_region_the_arena_will_refuse_is_closed_before_the_arena_is_made(
    tmp_path: Path,
) -> None:
    from kvtierd.config import load_config
    from kvtierd.store.kept import Handed, HandedRegion, KeptRegion
    from kvtierd.store.lifecycle import _take_handed

    path = tmp_path / "kvtierd.toml"
    path.write_text(TWO_TENANTS)
    config = load_config(path)
    (tenant, size), _ = config.dram_regions()
    fd = _sparse_memfd(size, REGION_SEALS)
    info = os.fstat(fd)
    kept = KeptRegion(1, tenant, size, True, info.st_ino, info.st_dev)  # hugetlb, it says
    image = DramImage(1, 0.0, 1, [kept], [])
    keeper = _Keeper(Handed(image, {(tenant, size): HandedRegion(fd, kept)}))
    handed = anyio.run(_take_handed, config, keeper)
    try:
        assert handed is not None
        assert handed.regions == {}
        assert fd not in keeper.settled  # given back to the keeper to close, before the arena
    finally:
        with contextlib.suppress(OSError):
            os.close(fd)


# -- 9. sequence numbers ------------------------------------------------------------------------


def _renamed_with_seq(seq: int) -> Callable[[list[KeptBlock]], list[KeptBlock]]:
    """Block 0 under a key nobody committed (so the NVMe index cannot contradict it), with
    ``seq``: its bytes still hash to its checksum, so it is adopted."""

    def change(blocks: list[KeptBlock]) -> list[KeptBlock]:
        blocks[0] = msgspec.structs.replace(blocks[0], key=b"\x01" * 16, seq=seq)
        return blocks

    return change


@pytest.mark.parametrize("seq", [(1 << 64) - 1, -1], ids=["2**64 - 1", "-1"])
def test_a_forged_sequence_number_does_not_break_later_writes(
    tmp_path: Path, manager: ServiceManager, seq: int
) -> None:
    daemon, keys = _stopped_with_blocks(tmp_path / "d", manager)
    _forge(manager, _blocks(_image(manager), _renamed_with_seq(seq)))
    with _running(daemon):
        _read(daemon, keys[1:])
        more = _put(daemon, "more")
        assert _read(daemon, more, "more") == [pattern(b"more", k) for k in more]
        assert daemon.stop() == 0
    assert "Traceback" not in daemon.log()


class _Recording(_Keeper):
    def __init__(self) -> None:
        super().__init__(None)
        self.kept: list[bytes] = []

    def keep(self, regions: object, image: bytes) -> bool:
        self.kept.append(image)
        return True


@pytest.mark.parametrize("runtime", ["asyncio", "trio"])
def test_a_store_that_closes_on_an_error_keeps_no_dram(tmp_path: Path, runtime: str) -> None:
    """Only a clean close hands the DRAM on: a daemon that dies of an error (perhaps of what
    it was handed) must not hand the same to its successor, or every restart dies again."""
    from kvtierd.config import load_config
    from kvtierd.store.lifecycle import open_store, open_store_base

    config = load_config(
        None,
        {
            "daemon": {"data_dir": str(tmp_path)},
            "dram": {"size": "16M", "mlock": "never", "hugepages": "never"},
            "nvme": {"size": "64M", "segment_bytes": "4M"},
        },
    )

    async def close(failing: bool) -> list[bytes]:
        keeper = _Recording()
        try:
            async with (
                open_store_base(config, keeper=keeper) as base,  # type: ignore[arg-type]
                open_store(config, base=base),
            ):
                if failing:
                    raise RuntimeError("the daemon dies of an error")
        except* RuntimeError:  # (in the groups of the store's task groups)
            assert failing
        return keeper.kept

    assert anyio.run(close, True, backend=runtime) == []
    assert len(anyio.run(close, False, backend=runtime)) == 1
