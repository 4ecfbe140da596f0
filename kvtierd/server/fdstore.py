"""systemd's file-descriptor store, where the DRAM waits while the daemon restarts.

A service under ``Type=notify`` may hand systemd descriptors to keep (``sd_pid_notify_with_fds``:
``FDSTORE=1`` and ``FDNAME=`` with the descriptors as ``SCM_RIGHTS``, accepted up to the unit's
``FileDescriptorStoreMax=``); systemd passes them to the service's next start as it passes a
socket unit's, from descriptor 3 on, named in ``LISTEN_FDNAMES`` (:mod:`kvtierd.server.
activation` claims them), and drops them when the service is stopped for good (not restarted)
or with ``FDSTOREREMOVE=1``.

kvtierd keeps its tenant regions there, each as ``kvtierd-dram-region-<id>``, and last an
image of what they hold (``kvtierd-dram-image``, a sealed memory file: :mod:`kvtierd.store.
kept`), only as it stops, once write-back has drained; a ``BARRIER=1`` then waits until systemd
has taken them in before the daemon exits. A start removes every one of them from the store
before it reads any, so a daemon that crashes later (or on what it was handed) is handed
nothing: only a clean stop's DRAM is ever trusted, and even that is verified block by block.

This class is the store's :class:`~kvtierd.store.kept.DramKeeper` under systemd. Outside systemd
(no ``$NOTIFY_SOCKET``) nobody keeps anything, and a restart reads NVMe as before.
"""

from __future__ import annotations

import fcntl
import logging
import mmap
import os
import re
import select
from collections.abc import Iterable, Mapping, Sequence

from humanfriendly import format_size

from kvtierd.config import MAX_TENANTS
from kvtierd.server.notify import Notifier
from kvtierd.store.kept import MAX_IMAGE_BYTES, DramImage, Handed, decode_image, match_regions

__all__ = ["IMAGE_NAME", "IMAGE_SEALS", "MAX_STORED", "PREFIX", "FdStore", "region_name"]

log = logging.getLogger("kvtierd")

#: Every name kvtierd stores starts so (what :mod:`kvtierd.server.activation` claims).
PREFIX = "kvtierd-dram-"
IMAGE_NAME = PREFIX + "image"
_REGION = re.compile(re.escape(PREFIX) + r"region-([0-9]{1,3})")
#: What one stop stores at most: a region per tenant, the default region, the image
#: (``FileDescriptorStoreMax=`` in kvtierd.service is this).
MAX_STORED = MAX_TENANTS + 2
#: How long a stop waits for systemd to have taken the descriptors in.
BARRIER_TIMEOUT_S = 5.0
#: An image is sealed against every change.
IMAGE_SEALS = fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL


def region_name(region_id: int) -> str:
    return f"{PREFIX}region-{region_id}"


