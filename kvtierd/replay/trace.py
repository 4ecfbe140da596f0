"""Request traces: the Mooncake JSONL format and the causal feed that replays it.

A Mooncake trace has one JSON object per line: ``timestamp`` (milliseconds from the start),
``input_length`` and ``output_length`` (tokens) and ``hash_ids`` (one id per 512-token block; an
id stands for the block *and everything before it*, so a request's ids form a prefix chain and
equal ids mean a shared prefix). Requests are replayed in timestamp order, file order breaking
ties.

Causality is structural. :class:`ArrivalFeed` is the only way a driver obtains requests: it hands
out a request only once the replay clock has reached its timestamp, and refuses to move the clock
backwards or to hand out a request early (:class:`CausalityError`). Online policies are built
from the capacity alone and see each request only through the calls a store would make at that
request's arrival; only a policy declared offline (Belady) is given the trace.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

import msgspec

from kvtierd.errors import KvtierError

__all__ = [
    "ArrivalFeed",
    "CausalityError",
    "TraceFormatError",
    "TraceRequest",
    "distinct_blocks",
    "parse_mooncake",
    "read_mooncake",
]


class CausalityError(KvtierError, RuntimeError):
    """A replay tried to show a request before its timestamp, or to move time backwards."""


class TraceFormatError(KvtierError, ValueError):
    """A trace line is not a valid Mooncake request."""


class TraceRequest(msgspec.Struct, frozen=True):
    """One request of a trace. ``timestamp`` in milliseconds; ``hash_ids`` in prefix order."""

    timestamp: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]

    @property
    def arrival_s(self) -> float:
        return self.timestamp / 1000.0


_decoder = msgspec.json.Decoder(TraceRequest)


def parse_mooncake(lines: Iterable[str | bytes]) -> list[TraceRequest]:
    """Requests from Mooncake JSONL lines (blank lines skipped), stably sorted by timestamp.

    Raises :class:`TraceFormatError` naming the first bad line.
    """
    requests: list[TraceRequest] = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            requests.append(_decoder.decode(line))
        except msgspec.DecodeError as exc:
            raise TraceFormatError(f"line {number}: {exc}") from exc
    requests.sort(key=lambda r: r.timestamp)
    return requests


def read_mooncake(path: str | Path) -> list[TraceRequest]:
    """Requests of the Mooncake JSONL file at ``path`` (see :func:`parse_mooncake`)."""
    with open(path, "rb") as f:
        return parse_mooncake(f)


def distinct_blocks(requests: Iterable[TraceRequest]) -> int:
    """How many different block ids the requests name."""
    seen: set[int] = set()
    for request in requests:
        seen.update(request.hash_ids)
    return len(seen)


class ArrivalFeed:
    """Hands out a trace's requests in arrival order, never before their timestamp.

    ``advance(now_ms)`` moves the replay clock (never backwards) and returns the requests that
    have arrived by then; ``arrivals()`` is the simulator's loop: it advances to each request's
    timestamp in turn. ``index`` of a released request is its position in arrival order.
    """

    def __init__(self, requests: Sequence[TraceRequest]) -> None:
        for before, after in itertools.pairwise(requests):
            if after.timestamp < before.timestamp:
                raise CausalityError(
                    f"trace goes back in time: {after.timestamp} ms after {before.timestamp} ms"
                )
        self._requests = requests
        self._next = 0
        self.now_ms = float("-inf")

    def advance(self, now_ms: float) -> list[tuple[int, TraceRequest]]:
        """Move the clock to ``now_ms`` and release every request that has arrived."""
        if now_ms < self.now_ms:
            raise CausalityError(f"clock moved back from {self.now_ms} ms to {now_ms} ms")
        self.now_ms = now_ms
        released = []
        while self._next < len(self._requests):
            request = self._requests[self._next]
            if request.timestamp > now_ms:
                break
            released.append((self._next, request))
            self._next += 1
        return released

    def check_visible(self, request: TraceRequest) -> None:
        """Raise :class:`CausalityError` if ``request`` has not arrived by the current clock."""
        if request.timestamp > self.now_ms:
            raise CausalityError(
                f"request at {request.timestamp} ms used at replay time {self.now_ms} ms"
            )

    def arrivals(self) -> Iterator[tuple[int, TraceRequest]]:
        """Every request with its arrival index, the clock advanced to each arrival in turn."""
        while self._next < len(self._requests):
            yield from self.advance(self._requests[self._next].timestamp)

    def __len__(self) -> int:
        return len(self._requests)
