"""The contract every :class:`~kvtierd.store.tier.LowerTier` passes (after zarr's ``StoreTests``).

A subclass supplies how to open its tier over a directory (:meth:`TierContract.open_tier`) and
how to reach the medium behind the tier's back (:meth:`TierContract.corrupt`), so that the suite
can check what the tier promises about bytes it did not write itself: a damaged copy is a miss,
never its bytes, and the tier's :class:`~kvtierd.store.tier.TierCapabilities`. A test of a
promise the tier does not make (recovery on open, a bounded size class) is skipped by name of
the capability, as zarr's store tests skip by ``supports_*``. Everything else is the same for
every tier.
"""

from __future__ import annotations

import contextlib
import shutil
from collections.abc import Hashable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import xxhash

from kvtierd.errors import BlockNotFoundError, NoSpaceError
from kvtierd.store.records import PAGE_BYTES, checksum
from kvtierd.store.runs import plan_runs
from kvtierd.store.tier import BlockRef, LowerTier, MediumFullError, TierCapabilities

NS = bytes(range(16))
OTHER_NS = bytes(range(16, 32))


def content(key: bytes, nbytes: int, *, compressible: bool = False) -> bytes:
    """Deterministic bytes for ``key``: random-looking, or (``compressible``) mostly runs."""
    if compressible:
        unit = key + bytes(48)
        return (unit * (nbytes // len(unit) + 1))[:nbytes]
    out = bytearray()
    counter = 0
    while len(out) < nbytes:
        out += xxhash.xxh3_128_digest(key + counter.to_bytes(8, "little"))
        counter += 1
    return bytes(out[:nbytes])


@dataclass
class Harness:
    """An open tier plus page-aligned scratch buffers the tier may do I/O from (arena slots)."""

    tier: LowerTier
    buffers: list[memoryview]
    seq: int = 0
    free: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.free = list(range(len(self.buffers)))

    def next_seq(self) -> int:
        self.seq += 1
        return self.seq

    @contextlib.contextmanager
    def buffer(self, nbytes: int) -> Iterator[memoryview]:
        index = self.free.pop()
        try:
            view = self.buffers[index]
            assert nbytes <= len(view), "test block larger than the harness buffers"
            yield view[: -(-nbytes // PAGE_BYTES) * PAGE_BYTES]
        finally:
            self.free.append(index)

    async def put(
        self,
        key: bytes,
        data: bytes,
        *,
        ns: bytes = NS,
        seq: int | None = None,
        compress: bool = False,
    ) -> tuple[BlockRef, Hashable]:
        ref = BlockRef(
            ns, key, len(data), checksum(data), self.next_seq() if seq is None else seq, compress
        )
        with self.buffer(len(data)) as view:
            view[: len(data)] = data
            # what lies past the block in its slot must never matter
            view[len(data) :] = b"\xa5" * (len(view) - len(data))
            location = await self.tier.store(ref, view)
        return ref, location

    async def get(self, ref: BlockRef, location: Hashable) -> bytes:
        with self.buffer(ref.raw_bytes) as view:
            view[:] = b"\x5a" * len(view)
            await self.tier.load(ref, location, view)
            return bytes(view[: ref.raw_bytes])


class TierContract:
    """Tests every lower tier passes. Subclasses implement the three hooks below."""

    #: bytes of the medium the suite opens for the ordinary tests (full-tier tests pass less)
    SIZE_BYTES = 16 << 20
    #: the largest block the tests store (harness buffers are this big)
    MAX_BLOCK_BYTES = 1 << 20
    #: what the tier under test promises (its class's ``capabilities``)
    capabilities: TierCapabilities
    #: copies stored one after another follow one another (:meth:`LowerTier.follows`)
    merges_following_copies = False

    def require_recovery(self) -> None:
        if not self.capabilities.recovers_on_open:
            pytest.skip("the tier does not list its blocks when opened (recovers_on_open)")

    def require_bounded_classes(self) -> None:
        if self.capabilities.evicts_itself:
            pytest.skip("the tier evicts by itself and never refuses a class as full")

    @pytest.fixture(autouse=True)
    def _remove_the_medium(self, tmp_path: Path) -> Iterator[None]:
        """The disk is shared: do not leave preallocated files behind in pytest's temp dirs."""
        yield
        shutil.rmtree(tmp_path, ignore_errors=True)

    def open_tier(
        self, directory: Path, size_bytes: int
    ) -> contextlib.AbstractAsyncContextManager[Harness]:
        """Open (creating or recovering) the tier kept in ``directory``; close it on exit."""
        raise NotImplementedError

    def corrupt(self, directory: Path, location: Hashable, where: str) -> None:
        """Damage the stored copy at ``location`` directly on the medium, with the tier closed
        or open: ``where`` is ``"payload"`` (one byte inside the block) or ``"header"``."""
        raise NotImplementedError

    def simulate_crash(self, directory: Path) -> None:
        """After a clean close, remove whatever only a clean shutdown leaves (so the next open
        recovers as after ``kill -9``). Tiers with no such state keep this no-op."""

    # -- round trips ---------------------------------------------------------------------------

    @pytest.mark.anyio
    @pytest.mark.parametrize(
        "nbytes", [1, 100, PAGE_BYTES - 1, PAGE_BYTES, PAGE_BYTES + 1, 12345, 64 << 10, 1 << 20]
    )
    async def test_store_then_load_is_byte_exact(self, tmp_path: Path, nbytes: int) -> None:
        async with self.open_tier(tmp_path, self.SIZE_BYTES) as h:
            key = nbytes.to_bytes(4, "little") * 4
            data = content(key, nbytes)
            ref, location = await h.put(key, data)
            assert await h.get(ref, location) == data
            assert await h.get(ref, location) == data  # loading does not consume

    @pytest.mark.anyio
    async def test_many_blocks_keep_their_own_bytes(self, tmp_path: Path) -> None:
        async with self.open_tier(tmp_path, self.SIZE_BYTES) as h:
            stored = []
            for i in range(40):
                key = b"k%03d" % i + bytes(12)
                data = content(key, 16 << 10)
                stored.append((data, *await h.put(key, data)))
            for data, ref, location in reversed(stored):
                assert await h.get(ref, location) == data
            assert h.tier.statistics().blocks == 40

    @pytest.mark.anyio
    async def test_same_key_in_two_namespaces_are_two_blocks(self, tmp_path: Path) -> None:
        async with self.open_tier(tmp_path, self.SIZE_BYTES) as h:
            key = b"K" * 16
            a = await h.put(key, content(b"a", 8192), ns=NS)
            b = await h.put(key, content(b"b", 8192), ns=OTHER_NS)
            assert await h.get(*a) == content(b"a", 8192)
            assert await h.get(*b) == content(b"b", 8192)

    @pytest.mark.anyio
    async def test_load_with_a_ref_of_another_block_fails(self, tmp_path: Path) -> None:
        async with self.open_tier(tmp_path, self.SIZE_BYTES) as h:
            ref, location = await h.put(b"A" * 16, content(b"A", 8192))
            other = BlockRef(NS, b"B" * 16, ref.raw_bytes, ref.checksum, ref.seq + 100)
            with pytest.raises(BlockNotFoundError):
                await h.get(other, location)

    @staticmethod
    async def _zstd_blocks(h: Harness) -> list[tuple[bytes, BlockRef, Hashable]]:
        blocks = []
        for i, (nbytes, compressible) in enumerate(
            [(256 << 10, True), (256 << 10, False), (100_000, True), (5000, True)]
        ):
            key = b"z%02d" % i + bytes(13)
            data = content(key, nbytes, compressible=compressible)
            blocks.append((data, *await h.put(key, data, compress=True)))
        for data, ref, location in blocks:
            assert await h.get(ref, location) == data
        return blocks

    @pytest.mark.anyio
    async def test_zstd_round_trip(self, tmp_path: Path) -> None:
        async with self.open_tier(tmp_path, self.SIZE_BYTES) as h:
            await self._zstd_blocks(h)

    @pytest.mark.anyio
    async def test_zstd_blocks_recover_after_reopen(self, tmp_path: Path) -> None:
        self.require_recovery()
        async with self.open_tier(tmp_path, self.SIZE_BYTES) as h:
            blocks = await self._zstd_blocks(h)
        async with self.open_tier(tmp_path, self.SIZE_BYTES) as h:
            found = {r.ref.key: r for r in h.tier.recovered()}
            for data, ref, _ in blocks:
                again = found[ref.key]
                assert await h.get(again.ref, again.location) == data

    # -- discard -------------------------------------------------------------------------------

    @pytest.mark.anyio
    async def test_load_of_a_discarded_location_fails(self, tmp_path: Path) -> None:
        async with self.open_tier(tmp_path, self.SIZE_BYTES) as h:
            ref, location = await h.put(b"D" * 16, content(b"D", 8192))
            await h.tier.discard(ref, location)
            with pytest.raises(BlockNotFoundError):
                await h.get(ref, location)
            await h.tier.discard(ref, location)  # twice is harmless
            assert h.tier.statistics().blocks == 0

    @pytest.mark.anyio
    async def test_discard_survives_reopen(self, tmp_path: Path) -> None:
        self.require_recovery()
        for crash in (False, True):
            directory = tmp_path / f"crash-{crash}"
            async with self.open_tier(directory, self.SIZE_BYTES) as h:
                kept = await h.put(b"kept" + bytes(12), content(b"kept", 8192))
                gone = await h.put(b"gone" + bytes(12), content(b"gone", 8192))
                await h.tier.discard(*gone)
                await h.tier.sync()
            if crash:
                self.simulate_crash(directory)
            async with self.open_tier(directory, self.SIZE_BYTES) as h:
                keys = [r.ref.key for r in h.tier.recovered()]
                assert keys == [kept[0].key]

    @pytest.mark.anyio
    async def test_discarded_space_is_reused(self, tmp_path: Path) -> None:
        self.require_bounded_classes()
        async with self.open_tier(tmp_path, 8 << 20) as h:
            for round_ in range(4):  # four times what the tier holds
                locations: list[tuple[BlockRef, Hashable]] = []
                while True:
                    key = b"r%d-%d" % (round_, len(locations))
                    try:
                        locations.append(await h.put(key.ljust(16, b"."), content(key, 64 << 10)))
                    except NoSpaceError:
                        break
                assert len(locations) > 10
                for ref, location in locations:
                    await h.tier.discard(ref, location)
            assert h.tier.statistics().blocks == 0

    # -- damage --------------------------------------------------------------------------------

    @pytest.mark.anyio
    @pytest.mark.parametrize("where", ["payload", "header"])
    @pytest.mark.parametrize("compress", [False, True])
    async def test_corrupt_copy_is_a_miss_never_its_bytes(
        self, tmp_path: Path, where: str, compress: bool
    ) -> None:
        async with self.open_tier(tmp_path, self.SIZE_BYTES) as h:
            key = b"C" * 16
            data = content(key, 64 << 10, compressible=compress)
            ref, location = await h.put(key, data, compress=compress)
            intact = await h.put(b"I" * 16, content(b"I", 8192), compress=compress)
            self.corrupt(tmp_path, location, where)
            with pytest.raises(BlockNotFoundError):
                await h.get(ref, location)
            assert await h.get(*intact) == content(b"I", 8192)

    @pytest.mark.anyio
    async def test_corrupt_copy_after_reopen_is_a_miss(self, tmp_path: Path) -> None:
        self.require_recovery()
        async with self.open_tier(tmp_path, self.SIZE_BYTES) as h:
            _, location = await h.put(b"C" * 16, content(b"C", 64 << 10))
        self.corrupt(tmp_path, location, "payload")
        async with self.open_tier(tmp_path, self.SIZE_BYTES) as h:
            for found in h.tier.recovered():  # a tier may or may not list it; never serve it
                with pytest.raises(BlockNotFoundError):
                    await h.get(found.ref, found.location)

    # -- runs ----------------------------------------------------------------------------------

    @pytest.mark.anyio
    @pytest.mark.parametrize("damaged", [None, "payload", "header", "discarded"])
    async def test_load_run_fills_each_block_and_misses_only_a_damaged_one(
        self, tmp_path: Path, damaged: str | None
    ) -> None:
        async with self.open_tier(tmp_path, self.SIZE_BYTES) as h:
            stored = []
            for i in range(3):
                key = b"L%d" % i + bytes(14)
                data = content(key, (64 << 10) + 100)
                stored.append((*(await h.put(key, data)), data))
            runs = plan_runs(
                stored,
                lambda a, b: h.tier.follows(a[1], b[1]),
                lambda item: len(item[2]),
                max_bytes=1 << 30,
                max_items=16,
            )
            if self.merges_following_copies:
                assert [len(run) for run in runs] == [3]
            if damaged == "discarded":
                await h.tier.discard(stored[1][0], stored[1][1])
            elif damaged is not None:
                self.corrupt(tmp_path, stored[1][1], damaged)
            with contextlib.ExitStack() as stack:
                views = [stack.enter_context(h.buffer(len(data))) for _, _, data in stored]
                for view in views:
                    view[:] = b"\x5a" * len(view)
                outcomes: list[BlockNotFoundError | None] = []
                for run in runs:
                    first = len(outcomes)
                    items = [(ref, loc, views[first + i]) for i, (ref, loc, _) in enumerate(run)]
                    outcomes += await h.tier.load_run(items)
                for i, ((_, _, data), view, outcome) in enumerate(
                    zip(stored, views, outcomes, strict=True)
                ):
                    if damaged is not None and i == 1:
                        assert isinstance(outcome, BlockNotFoundError)
                    else:
                        assert outcome is None
                        assert bytes(view[: len(data)]) == data

    @pytest.mark.anyio
    @pytest.mark.parametrize("mixed", [False, True])
    async def test_load_run_takes_copies_in_any_order(self, tmp_path: Path, mixed: bool) -> None:
        """``mixed``: every other copy compressed (a tier may read those alone, beside)."""
        async with self.open_tier(tmp_path, self.SIZE_BYTES) as h:
            stored = []
            for i in range(4):
                key = b"A%d" % i + bytes(14)
                data = bytes(64 << 10) + content(key, 100) if mixed else content(key, 65636)
                ref, location = await h.put(key, data, compress=mixed and i % 2 == 1)
                stored.append((ref, location, data))
            order = [2, 0, 3, 1]
            with contextlib.ExitStack() as stack:
                views = [stack.enter_context(h.buffer(len(data))) for _, _, data in stored]
                outcomes = await h.tier.load_run(
                    [(stored[i][0], stored[i][1], views[i]) for i in order]
                )
                assert outcomes == [None] * len(order)
                for (_, _, data), view in zip(stored, views, strict=True):
                    assert bytes(view[: len(data)]) == data

    # -- recovery ------------------------------------------------------------------------------

    @pytest.mark.anyio
    @pytest.mark.parametrize("crash", [False, True], ids=["clean", "crash"])
    async def test_reopen_recovers_stored_blocks(self, tmp_path: Path, crash: bool) -> None:
        self.require_recovery()
        written: dict[bytes, bytes] = {}
        async with self.open_tier(tmp_path, self.SIZE_BYTES) as h:
            for i in range(30):
                key = b"R%03d" % i + bytes(12)
                written[key] = content(key, 3000 + 4096 * (i % 5))
                await h.put(key, written[key])
            await h.tier.sync()
        if crash:
            self.simulate_crash(tmp_path)
        async with self.open_tier(tmp_path, self.SIZE_BYTES) as h:
            found = {r.ref.key: r for r in h.tier.recovered()}
            assert set(found) == set(written)
            for key, data in written.items():
                assert found[key].ref.ns_digest == NS
                assert await h.get(found[key].ref, found[key].location) == data

    @pytest.mark.anyio
    @pytest.mark.parametrize("crash", [False, True], ids=["clean", "crash"])
    async def test_newest_seq_wins_for_duplicate_keys(self, tmp_path: Path, crash: bool) -> None:
        self.require_recovery()
        key = b"dup".ljust(16, b".")
        async with self.open_tier(tmp_path, self.SIZE_BYTES) as h:
            await h.put(key, content(b"old", 8192), seq=5)
            await h.put(key, content(b"new", 8192), seq=9)
            await h.put(key, content(b"older", 8192), seq=2)
            await h.tier.sync()
        if crash:
            self.simulate_crash(tmp_path)
        for _ in range(2):  # and the losers stay gone on the open after that
            async with self.open_tier(tmp_path, self.SIZE_BYTES) as h:
                found = [r for r in h.tier.recovered() if r.ref.key == key]
                assert [r.ref.seq for r in found] == [9]
                assert await h.get(found[0].ref, found[0].location) == content(b"new", 8192)
                assert h.tier.statistics().blocks == 1
            if crash:
                self.simulate_crash(tmp_path)

    @pytest.mark.anyio
    async def test_sync_returns_and_blocks_stay_readable(self, tmp_path: Path) -> None:
        async with self.open_tier(tmp_path, self.SIZE_BYTES) as h:
            await h.tier.sync()  # nothing written yet
            ref, location = await h.put(b"S" * 16, content(b"S", 8192))
            await h.tier.sync()
            await h.tier.sync()
            assert await h.get(ref, location) == content(b"S", 8192)

    # -- capacity ------------------------------------------------------------------------------

    @pytest.mark.anyio
    async def test_no_space_when_the_class_is_full(self, tmp_path: Path) -> None:
        self.require_bounded_classes()
        for compress in (False, True):
            directory = tmp_path / f"compress-{compress}"
            async with self.open_tier(directory, 8 << 20) as h:
                stored = await self._fill(h, compress)
                stats = h.tier.statistics()
                assert stats.blocks == len(stored)
                assert stats.used_bytes <= stats.capacity_bytes
                # a full tier still serves what it holds, and frees room on discard
                for data, ref, location in stored[:: max(1, len(stored) // 8)]:
                    assert await h.get(ref, location) == data
                await h.tier.discard(stored[0][1], stored[0][2])
                again = await h.put(b"again".ljust(16, b"."), content(b"again", 64 << 10))
                assert await h.get(*again) == content(b"again", 64 << 10)

    @staticmethod
    async def _fill(h: Harness, compress: bool) -> list[tuple[bytes, BlockRef, Hashable]]:
        """Store distinct 64 KiB blocks until the tier says ``NoSpaceError``."""
        stored: list[tuple[bytes, BlockRef, Hashable]] = []
        for i in range(10_000):
            key = b"F%05d" % i + bytes(10)
            data = content(key, 64 << 10)
            try:
                ref, location = await h.put(key, data, compress=compress)
            except MediumFullError:
                raise  # a full class must not read as a full medium: evicting makes room
            except NoSpaceError:
                assert len(stored) > 10
                return stored
            stored.append((data, ref, location))
        raise AssertionError("the tier never filled up")

    @pytest.mark.anyio
    async def test_statistics_count_blocks_and_bytes(self, tmp_path: Path) -> None:
        async with self.open_tier(tmp_path, self.SIZE_BYTES) as h:
            before = h.tier.statistics()
            ref, location = await h.put(b"T" * 16, content(b"T", 8192))
            await h.get(ref, location)
            after = h.tier.statistics()
            assert after.blocks == before.blocks + 1
            assert after.used_bytes > before.used_bytes
            assert after.hits == before.hits + 1
            assert after.bytes_written > before.bytes_written
            assert after.bytes_read > before.bytes_read
