"""Daemon mode of trace replay: the trace against a real kvtierd, with a simple engine model.

Each request is LOOKUPed when it arrives (the trace's timestamps, divided by ``speed``), then
waits in a FIFO queue for a single engine. When the engine starts it, the blocks it will READ
are checked against the DRAM tier (a LOOKUP that promotes nothing answers each hit's tier), the
hit prefix is READ (the time that takes is the wait on the disk), the rest of the prompt is
"prefilled" (``uncached tokens / prefill_tokens_s`` seconds, divided by ``speed``) and its new
blocks are stored. Blocks are ``block_bytes`` each, scaled down from the real KV size so the
trace fits the machine; a trace id stands for a block and its whole prefix, so ids are keys.

With ``prefetch=True`` the arrival LOOKUP promotes its hits at once (SLSAP's prefix signal) and
the daemon runs the SLSAP reuse policy with background promotions; with ``prefetch=False`` the
arrival LOOKUP promotes nothing and the daemon runs plain LRU. The driver never looks at a
request before its arrival (it draws from an :class:`~kvtierd.replay.trace.ArrivalFeed`).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import anyio
import numpy as np

from kvtierd.client import AsyncNamespace, connect_async
from kvtierd.replay.trace import ArrivalFeed, TraceRequest
from kvtierd.testing import DaemonProcess

__all__ = ["DaemonReplay", "DaemonReplayResult"]

_BLOCK_TOKENS = 512


@dataclass
class DaemonReplayResult:
    """What one replay against the daemon measured."""

    prefetch: bool
    requests: int = 0
    blocks_read: int = 0
    blocks_in_dram_at_read: int = 0
    read_wait_s: list[float] = field(default_factory=list)
    queue_wait_s: list[float] = field(default_factory=list)
    daemon: dict[str, Any] = field(default_factory=dict)

    @property
    def dram_fraction_at_read(self) -> float:
        return self.blocks_in_dram_at_read / self.blocks_read if self.blocks_read else 0.0

    def as_dict(self) -> dict[str, Any]:
        waits = sorted(self.read_wait_s) or [0.0]
        result = {k: v for k, v in asdict(self).items() if k not in ("read_wait_s", "queue_wait_s")}
        result.update(
            dram_fraction_at_read=self.dram_fraction_at_read,
            read_wait_total_s=sum(self.read_wait_s),
            read_wait_p50_ms=waits[len(waits) // 2] * 1e3,
            read_wait_p99_ms=waits[min(len(waits) - 1, int(len(waits) * 0.99))] * 1e3,
            queue_wait_mean_s=float(np.mean(self.queue_wait_s)) if self.queue_wait_s else 0.0,
        )
        return result


class DaemonReplay:
    """Replays ``requests`` against a fresh daemon started in ``directory``."""

    def __init__(
        self,
        directory: Path,
        *,
        capacity_blocks: int,
        block_bytes: int = 64 << 10,
        prefill_tokens_s: float = 100_000.0,
        speed: float = 4.0,
        prefetch: bool = True,
    ) -> None:
        self.directory = directory
        self.capacity_blocks = capacity_blocks
        self.block_bytes = block_bytes
        self.prefill_tokens_s = prefill_tokens_s
        self.speed = speed
        self.prefetch = prefetch

    def replay(self, requests: Sequence[TraceRequest]) -> DaemonReplayResult:
        distinct = len({i for r in requests for i in r.hash_ids})
        dram = max(16 << 20, self.capacity_blocks * self.block_bytes)
        nvme = (distinct + 64) * (self.block_bytes + 8192) + (128 << 20)
        policy = "slsap" if self.prefetch else "lru"
        budget = "'512M'" if self.prefetch else "0"
        config = (
            f"[dram]\npolicy = '{policy}'\nprefetch_bytes_per_s = {budget}\n"
            f"[nvme]\npolicy = '{policy}'\n"
        )
        process = DaemonProcess(
            self.directory,
            dram_size=f"{dram >> 20}M",
            nvme_size=f"{nvme >> 20}M",
            config_text=config,
        )
        with process:
            return anyio.run(self._replay, process.socket, requests)

    async def _replay(self, socket: Path, requests: Sequence[TraceRequest]) -> DaemonReplayResult:
        result = DaemonReplayResult(self.prefetch)
        feed = ArrivalFeed(requests)
        send, receive = anyio.create_memory_object_stream[tuple[float, TraceRequest]](len(requests))
        block = np.full(self.block_bytes, 7, np.uint8)
        async with connect_async(socket, client_name="replay") as client:
            ns = await client.namespace("replay", block_bytes=self.block_bytes)
            t0 = time.monotonic()

            async def arrivals() -> None:
                async with send:
                    for _, request in feed.arrivals():
                        await _sleep_until(t0 + request.arrival_s / self.speed)
                        # SLSAP's prefix signal: the hits start moving up while the request queues
                        await ns.lookup(_keys(request), promote=self.prefetch)
                        await send.send((time.monotonic(), request))

            async def engine() -> None:
                async with receive:
                    async for arrived, request in receive:
                        result.queue_wait_s.append(time.monotonic() - arrived)
                        await self._serve(ns, request, block, result)

            async with anyio.create_task_group() as tg:
                tg.start_soon(arrivals)
                tg.start_soon(engine)
            result.daemon = await client.stats()
        return result

    async def _serve(
        self,
        ns: AsyncNamespace,
        request: TraceRequest,
        block: np.ndarray,
        result: DaemonReplayResult,
    ) -> None:
        keys = _keys(request)
        tiers = await ns.lookup_tiers(keys, promote=False)  # what READ is about to find
        hits = len(tiers)
        result.requests += 1
        result.blocks_read += hits
        result.blocks_in_dram_at_read += tiers.count("dram")
        if hits:
            started = time.monotonic()
            async with ns.get(keys[:hits]):
                pass
            result.read_wait_s.append(time.monotonic() - started)
        uncached_tokens = max(0, request.input_length - hits * _BLOCK_TOKENS)
        await anyio.sleep(uncached_tokens / self.prefill_tokens_s / self.speed)
        if hits < len(keys):
            await ns.put(keys[hits:], [block] * (len(keys) - hits))


def _keys(request: TraceRequest) -> list[bytes]:
    return [int(i).to_bytes(16, "little") for i in request.hash_ids]


async def _sleep_until(deadline: float) -> None:
    delay = deadline - time.monotonic()
    if delay > 0:
        await anyio.sleep(delay)
