"""DRAM kept across a restart: what a stopping daemon leaves of its arena, and how the next one
takes it back, verified.

Theory of operation. A tenant region is a sealed memory file (:mod:`kvtierd.store.arena`), so
its pages outlive the process that made them for as long as someone holds the descriptor. On
the way out, once write-back has drained and nothing changes the index any more, the store
describes what its regions hold in a :class:`DramImage`: each region (tenant, size, and the
memory file's inode, which binds the image to those exact files) and each committed block in
DRAM (namespace, key, checksum, sequence number, place in its region). Someone else keeps the
descriptors and the image while no daemon runs: under systemd, its file-descriptor store
(:mod:`kvtierd.server.fdstore`, behind the :class:`DramKeeper` port).

The next start is handed them back. A region is taken again only for the same tenant at the
same size (a tenant's bytes never become another's), then every block of the image is checked
before it is indexed: its namespace known and in that region, its slot inside the region and
apart from every other, and its bytes hashed against the checksum they were committed with.
The region is shared with its tenant's clients, who may have written into it while no daemon
ran: a block that fails is not adopted (its slot is free again, and an NVMe copy, if any,
serves it). What was adopted is then as if promoted: in DRAM, known to the DRAM policy, written
back first where it had not reached the disk.

Only a clean stop leaves an image: a start takes it and the descriptors out of the keeper
before it reads them (:meth:`DramKeeper.handed`), so after a crash nothing is handed back and
the DRAM starts empty, as before. The checks of a handed region look at its descriptor
(``fstat``, its seals, its name); the keeper does the rest of the I/O.
"""

from __future__ import annotations

import fcntl
import logging
import os
import stat
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import msgspec
import xxhash

from kvtierd.keys import MAX_KEY_BYTES
from kvtierd.store.records import checksum

__all__ = [
    "IMAGE_VERSION",
    "MAX_IMAGE_BYTES",
    "REGION_SEALS",
    "DramImage",
    "DramKeeper",
    "Handed",
    "HandedRegion",
    "KeptBlock",
    "KeptRegion",
    "decode_image",
    "encode_image",
    "match_regions",
    "verify_blocks",
]

log = logging.getLogger("kvtierd.store")

IMAGE_VERSION = 1
#: An image larger than this is refused unread: about 70 bytes a block, so 15 million blocks.
MAX_IMAGE_BYTES = 1 << 30
#: The seals every region carries (:mod:`kvtierd.store.arena`), and those it must not carry
#: (the daemon writes into it: ``F_SEAL_FUTURE_WRITE`` is 0x10).
REGION_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
_WRITE_SEALS = fcntl.F_SEAL_WRITE | 0x10
#: Bytes of an image per block at most (its fields as MessagePack, the longest key).
IMAGE_BYTES_PER_BLOCK = 96 + MAX_KEY_BYTES
#: A sequence number beyond this is not one a daemon gave (records store it as uint64, and
#: the daemon counts on from the largest it saw).
MAX_SEQ = (1 << 63) - 1
#: Hashing stops to report progress after this many bytes.
_VERIFY_CHUNK_BYTES = 1 << 30


class KeptRegion(msgspec.Struct, frozen=True, array_like=True):
    """One region as it was left: ``id`` as the stopping daemon numbered it; ``inode`` and
    ``device`` those of its memory file (``fstat``), which only that file has."""

    id: int
    tenant: str | None
    size_bytes: int
    hugepages: bool
    inode: int
    device: int
    #: How many restarts these bytes have lived through (for the logs).
    restarts: int = 0


class KeptBlock(msgspec.Struct, frozen=True, array_like=True):
    """One committed block in DRAM: ``slot_bytes`` at ``offset`` from the start of region
    ``region``; its first ``raw_bytes`` hash to ``checksum``."""

    region: int
    offset: int
    slot_bytes: int
    ns_digest: bytes
    key: bytes
    raw_bytes: int
    checksum: int
    seq: int
    compress: bool


class DramImage(msgspec.Struct, frozen=True):
    version: int
    written_at: float
    pid: int
    regions: list[KeptRegion]
    blocks: list[KeptBlock]


def encode_image(image: DramImage) -> bytes:
    return msgspec.msgpack.encode(image)


