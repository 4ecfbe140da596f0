"""Attacks on DRAM kept across restarts (systemd's file-descriptor store, commits 1ade781 and
d28bc1e): a forged or damaged image, descriptors that are not what their names say, names given
twice, too many descriptors, a service manager that never answers, tenants' regions swapped.

The image and the store are the daemon's and systemd's only, but what they hand back is treated
as untrusted input anyway: whatever it holds, the daemon starts, serves every block byte-exact
(from DRAM or NVMe), never hands one tenant's region to another, and leaks no descriptor. A test
marked ``xfail(strict=True)`` is a finding: it asserts the safe behaviour, which does not hold
yet (its reason says what happens instead).
"""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import msgspec
import pytest

from kvtierd.client import connect
from kvtierd.keys import chain_keys
from kvtierd.server.fdstore import IMAGE_NAME, region_name
from kvtierd.store.kept import DramImage, KeptBlock, decode_image, encode_image
from kvtierd.testing import DaemonProcess, ServiceManager
from tests.support.configs import config_text, tenant_table

pytestmark = pytest.mark.timeout(240)

BLOCK = 64 << 10
COUNT = 8
_IMAGE_SEALS = fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
_REGION_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
TENANTS = [tenant_table("alpha", uids=(2001,)), tenant_table("beta", uids=(2002,))]
TWO_TENANTS = config_text(*TENANTS, dram={"size": "96M"})


def pattern(tag: bytes, key: bytes) -> bytes:
    unit = tag + key
    return (unit * (BLOCK // len(unit) + 1))[:BLOCK]


@pytest.fixture
def manager(tmp_path: Path) -> Iterator[ServiceManager]:
    with ServiceManager(tmp_path) as manager:
        yield manager


# -- the harness's store, tampered with ---------------------------------------------------------


def _sealed(data: bytes, seals: int = _IMAGE_SEALS, name: str = "forged") -> int:
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


def _put(daemon: DaemonProcess, name: str = "kept", tenant: str = "default") -> list[bytes]:
    with connect(daemon.socket) as client:
        ns = client.namespace(name, block_bytes=BLOCK, tenant=tenant)
        keys = chain_keys(range(16 * COUNT), 16, ns.key_salt)
        assert ns.put(keys, [pattern(name.encode(), k) for k in keys]) == COUNT
        client.fsync()
    return keys


def _tiers(daemon: DaemonProcess, keys: list[bytes], name: str = "kept",
           tenant: str = "default") -> list[str | None]:  # fmt: skip
    with connect(daemon.socket) as client:
        ns = client.namespace(name, block_bytes=BLOCK, tenant=tenant)
        return ns.lookup_each(keys, promote=False)


def _read(daemon: DaemonProcess, keys: list[bytes], name: str = "kept",
          tenant: str = "default") -> list[bytes]:  # fmt: skip
    with connect(daemon.socket) as client:
        ns = client.namespace(name, block_bytes=BLOCK, tenant=tenant)
        with ns.get(keys) as views:
            return [bytes(view) for view in views]


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
    assert manager.names() == [region_name(1), IMAGE_NAME]
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
    "sealed but writable": lambda image, tmp: _sealed(encode_image(image), seals=_REGION_SEALS),
    "a pipe": lambda image, tmp: _pipe_holding(encode_image(image)),
    "a socket": lambda image, tmp: _socket_fd(),
    "a regular file": lambda image, tmp: _regular_file(tmp / "image", encode_image(image)),
    "a directory": lambda image, tmp: os.open(tmp, os.O_RDONLY | os.O_DIRECTORY),
    "over 1 GiB": lambda image, tmp: _sparse_memfd((1 << 30) + 1, _IMAGE_SEALS),
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
    "a slot as large as the region": _at(0, slot_bytes=64 << 20),
    "raw_bytes of another size": _at(0, raw_bytes=4096),
    "an unknown namespace": _at(0, ns_digest=b"\x00" * 16),
    "an unknown region": _at(0, region=99),
    "a negative region": _at(0, region=-1),
    "two blocks in one slot": _onto_first,
    "another sequence in another's slot": _other_seq_onto_first,
    "every block twice": lambda blocks: blocks + blocks,
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