class FdStore:
    """The DRAM's keeper under systemd: ``passed`` are the descriptors this start was handed
    (name -> descriptors, this process's to close; systemd keeps several under one name when
    it was given several), ``environ`` has ``$NOTIFY_SOCKET`` and, on systemd 254 and later,
    ``$FDSTORE`` (the unit's ``FileDescriptorStoreMax=``)."""

    def __init__(
        self,
        passed: Mapping[str, Sequence[int]],
        environ: Mapping[str, str],
        *,
        enabled: bool = True,
    ) -> None:
        """``enabled``: ``dram.keep_across_restarts``; without it what was handed is closed
        and removed, and nothing is kept."""
        self._passed = {name: list(fds) for name, fds in passed.items()}
        self.enabled = enabled
        self._notifier = Notifier(environ)
        self.address = self._notifier.address
        limit = environ.get("FDSTORE", "")
        self.limit = int(limit) if limit.isdigit() else None

    # -- a start ----------------------------------------------------------------------------

    def handed(self, limit: int = MAX_IMAGE_BYTES) -> Handed | None:
        """Take everything out of systemd's store first and have systemd confirm it (whatever
        happens next, a later start is not handed it again; unconfirmed, nothing is used),
        then read the image (at most ``limit`` bytes) and check the regions against it. A
        name handed twice is trusted for neither descriptor. Blocking: run it in a worker
        thread."""
        if not self._passed:
            return None
        sent = [self._send(f"FDSTOREREMOVE=1\nFDNAME={name}") for name in self._passed]
        if not all(sent) or not self._barrier():  # every one sent, whatever the first did
            log.warning(
                "systemd did not confirm it let go of the DRAM it handed back: it is not used "
                "(a crash later must not be handed it again), and the DRAM starts empty"
            )
            return None
        if not self.enabled:
            return None
        twice = sorted(name for name, fds in self._passed.items() if len(fds) > 1)
        if twice:
            log.warning("systemd handed back more than one descriptor named %s: none of them "
                        "is used", ", ".join(twice))  # fmt: skip
        single = {name: fds[0] for name, fds in self._passed.items() if len(fds) == 1}
        regions = {
            int(m.group(1)): fd
            for name, fd in single.items()
            if (m := _REGION.fullmatch(name)) is not None
        }
        image_fd = single.get(IMAGE_NAME)
        if image_fd is None:
            if regions:
                log.info(
                    "systemd handed back %d DRAM region(s) without their image (the last "
                    "stop was not clean): the DRAM starts empty",
                    len(regions),
                )
            return None
        try:
            image = _decode_sealed(image_fd, limit)
        except (OSError, ValueError, MemoryError) as exc:
            log.warning("the DRAM image systemd handed back is not usable (%s): the DRAM "
                        "starts empty", exc)  # fmt: skip
            return None
        return Handed(image, match_regions(image, regions))

    def settle(self, taken: Iterable[int]) -> None:
        kept = set(taken)
        for fds in self._passed.values():
            for fd in fds:
                if fd not in kept:
                    os.close(fd)
        self._passed.clear()

    # -- a stop -----------------------------------------------------------------------------

    def keep(self, regions: Sequence[tuple[int, int]], image: bytes) -> bool:
        if self.address is None or not self.enabled:
            return False
        if self.limit is not None and self.limit < len(regions) + 1:
            log.warning(
                "the DRAM is not kept across the restart: it needs %d descriptors in systemd's "
                "store and FileDescriptorStoreMax= allows %d",
                len(regions) + 1,
                self.limit,
            )
            return False
        image_fd = _sealed_memfd(IMAGE_NAME, image)
        try:
            for region_id, fd in regions:  # the image last: present only with every region
                if not self._send(f"FDSTORE=1\nFDNAME={region_name(region_id)}", [fd]):
                    return False
            if not self._send(f"FDSTORE=1\nFDNAME={IMAGE_NAME}", [image_fd]):
                return False
        finally:
            os.close(image_fd)
        if not self._barrier():
            log.warning("systemd did not confirm it took the DRAM in %.0f s", BARRIER_TIMEOUT_S)
            return False
        log.debug("DRAM image of %s handed to systemd", format_size(len(image), binary=True))
        return True

    # -- the protocol -----------------------------------------------------------------------

    def _send(self, message: str, fds: Sequence[int] = ()) -> bool:
        return self._notifier.send(message, fds)

    def _barrier(self) -> bool:
        """``BARRIER=1``: systemd closes the descriptor sent with it once it has handled every
        message before it (systemd 246 on; an older one closes it at once, unread)."""
        read, write = os.pipe2(os.O_CLOEXEC)
        try:
            sent = self._send("BARRIER=1", [write])
            os.close(write)
            write = -1
            if not sent:
                return False
            poller = select.poll()
            poller.register(read, select.POLLHUP | select.POLLIN)
            return bool(poller.poll(BARRIER_TIMEOUT_S * 1000))
        finally:
            os.close(read)
            if write >= 0:
                os.close(write)


def _sealed_memfd(name: str, data: bytes) -> int:
    """A memory file holding ``data``, sealed against any change."""
    fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, IMAGE_SEALS)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _decode_sealed(fd: int, limit: int) -> DramImage:
    """The image in a memory file that nobody can change any more (at most ``limit`` bytes),
    decoded from its pages where they lie."""
    seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    if seals & IMAGE_SEALS != IMAGE_SEALS:
        raise ValueError("the image is not sealed against writes")
    size = os.fstat(fd).st_size
    if size > limit:
        raise ValueError(f"the image holds {size} bytes, more than {limit}")
    if size == 0:
        raise ValueError("the image is empty")
    with mmap.mmap(fd, size, prot=mmap.PROT_READ) as pages, memoryview(pages) as view:
        return decode_image(view, limit)
