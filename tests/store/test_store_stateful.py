"""A BlockStore driven by hypothesis against a plain dict model: put, get, forget, evict, fsync,
leases held across eviction, abandoned writes, background promotion, clean and crash restarts.

The store runs in-process (``open_store`` with a 16 MiB arena and a 64 MiB NVMe tier) on an
event loop in a blocking portal thread; the state machine calls into it synchronously. A block's
bytes are derived from its key (as real keys are hashes of their tokens), so any bytes the store
serves can be checked. A "crash" leaves the store's context with an exception: write-back workers
are cancelled wherever they are and no index snapshot is written, so the next open scans the
disk, as after ``kill -9``.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from anyio.from_thread import BlockingPortal, start_blocking_portal
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from kvtierd.config import load_config
from kvtierd.errors import BlockNotFoundError
from kvtierd.store.index import Block, Lease, Owner
from kvtierd.store.lifecycle import open_store
from kvtierd.store.namespaces import Namespace, NamespaceSpec, PeerCredentials
from kvtierd.store.records import checksum
from kvtierd.store.store import BlockStore

BLOCK_BYTES = 700_000 + 123  # not a page multiple; about 23 fit in the arena
KEYS = [b"key-%02d" % i + bytes(10) for i in range(20)]
ROOT = PeerCredentials(pid=1, uid=0, gid=0)
SPEC = NamespaceSpec("stateful", "default", BLOCK_BYTES, None, 0, 1)
_CONTENT: dict[bytes, bytes] = {}


class Crash(Exception):
    """Raised inside the store's context to leave it the way a killed daemon would."""


def content(key: bytes) -> bytes:
    if key not in _CONTENT:
        seed = int.from_bytes(key[:8], "little")
        _CONTENT[key] = np.random.default_rng(seed).bytes(BLOCK_BYTES)
    return _CONTENT[key]