def image_bound(dram_bytes: int) -> int:
    """The most bytes an image of ``dram_bytes`` of regions can take (a block per 4 KiB):
    anything larger is not one, and is refused before it is read."""
    return min(MAX_IMAGE_BYTES, (dram_bytes // 4096) * IMAGE_BYTES_PER_BLOCK + (64 << 10))


def region_file_name(tenant: str | None) -> str:
    """The name a region's memory file is made with (``kvtierd-<tenant>``, ``kvtierd-default``
    for the default region), which no one can change afterwards: what binds a handed region to
    its tenant, whatever an image says. A long tenant name is cut and completed by its hash
    (the kernel takes 249 bytes)."""
    name = "kvtierd-default" if tenant is None else f"kvtierd-{tenant}"
    if len(name.encode()) <= 200:
        return name
    return f"kvtierd-{tenant[:64] if tenant else ''}~{xxhash.xxh3_64_hexdigest(name.encode())}"


def decode_image(data: bytes | memoryview, limit: int = MAX_IMAGE_BYTES) -> DramImage:
    """Raises ``ValueError`` for anything but an image of this version of at most ``limit``
    bytes whose regions are each one file, named once."""
    if len(data) > limit:
        raise ValueError(f"{len(data)} bytes is more than an image may be ({limit})")
    try:
        image = msgspec.msgpack.decode(data, type=DramImage)
    except msgspec.DecodeError as exc:
        raise ValueError(f"not a DRAM image: {exc}") from None
    if image.version != IMAGE_VERSION:
        raise ValueError(f"an image of version {image.version}, not {IMAGE_VERSION}")
    for what, seen in (
        ("region number", [r.id for r in image.regions]),
        ("memory file", [(r.inode, r.device) for r in image.regions]),
        ("tenant", [r.tenant for r in image.regions]),
    ):
        if len(set(seen)) != len(seen):
            raise ValueError(f"the image names a {what} twice")
    return image


@dataclass(frozen=True, slots=True)
class HandedRegion:
    """A region's memory file handed back (``fd``, now this process's), as the image says."""

    fd: int
    kept: KeptRegion


@dataclass(frozen=True, slots=True)
class Handed:
    """What the last daemon left: its image, and the regions whose files were handed back and
    are what the image says they are, by ``(tenant, size)``."""

    image: DramImage
    regions: Mapping[tuple[str | None, int], HandedRegion]


class DramKeeper(Protocol):
    """Who keeps the regions and the image while no daemon runs (systemd's fd store)."""

    def handed(self, limit: int = MAX_IMAGE_BYTES) -> Handed | None:
        """What the last clean stop left, checked (an image of at most ``limit`` bytes);
        ``None`` when nothing (or nothing usable). Takes everything out of the keeper first:
        a crash from now on must not be handed it again. Blocking (a worker thread's)."""

    def settle(self, taken: Iterable[int]) -> None:
        """The caller owns the descriptors ``taken`` now (the regions its arena will map):
        close every other one handed."""

    def keep(self, regions: Sequence[tuple[int, int]], image: bytes) -> bool:
        """Keep the regions ``(id, descriptor)`` and ``image`` for the next start; whether the
        keeper took them."""


def match_regions(
    image: DramImage, descriptors: Mapping[int, int]
) -> dict[tuple[str | None, int], HandedRegion]:
    """The regions of ``image`` whose memory file is among ``descriptors`` (old region id ->
    fd) and is the very file the image describes: a regular memory file of that size and
    inode, sealed as regions are. Anything else is left out, with a warning."""
    out: dict[tuple[str | None, int], HandedRegion] = {}
    for kept in image.regions:
        fd = descriptors.get(kept.id)
        if fd is None:
            log.warning("kept DRAM: region %d (%s) was not handed back", kept.id, kept.tenant)
            continue
        problem = _region_problem(fd, kept)
        if problem is not None:
            log.warning("kept DRAM: region %d (%s) not taken: %s", kept.id, kept.tenant, problem)
            continue
        out[(kept.tenant, kept.size_bytes)] = HandedRegion(fd, kept)
    return out


def _region_problem(fd: int, kept: KeptRegion) -> str | None:
    try:
        info = os.fstat(fd)
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    except OSError as exc:
        return f"descriptor {fd}: {exc.strerror}"
    if not stat.S_ISREG(info.st_mode):
        return "not a memory file"
    if (info.st_ino, info.st_dev) != (kept.inode, kept.device):
        return "another memory file than the one the image describes"
    if info.st_size != kept.size_bytes:
        return f"{info.st_size} bytes, not {kept.size_bytes}"
    if seals & REGION_SEALS != REGION_SEALS:
        return "not sealed against resizing"
    if seals & _WRITE_SEALS or fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE != os.O_RDWR:
        return "not writable"
    try:
        made_as = os.readlink(f"/proc/self/fd/{fd}".encode())
    except OSError as exc:
        return f"its name cannot be read ({exc.strerror})"
    expected = f"/memfd:{region_file_name(kept.tenant)} (deleted)".encode()
    if made_as != expected:
        return f"made as {made_as.decode(errors='replace')!r}, not as this tenant's region"
    return None


def verify_blocks(
    view: memoryview,
    spans: Sequence[tuple[int, int, int]],
    progress: Callable[[int, int], None] = lambda done, total: None,
) -> list[bool]:
    """For each ``(offset, length, checksum)``: whether ``view[offset:offset + length]``
    hashes to ``checksum``. Each byte is read once (by the hash); ``progress(done, total)``
    in bytes about every GiB. Run it in a worker thread: it takes about a second per 20 GiB."""
    total = sum(length for _, length, _ in spans)
    done = reported = 0
    ok = []
    started = time.monotonic()
    for offset, length, expected in spans:
        ok.append(checksum(view[offset : offset + length]) == expected)
        done += length
        if done - reported >= _VERIFY_CHUNK_BYTES:
            progress(done, total)
            reported = done
    progress(total, total)
    log.debug("kept DRAM: %d blocks verified in %.2f s", len(spans), time.monotonic() - started)
    return ok
