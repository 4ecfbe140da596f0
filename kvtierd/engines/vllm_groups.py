"""Which blocks of each vLLM KV cache group a prefix hit needs, and which a group keeps: pure
policy, tested without vLLM or a daemon.

vLLM's hybrid KV cache manager splits a model's attention layers into *KV cache groups*, one
block table each: full-attention layers in one group, sliding-window layers in others (Gemma 3:
one full group and five of a 512-token window). A full-attention group reads every block before
the tokens it computes. A sliding-window group reads only the window: vLLM's
``SlidingWindowManager.get_num_skipped_tokens`` skips ``max(0, c - (window - 1) - retained)``
tokens once ``c`` are computed, puts the null block in their place, and its prefix hit of ``L``
blocks needs just the blocks from there to ``L`` (``_contiguous_blocks_for_hit``). kvtierd
follows that arithmetic exactly (:meth:`KvGroup.first_needed`), so what it restores is what
vLLM's own prefix hit would hold, group by group, and a hit is a hit only when every group has
what it needs (:meth:`CacheGroups.longest_hit`).

What a sliding-window group stores (:meth:`CacheGroups.kept`) is the window of each hit the
prompt can serve (the boundary of its default hit, ``(n - 1) // block_tokens`` blocks, and of a
whole-prompt or continuing hit, ``n // block_tokens``), plus vLLM's own
``prefix_cache_retention_interval`` checkpoints: a window every that many tokens when positive,
every block when ``None`` (vLLM's "dense"). A full-attention group stores every block.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

from kvtierd.protocol.messages import Layout

__all__ = ["CacheGroups", "KvGroup", "runs"]


@dataclass(frozen=True)
class KvGroup:
    """One vLLM KV cache group as kvtierd stores it: its layers (in vLLM's order), the layout
    of one kvtierd block of it (those layers only) and, for a sliding-window group, the window
    (tokens) and the tokens vLLM retains below it (``extra_retained_tokens``)."""

    index: int
    layer_names: tuple[str, ...]
    layout: Layout
    window_tokens: int | None = None
    retained_tokens: int = 0

    def __post_init__(self) -> None:
        if len(self.layer_names) != self.layout.layers:
            raise ValueError(f"{len(self.layer_names)} layers for a layout of {self.layout.layers}")
        if self.window_tokens is not None and self.window_tokens < 1:
            raise ValueError(f"a sliding window of {self.window_tokens} tokens")

    @property
    def windowed(self) -> bool:
        return self.window_tokens is not None

    def first_needed(self, computed_tokens: int) -> int:
        """The first block the computation after ``computed_tokens`` reads (vLLM's skipped
        tokens, in whole blocks); 0 for full attention."""
        if self.window_tokens is None:
            return 0
        reach = self.window_tokens - 1 + self.retained_tokens
        return max(0, computed_tokens - reach) // self.layout.block_tokens

    def tag(self) -> str:
        """What sets the group apart in its namespace's name: index, kind (``full`` or
        ``sw<window>``, ``+<retained>``) and a digest of its layer names, so blocks of one
        group are never served to another, nor to a vLLM that groups the layers otherwise."""
        kind = "full" if self.window_tokens is None else f"sw{self.window_tokens}"
        if self.retained_tokens:
            kind += f"+{self.retained_tokens}"
        digest = hashlib.sha256("\n".join(self.layer_names).encode()).hexdigest()[:8]
        return f"g{self.index}-{kind}-{digest}"


@dataclass(frozen=True)
class CacheGroups:
    """Every KV cache group of one engine, their common block size and vLLM's
    ``prefix_cache_retention_interval`` (tokens; 0: none, ``None``: dense)."""

    groups: tuple[KvGroup, ...]
    block_tokens: int
    retention_tokens: int | None = 0

    def __post_init__(self) -> None:
        if not self.groups:
            raise ValueError("no KV cache group")
        if [g.index for g in self.groups] != list(range(len(self.groups))):
            raise ValueError("groups must be numbered 0, 1, ... in order")
        if any(g.layout.block_tokens != self.block_tokens for g in self.groups):
            raise ValueError("every group must have blocks of the same size")
        interval = self.retention_tokens
        if interval is not None and (interval < 0 or interval % self.block_tokens):
            raise ValueError(f"a retention interval of {interval} tokens, not whole blocks")

    def needed(
        self, group: KvGroup, hit_blocks: int, prompt_tokens: int, *, beyond: int = 0
    ) -> range:
        """The blocks of ``group`` a hit of ``hit_blocks`` needs: the computation after it starts
        at the hit, or at the prompt's last token when the hit covers the whole prompt (vLLM
        computes that token again); none before block ``beyond`` (those vLLM holds itself)."""
        computed = min(hit_blocks * self.block_tokens, max(0, prompt_tokens - 1))
        return range(max(beyond, min(group.first_needed(computed), hit_blocks)), hit_blocks)

    def longest_hit(
        self,
        limit: int,
        local: int,
        prompt_tokens: int,
        stored: Callable[[KvGroup, int, int], int],
    ) -> int:
        """The longest hit of at most ``limit`` blocks beyond the ``local`` ones vLLM holds
        itself for which every group has every block it needs; ``local`` when there is none.
        ``stored(group, start, stop)`` answers how many leading blocks of ``start .. stop`` of
        ``group`` kvtierd holds (a LOOKUP); blocks before ``local`` are vLLM's own."""
        hit = limit
        for group in self.groups:
            if not group.windowed and hit > local:
                hit = local + stored(group, local, hit)
        settled = False
        while hit > local and not settled:
            settled = True
            for group in (g for g in self.groups if g.windowed):
                start = self.needed(group, hit, prompt_tokens, beyond=local).start
                have = start + stored(group, start, hit)
                if have < hit:  # block ``have`` is missing: only a hit ending before it can do
                    hit, settled = have, False
                    break
        return max(hit, local)

    def kept(self, group: KvGroup, prompt_tokens: int) -> range | frozenset[int]:
        """The blocks of a prompt of ``prompt_tokens`` that ``group`` stores (module docstring)."""
        full = prompt_tokens // self.block_tokens
        if not group.windowed or self.retention_tokens is None:
            return range(full)
        ends = {(prompt_tokens - 1) // self.block_tokens, full}
        if self.retention_tokens:
            every = self.retention_tokens // self.block_tokens
            ends.update(range(every, full + 1, every))
        blocks: set[int] = set()
        for end in ends:
            blocks.update(self.needed(group, end, prompt_tokens))
        return frozenset(blocks)


def runs(blocks: Iterable[int]) -> Iterator[range]:
    """``blocks`` (ascending, distinct) as maximal runs of consecutive blocks."""
    start = stop = -1
    for block in blocks:
        if block != stop:
            if stop > start:
                yield range(start, stop)
            start = block
        stop = block + 1
    if stop > start:
        yield range(start, stop)
