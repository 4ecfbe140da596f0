"""What the vLLM connector decides, without I/O: which blocks of a request to load from kvtierd
and which to save, step by step, group by group, and the connector's settings.

A request's prompt is cut into vLLM blocks of ``block_tokens``; block ``i`` of KV cache group
``g`` has kvtierd key ``keys[g][i]`` (:func:`kvtierd.keys.chain_keys` under the group's
namespace salt, so key ``i`` names every token up to the end of block ``i``). vLLM must compute
at least the last prompt token itself, so at most ``(len(prompt) - 1) // block_tokens`` blocks
are ever loaded during the forward. Which blocks of each group a hit needs and which a group
stores is :mod:`kvtierd.engines.vllm_groups`'s. The connector (``vllm.py``) asks the daemon and
carries out what a :class:`RequestPlan` says; everything here is plain data and arithmetic,
tested without vLLM or a daemon.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kvtierd.engines.vllm_groups import CacheGroups, runs

__all__ = ["BlockRun", "ConnectorSettings", "Promotion", "RequestPlan", "loadable_blocks"]


def loadable_blocks(prompt_tokens: int, block_tokens: int, *, before_forward: bool = False) -> int:
    """How many leading blocks of a prompt may come from outside. Loaded during the forward
    that computes the rest (vLLM's synchronous loads): every full block that ends before the
    last prompt token, which vLLM computes to produce the first output. Loaded before that
    forward (``before_forward``: vLLM's asynchronous loads, after which vLLM recomputes only the
    last token): every full block."""
    if prompt_tokens <= 0:
        return 0
    return (prompt_tokens if before_forward else prompt_tokens - 1) // block_tokens


@dataclass(frozen=True)
class BlockRun:
    """Blocks ``first .. first + len(keys)`` of one request in KV cache group ``group``: their
    kvtierd keys and the vLLM block ids (paged KV slots) they occupy, one to one."""

    request_id: str
    first: int
    keys: tuple[bytes, ...]
    block_ids: tuple[int, ...]
    #: Loaded before the request is scheduled (every layer at once), not during its forward.
    before_forward: bool = False
    group: int = 0

    def __post_init__(self) -> None:
        if len(self.keys) != len(self.block_ids):
            raise ValueError(f"{len(self.keys)} keys for {len(self.block_ids)} block ids")


@dataclass
class RequestPlan:
    """One request as the scheduler side sees it.

    ``keys`` are the prompt's full-block keys, one tuple per group of ``cache``; ``stored`` the
    hit kvtierd served at lookup, in blocks (never saved again); ``load`` the blocks promised
    to vLLM (``first`` = the blocks vLLM already had itself); ``saved`` how many leading blocks
    are in kvtierd or on their way there; ``block_ids`` the request's vLLM blocks in order, one
    list per group, as the scheduler allocates them (``null_block``: vLLM's placeholder for a
    block a sliding window skipped, never loaded into nor saved).
    """

    request_id: str
    prompt_tokens: int
    keys: tuple[tuple[bytes, ...], ...]
    cache: CacheGroups
    null_block: int | None = None
    stored: int = 0
    load_first: int = 0
    load_count: int = 0
    load_sent: bool = False
    load_before_forward: bool = False
    saved: int = 0
    block_ids: list[list[int]] = field(default_factory=list)
    _kept: list[range | frozenset[int]] = field(default_factory=list, repr=False)

    def __post_init__(self) -> None:
        if len(self.keys) != len(self.cache.groups):
            raise ValueError(f"keys for {len(self.keys)} groups, not {len(self.cache.groups)}")

    def promise(self, local_blocks: int, stored: int, *, before_forward: bool = False) -> int:
        """Record a lookup: vLLM holds ``local_blocks`` itself, kvtierd a hit of ``stored``
        blocks (loaded ``before_forward`` or during it). Returns the blocks promised to vLLM
        (tokens = that times ``block_tokens``)."""
        self.load_before_forward = before_forward
        self.stored = stored
        self.load_first = local_blocks
        self.load_count = max(0, stored - local_blocks)
        self.load_sent = False  # asked again (a preempted request resumes): load again
        self.saved = max(self.saved, stored)
        return self.load_count

    def allocated(
        self, block_ids: Sequence[Sequence[int]], promised_tokens: int, block_tokens: int
    ) -> None:
        """vLLM allocated ``block_ids`` (all of the request's blocks so far, per group) and will
        load ``promised_tokens`` from the connector (0: it changed its mind; load nothing)."""
        self.block_ids = [list(ids) for ids in block_ids]
        self.load_count = min(self.load_count, promised_tokens // block_tokens)

    def take_load(self) -> list[BlockRun]:
        """The loads to send with the next step, once: per group, the blocks the hit needs
        beyond vLLM's own (a sliding window's only)."""
        if self.load_sent or self.load_count == 0:
            return []
        self.load_sent = True
        first, stop = self.load_first, self.load_first + self.load_count
        loads = []
        for group in self.cache.groups:
            ids = self.block_ids[group.index] if group.index < len(self.block_ids) else []
            if stop > len(ids):
                raise ValueError(f"load of blocks {first}..{stop} but {len(ids)} allocated")
            start = self.cache.needed(group, stop, self.prompt_tokens, beyond=first).start
            while start < stop and ids[start] == self.null_block:
                start += 1  # skipped by vLLM's window (it reads none of them)
            if start < stop:
                loads.append(self._run(group.index, range(start, stop), self.load_before_forward))
        return loads

    def take_save(self, computed_tokens: int, block_tokens: int) -> list[BlockRun]:
        """The blocks that are complete once ``computed_tokens`` of the request are computed
        and not yet in kvtierd (prompt blocks only, those each group keeps), once each."""
        full = min(computed_tokens, self.prompt_tokens) // block_tokens
        full = min(full, len(self.keys[0]), *(len(ids) for ids in self.block_ids or [[]]))
        if full <= self.saved:
            return []
        first, self.saved = self.saved, full
        if not self._kept:
            self._kept = [self.cache.kept(g, self.prompt_tokens) for g in self.cache.groups]
        saves = []
        for group in self.cache.groups:
            g = group.index
            ids, kept = self.block_ids[g], self._kept[g]
            blocks = (i for i in range(first, full) if i in kept and ids[i] != self.null_block)
            saves += [self._run(g, run) for run in runs(blocks)]
        return saves

    def _run(self, group: int, blocks: range, before_forward: bool = False) -> BlockRun:
        ids = self.block_ids[group]
        return BlockRun(
            self.request_id,
            blocks.start,
            self.keys[group][blocks.start : blocks.stop],
            tuple(ids[blocks.start : blocks.stop]),
            before_forward,
            group,
        )


@dataclass
class Promotion:
    """Whether the scheduler should ask again for a request whose kvtierd hits are not all in
    DRAM yet (LOOKUP started moving them up from NVMe): yes while the DRAM-resident prefix keeps
    growing, until it has not grown for ``stall_s`` or ``max_wait_s`` have passed since the
    first ask. Then the rest is read by the worker (the worker waits, not the scheduler)."""

    first_asked: float
    max_wait_s: float
    stall_s: float = 0.5
    best: int = -1
    grew_at: float = 0.0

    def ask_again(self, resident: int, now: float) -> bool:
        if resident > self.best:
            self.best, self.grew_at = resident, now
        return now - self.first_asked < self.max_wait_s and now - self.grew_at < self.stall_s


@dataclass(frozen=True)
class ConnectorSettings:
    """``kv_connector_extra_config`` keys (all optional).

    ``socket``: the daemon's socket (default: ``$KVTIERD_SOCKET`` or the configured path);
    ``tenant``: the kvtierd tenant; ``model_id``: names the weights (default: vLLM's model
    path or name, its revision and quantisation); ``namespace``: overrides the namespace name;
    ``wait_for_promotion_s``: how long the scheduler keeps asking again for hits that are still
    coming up from NVMe before the worker reads them itself (default 2 s); ``timeout_s``: bounds
    every request to the daemon (default 30 s: a READ includes its NVMe reads);
    ``whole_prompt``: load every block of a prompt kvtierd holds whole before the forward, so
    vLLM computes only the last token (faster by a block of compute, but not what vLLM's own
    cache gives: bf16 attention over another split of cached and computed tokens rounds
    differently). Default false: the last block is computed, as vLLM's own prefix cache does,
    and the result is bitwise that of vLLM's own hit."""

    socket: str | None = None
    tenant: str = "default"
    model_id: str | None = None
    namespace: str | None = None
    wait_for_promotion_s: float = 2.0
    timeout_s: float = 30.0
    whole_prompt: bool = False

    @classmethod
    def from_extra(cls, extra: dict[str, Any]) -> ConnectorSettings:
        known = {
            "socket", "tenant", "model_id", "namespace", "wait_for_promotion_s", "timeout_s",
            "whole_prompt",
        }  # fmt: skip
        unknown = sorted(set(extra) - known)
        if unknown:
            raise ValueError(
                f"unknown kvtierd connector option(s) {unknown}; known: {sorted(known)}"
            )
        for name in ("socket", "tenant", "model_id", "namespace"):
            if name in extra and not (isinstance(extra[name], str) and extra[name]):
                raise ValueError(f"kvtierd connector option {name!r} must be a non-empty string")
        wait = _seconds(extra, "wait_for_promotion_s", cls.wait_for_promotion_s, low=0.0)
        timeout = _seconds(extra, "timeout_s", cls.timeout_s, low=0.1)
        whole = extra.get("whole_prompt", cls.whole_prompt)
        if not isinstance(whole, bool):
            raise ValueError(f"whole_prompt must be true or false, got {whole!r}")
        return cls(
            socket=extra.get("socket"),
            tenant=extra.get("tenant", "default"),
            model_id=extra.get("model_id"),
            namespace=extra.get("namespace"),
            wait_for_promotion_s=wait,
            timeout_s=timeout,
            whole_prompt=whole,
        )


def _seconds(extra: dict[str, Any], name: str, default: float, *, low: float) -> float:
    value = extra.get(name, default)
    if isinstance(value, bool) or not isinstance(value, int | float) or not low <= value <= 600:
        raise ValueError(f"{name} must be seconds within {low:g}..600, got {value!r}")
    return float(value)