class StoreMachine(RuleBasedStateMachine):
    """Model: ``present`` (committed, not forgotten), ``durable`` (present at the last FSYNC
    and not forgotten since), ``changed`` (put or forgotten since the last FSYNC)."""

    def __init__(self) -> None:
        super().__init__()
        self.stack = contextlib.ExitStack()
        self.portal: BlockingPortal = self.stack.enter_context(start_blocking_portal("asyncio"))
        self.directory = Path(self.stack.enter_context(_tempdir()))
        self.config = load_config(
            None,
            {
                "daemon": {"data_dir": str(self.directory)},
                "dram": {"size": "16M", "mlock": "never", "hugepages": "never"},
                "nvme": {"size": "64M", "segment_bytes": "8M", "queue_depth": 8},
            },
        )
        self.store_cm: Any = None
        self.store: BlockStore
        self.ns: Namespace
        self.owner = Owner("machine")
        self.held: list[tuple[Lease, bytes]] = []
        self.present: set[bytes] = set()
        self.durable: set[bytes] = set()
        self.changed: set[bytes] = set()

    # -- plumbing ------------------------------------------------------------------------------

    def _open(self) -> None:
        self.store_cm = self.portal.wrap_async_context_manager(open_store(self.config))
        self.store = self.store_cm.__enter__()
        self.ns, new = self.store.registry.open(SPEC, ROOT)
        if new:
            self.store.registry.save()
        self.owner = Owner("machine")

    def _close(self, *, crash: bool) -> None:
        self._release_held()
        cm, self.store_cm = self.store_cm, None
        if crash:
            try:
                cm.__exit__(Crash, Crash(), None)
            except* Crash:
                pass  # the store re-raises it (in a group) after cancelling its tasks
        else:
            cm.__exit__(None, None, None)

    def _release_held(self) -> None:
        if self.held:
            ids = [lease.id for lease, _ in self.held]
            assert self.portal.call(self.store.release, self.owner, ids) == len(ids)
            self.held.clear()

    def _call(self, func: Any, *args: Any) -> Any:
        return self.portal.call(func, *args)

    def teardown(self) -> None:
        try:
            if self.store_cm is not None:
                self._close(crash=False)
        finally:
            self.stack.close()

    # -- rules ---------------------------------------------------------------------------------

    @initialize()
    def start(self) -> None:
        self._open()

    @rule(key=st.sampled_from(KEYS))
    def put(self, key: bytes) -> None:
        write = self._call(self.store.alloc, self.owner, self.ns, [key])
        slot = write.slots[0]
        assert (slot is None) == (key in self.present)
        if slot is not None:
            self.store.arena.view[slot.offset : slot.offset + BLOCK_BYTES] = content(key)
        committed = self._call(
            self.store.commit, self.owner, write.id, [checksum(content(key))], False
        )
        assert committed == 1
        self.present.add(key)
        self.changed.add(key)

    @rule(key=st.sampled_from(KEYS), abort=st.booleans())
    def abandoned_write(self, key: bytes, abort: bool) -> None:
        """An ALLOC whose client aborts or disconnects is never visible."""
        other = Owner("quitter")
        write = self._call(self.store.alloc, other, self.ns, [key])
        if write.slots[0] is not None:
            start = write.slots[0].offset
            self.store.arena.view[start : start + 4096] = b"\xee" * 4096  # half-written
        if abort:
            assert self._call(self.store.commit, other, write.id, [], True) == 0
        else:
            self.portal.call(self.store.drop_owner, other)
        assert not other.writes

    @rule(key=st.sampled_from(KEYS))
    def get(self, key: bytes) -> None:
        if key not in self.present:
            with pytest.raises(BlockNotFoundError):
                self._call(self.store.read, self.owner, self.ns, [key])
            return
        lease = self._call(self.store.read, self.owner, self.ns, [key])
        try:
            assert _bytes_of(self.store, lease.blocks[0]) == content(key)
        finally:
            assert self.portal.call(self.store.release, self.owner, [lease.id]) == 1

    @rule(keys=st.lists(st.sampled_from(KEYS), min_size=1, max_size=6, unique=True))
    def lookup(self, keys: list[bytes]) -> None:
        """LOOKUP starts promoting the hits in the background; later rules race with it."""
        # Store methods run on the loop's thread: the background promotions they start do too.
        hits, _ = self.portal.call(lambda: self.store.lookup(self.ns, keys))
        expected = 0
        for key in keys:
            if key not in self.present:
                break
            expected += 1
        assert hits == expected

    @rule(keys=st.lists(st.sampled_from(KEYS), min_size=1, max_size=4, unique=True))
    def forget(self, keys: list[bytes]) -> None:
        forgotten = self._call(self.store.forget, self.ns, keys)
        assert forgotten == len(set(keys) & self.present)
        self.present -= set(keys)
        self.durable -= set(keys)
        self.changed |= set(keys)

    @rule()
    def evict_dram(self) -> None:
        self.portal.call(self.store.evict_dram, self.ns)

    @rule()
    def fsync(self) -> None:
        self._call(self.store.fsync)
        self.durable = set(self.present)
        self.changed = set()

    @precondition(lambda self: len(self.held) < 3)
    @rule(key=st.sampled_from(KEYS))
    def hold(self, key: bytes) -> None:
        """READ and keep the lease: eviction and forgetting must not touch the bytes."""
        if key in self.present:
            lease = self._call(self.store.read, self.owner, self.ns, [key])
            self.held.append((lease, key))

    @precondition(lambda self: bool(self.held))
    @rule()
    def evict_while_leased(self) -> None:
        self.portal.call(self.store.evict_dram, None)
        for lease, key in self.held:
            assert lease.blocks[0].dram is not None
            assert _bytes_of(self.store, lease.blocks[0]) == content(key)

    @precondition(lambda self: bool(self.held))
    @rule()
    def release_held(self) -> None:
        for lease, key in self.held:
            assert _bytes_of(self.store, lease.blocks[0]) == content(key)
        self._release_held()

    @rule(crash=st.booleans())
    def restart(self, crash: bool) -> None:
        self._close(crash=crash)
        self._open()
        found = {key for key in KEYS if self.store.index.contains(self.ns, key)}
        if crash:
            assert self.durable <= found, "a block whose FSYNC returned was lost"
            assert found <= self.durable | self.changed, "a block came back from nowhere"
        else:
            assert found == self.present, "a clean restart changed the stored set"
        for key in found:
            lease = self._call(self.store.read, self.owner, self.ns, [key])
            try:
                assert _bytes_of(self.store, lease.blocks[0]) == content(key)
            finally:
                self.portal.call(self.store.release, self.owner, [lease.id])
        self.present = set(found)
        self.durable = set(found)
        self.changed = set()

    # -- invariants ----------------------------------------------------------------------------

    @invariant()
    def index_matches_the_model(self) -> None:
        if self.store_cm is None:
            return
        index = self.store.index
        found = {key for key in KEYS if index.contains(self.ns, key)}  # makes no Block
        assert found == self.present
        assert len(self.owner.leases) == len(self.held)
        assert not self.owner.writes
        assert len(index) == self.ns.blocks == len(self.present)

    @invariant()
    def nothing_holds_a_block_let_go(self) -> None:
        """Every leased block is its key's live ``Block`` (blocks idle on NVMe only are let
        go, step 4 of "The index at scale": never one a lease holds), and every live block
        is one something is doing something with, or one the index could not let go."""
        if self.store_cm is None:
            return
        for lease, _ in self.held:
            assert lease.blocks[0].forgotten or self.store.index.holds(lease.blocks[0])
        for block in self.store.index.blocks():
            assert not block.forgotten
            assert self.store.index.holds(block)
            idle = block.pins == 0 and block.loading is None and not block.queued
            kept = block.dram is not None or block.dirty or block.staged is not None
            assert not idle or kept, "a block idle on NVMe only kept its Block"

    @invariant()
    def arena_accounting_holds(self) -> None:
        """When nothing is in flight, the arena's used bytes are exactly the resident blocks'."""
        if self.store_cm is None:
            return
        blocks = {id(b): b for b in self.store.index.blocks()}
        blocks.update((id(b), b) for lease, _ in self.held for b in lease.blocks)
        if any(b.loading is not None for b in blocks.values()) or self.store.writeback.backlog:
            return
        resident = sum(b.dram.size for b in blocks.values() if b.dram is not None)
        assert self.store.regions.used_bytes == resident


def _bytes_of(store: BlockStore, block: Block) -> bytes:
    assert block.dram is not None
    return bytes(store.arena.view[block.dram.offset : block.dram.offset + block.ref.raw_bytes])


@contextlib.contextmanager
def _tempdir() -> Iterator[str]:
    import tempfile

    with tempfile.TemporaryDirectory(prefix="kvtierd-stateful-") as name:
        yield name


StoreMachine.TestCase.settings = settings(
    max_examples=int(os.environ.get("KVTIERD_STATEFUL_EXAMPLES", "25")),
    stateful_step_count=25,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestStoreStateful = StoreMachine.TestCase
TestStoreStateful.pytestmark = [pytest.mark.timeout(300)]
