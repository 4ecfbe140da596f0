"""A stand-in copy+hash module that copies correctly and returns a wrong hash for blocks past
xxh3's short path, as a kernel whose stripe loop were miscompiled would: the probe must refuse
it, because a wrong checksum turns every DRAM hit into a miss (or worse, a miss into a hit)."""

from __future__ import annotations

from typing import Any

import cffi
import xxhash

ffi = cffi.FFI()


class _Lib:
    @staticmethod
    def kvt_copy_xxh3(dst: Any, src: Any, length: int) -> int:
        ffi.buffer(dst, length)[:] = ffi.buffer(src, length)
        digest = xxhash.xxh3_64_intdigest(ffi.buffer(dst, length))
        return digest ^ 1 if length > 240 else digest

    @staticmethod
    def kvt_copy_xxh3_scatter(dsts: list[Any], lens: list[int], n: int, src: Any) -> int:
        state, done = xxhash.xxh3_64(), 0
        for dst, length in zip(dsts, lens, strict=True):
            ffi.buffer(dst, length)[:] = ffi.buffer(src + done, length)
            state.update(ffi.buffer(dst, length))
            done += length
        return state.intdigest()

    @staticmethod
    def kvt_copy_xxh3_runs(base: Any, offsets: Any, run: int, n: int, src: Any, length: int) -> int:
        state, done = xxhash.xxh3_64(), 0
        for i in range(n):
            take = min(run, length - done)
            ffi.buffer(base + offsets[i], take)[:] = ffi.buffer(src + done, take)
            state.update(ffi.buffer(base + offsets[i], take))
            done += take
        return state.intdigest()

    @staticmethod
    def kvt_kernel() -> Any:
        return ffi.new("char[]", b"wrong")


lib = _Lib()
