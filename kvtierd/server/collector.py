"""The daemon's garbage-collection policy: full collections that never hold the loop long.

Theory of operation. CPython frees almost everything by reference counting; its cyclic
collector exists for reference cycles. A full (generation 2) collection walks every tracked
object the process holds, and no slice of :mod:`kvtierd.store.slicing` can interrupt it: with
the index of a large store (several objects per block) one took 100-300 ms on this project's
machines, and other clients' LOOKUPs waited that long (issue 31, ``tools/bench_loop.py``).

``gc.freeze()`` moves every object the collector tracks into a permanent generation that no
collection walks. So the daemon
freezes what it holds once it serves (the recovered index, modules, configuration), and then
every :data:`FREEZE_EVERY_S`, after a young collection (generations 0 and 1: cycles among new
objects, cheap) has freed what died young. A full collection then walks only what was made
since the last freeze.

The price: a cycle among frozen objects that becomes garbage is not collected while it stays
frozen. The daemon's long-lived objects (blocks, namespaces, sessions) are freed by reference
counting when they go, so that is rare; to bound it anyway, every :data:`THAW_EVERY_S` the
permanent generation is thawed, collected once in full (one pause of the old kind, logged with
its length), and frozen again.
"""

from __future__ import annotations

import gc
import logging
import time

import anyio

__all__ = ["FREEZE_EVERY_S", "THAW_EVERY_S", "freeze_long_lived", "serve_collector"]

log = logging.getLogger("kvtierd")

#: How often what survived the young collections is frozen.
FREEZE_EVERY_S = 10.0
#: How often the frozen objects are collected once in full.
THAW_EVERY_S = 3600.0


def freeze_long_lived() -> None:
    """Free the young cycles, then freeze every object the collector tracks now."""
    gc.collect(1)
    gc.freeze()


def _thaw_and_collect() -> None:
    started = time.perf_counter()
    gc.unfreeze()
    freed = gc.collect()
    gc.freeze()
    log.info(
        "garbage collection of the long-lived objects: %d freed in %.0f ms",
        freed, (time.perf_counter() - started) * 1000,
    )  # fmt: skip


async def serve_collector(
    freeze_every_s: float = FREEZE_EVERY_S, thaw_every_s: float = THAW_EVERY_S
) -> None:
    """Freeze the long-lived objects now and every ``freeze_every_s``, and collect them in full
    every ``thaw_every_s``; runs until cancelled (thawing everything then)."""
    freeze_long_lived()
    last_thaw = time.monotonic()
    try:
        while True:
            await anyio.sleep(freeze_every_s)
            if time.monotonic() - last_thaw >= thaw_every_s:
                _thaw_and_collect()
                last_thaw = time.monotonic()
            else:
                freeze_long_lived()
    finally:
        gc.unfreeze()
