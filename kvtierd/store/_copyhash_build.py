"""Build script of ``kvtierd.store._copyhash``: copy a block and take its xxh3-64 in one pass.

Run by setuptools at install time (``cffi_modules`` in ``setup.py``), never imported by the
daemon. Copying a block and then hashing the copy reads every byte from memory twice once the
block is larger than the L2 cache (0.65-0.73 of a plain copy's speed here). The kernels below
read each byte once: they load a 64-byte stripe of the source into vector registers, store those
registers to the destination and feed the same registers to XXH3's accumulator, so the hash
describes exactly the values stored, never a second read of a source that another client of the
tenant may be writing meanwhile. The stores are non-temporal: like glibc's ``memcpy`` for large
copies (``rep movsb``) they never read the destination's lines first, which would cost a third
stream of memory traffic. The result is XXH3-64 with the default secret and seed 0, the same
value as ``xxhash.xxh3_64_intdigest`` (the function is frozen since xxHash 0.8.0), so the
checksums on disk and on the wire do not change.

The accumulator steps are xxHash's own (its header with ``XXH_INLINE_ALL``: Debian's
``libxxhash-dev``); only the loop that walks the input is ours, and it must match
``XXH3_hashLong_internal_loop``: blocks of 16 stripes, a scramble after each, then the last
partial block and the last stripe (always the input's last 64 bytes). Destinations not aligned
to 16 bytes, blocks below 64 KiB and scatter lists (several destinations) take the piecewise
kernel instead: ``memcpy`` of a 16 KiB piece, then its hash while it is in the L1/L2 cache.

The compiler targets the generic x86-64 baseline (SSE2) whatever CFLAGS say; the AVX2 kernels
are compiled for AVX2 by a function attribute and chosen at run time from ``cpuid``, so the
module runs on every x86-64 CPU (the probe in :mod:`kvtierd.store.copyhash` proves it in a
child before any process that matters loads it). Other architectures, or a host without
xxHash's header, skip the module: kvtierd then copies and hashes in Python, 256 KiB at a time.
"""

from __future__ import annotations

import platform

import cffi

CDEF = """
uint64_t kvt_copy_xxh3(void *dst, const void *src, size_t len);
uint64_t kvt_copy_xxh3_scatter(void *const *dsts, const size_t *lens, size_t n, const void *src);
uint64_t kvt_copy_xxh3_runs(void *base, const uint64_t *offsets, size_t run_len, size_t n,
                            const void *src, size_t len);
void kvt_xxh3_each(const void *base, const uint64_t *offsets, size_t len, size_t n,
                   uint64_t *out);
const char *kvt_kernel(void);
"""

SOURCE = r"""
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include <immintrin.h>

#define XXH_INLINE_ALL
#define XXH_DISPATCH_AVX2 1
#define XXH_TARGET_AVX2 __attribute__((__target__("avx2")))
#include <xxhash.h>

/* With the default secret (192 bytes) XXH3 scrambles its accumulator every 16 stripes. */
#define KVT_STRIPES 16
#define KVT_BLOCK (KVT_STRIPES * XXH_STRIPE_LEN)
#define KVT_SECRET_SIZE sizeof(XXH3_kSecret)
/* Prefetch distance of the one-pass kernels, and their smallest block (below it the piecewise
   kernel's cached stores help whoever reads the block next more than one pass saves). One
   thread's loads wait about 100 ns on DRAM: 1 KiB ahead left the kernel at 0.67-0.89 of memcpy
   into a destination still in cache (22.5 and 32 MiB blocks); 2-6 KiB ahead ran at 1.0-1.4,
   3 KiB the steadiest. */
#define KVT_PREFETCH 3072
#define KVT_ONE_PASS_MIN (64u << 10)
/* The piecewise kernel's piece: hashed while still in the L1/L2 cache after its copy. */
#define KVT_PIECE (16u << 10)

typedef enum { KVT_SSE2, KVT_AVX2 } kvt_isa;

static kvt_isa kvt_detect(void)
{
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") ? KVT_AVX2 : KVT_SSE2;
}

/* xxh3's accumulate step on two 32-byte registers already loaded (XXH3_accumulate_512_avx2). */
XXH_TARGET_AVX2 static inline void
kvt_acc_avx2(__m256i *xacc, __m256i d0, __m256i d1, const uint8_t *secret)
{
    __m256i data[2];
    int i;
    data[0] = d0;
    data[1] = d1;
    for (i = 0; i < 2; i++) {
        __m256i const key = _mm256_loadu_si256((const __m256i *) secret + i);
        __m256i const dk = _mm256_xor_si256(data[i], key);
        __m256i const dk_lo = _mm256_shuffle_epi32(dk, _MM_SHUFFLE(0, 3, 0, 1));
        __m256i const product = _mm256_mul_epu32(dk, dk_lo);
        __m256i const swap = _mm256_shuffle_epi32(data[i], _MM_SHUFFLE(1, 0, 3, 2));
        xacc[i] = _mm256_add_epi64(product, _mm256_add_epi64(xacc[i], swap));
    }
}

/* The same on four 16-byte registers (XXH3_accumulate_512_sse2). */
static inline void
kvt_acc_sse2(__m128i *xacc, const __m128i *data, const uint8_t *secret)
{
    int i;
    for (i = 0; i < 4; i++) {
        __m128i const key = _mm_loadu_si128((const __m128i *) secret + i);
        __m128i const dk = _mm_xor_si128(data[i], key);
        __m128i const dk_lo = _mm_shuffle_epi32(dk, _MM_SHUFFLE(0, 3, 0, 1));
        __m128i const product = _mm_mul_epu32(dk, dk_lo);
        __m128i const swap = _mm_shuffle_epi32(data[i], _MM_SHUFFLE(1, 0, 3, 2));
        xacc[i] = _mm_add_epi64(product, _mm_add_epi64(xacc[i], swap));
    }
}

/* Where the one-pass kernels store: `n` runs of `run_len` bytes at base + offsets[i], filled in
   order (one run of the block's length for a contiguous copy). Every 64-byte stripe of the body
   lands inside one run: the caller sees that run_len is a multiple of 64 when n > 1. */
static const uint64_t kvt_no_offset[1] = {0};

typedef struct {
    uint8_t *base;
    const uint64_t *offsets;
    size_t run_len;
    uint8_t *at;    /* the next byte to store */
    size_t left;    /* bytes left in the current run */
    size_t run;     /* the current run */
} kvt_cursor;

static inline void kvt_cursor_init(kvt_cursor *c, uint8_t *base, const uint64_t *offsets,
                                   size_t run_len)
{
    c->base = base;
    c->offsets = offsets;
    c->run_len = run_len;
    c->at = base + offsets[0];
    c->left = run_len;
    c->run = 0;
}

/* Move the cursor `n` bytes on within its current run. */
static inline void kvt_cursor_skip(kvt_cursor *c, size_t n)
{
    c->at += n;
    c->left -= n;
}

/* The destination of the next stripe (64 bytes, all in the current run). */
static inline uint8_t *kvt_cursor_stripe(kvt_cursor *c)
{
    uint8_t *out;
    if (c->left == 0) {
        c->run++;
        c->at = c->base + c->offsets[c->run];
        c->left = c->run_len;
    }
    out = c->at;
    c->at += XXH_STRIPE_LEN;
    c->left -= XXH_STRIPE_LEN;
    return out;
}

/* Store `len` bytes from `from` at the cursor, across runs. */
static void kvt_cursor_put(kvt_cursor *c, const uint8_t *from, size_t len)
{
    while (len) {
        size_t piece;
        if (c->left == 0) {
            c->run++;
            c->at = c->base + c->offsets[c->run];
            c->left = c->run_len;
        }
        piece = len < c->left ? len : c->left;
        memcpy(c->at, from, piece);
        c->at += piece;
        c->left -= piece;
        from += piece;
        len -= piece;
    }
}

/* The end of XXH3_hashLong_internal_loop and XXH3_hashLong_64b_internal: `body` bytes are
   stored and accumulated, `tail` holds the last body stripe as stored (64 bytes); read the rest
   of the source once into `tail` after it, store it, accumulate its whole stripes, then the last
   stripe with its own secret offset, and merge. Hashing the local copy is hashing what was
   stored, wherever the runs lie. */
#define KVT_FINISH(ACC512)                                                                    \
    do {                                                                                      \
        size_t const rem = len - body;                                                        \
        size_t const stripes = (rem - 1) / XXH_STRIPE_LEN;                                    \
        size_t s;                                                                             \
        memcpy(tail + XXH_STRIPE_LEN, src + body, rem);                                       \
        kvt_cursor_put(&cur, tail + XXH_STRIPE_LEN, rem);                                     \
        for (s = 0; s < stripes; s++)                                                         \
            ACC512(acc, tail + XXH_STRIPE_LEN + s * XXH_STRIPE_LEN, XXH3_kSecret + s * 8);    \
        ACC512(acc, tail + rem, XXH3_kSecret + KVT_SECRET_SIZE - XXH_STRIPE_LEN - 7);          \
        return XXH3_mergeAccs(acc, XXH3_kSecret + 11, (xxh_u64) len * XXH_PRIME64_1);         \
    } while (0)

/* One pass, AVX2: load a stripe, store it with non-temporal 16-byte stores (the destination
   need only be 16-byte aligned), accumulate the registers. len >= 1024 + 1. With `runs` 0 the
   destination is base itself, contiguous, and the loop skips the cursor (it cost 5-10 % of the
   contiguous copy's speed); the wrappers below make the two copies of the loop. */
XXH_TARGET_AVX2 static inline __attribute__((always_inline)) uint64_t
kvt_one_pass_avx2(uint8_t *base, const uint64_t *offsets, size_t run_len,
                  const uint8_t *XXH_RESTRICT src, size_t len, int const runs)
{
    XXH_ALIGN(64) xxh_u64 acc[XXH_ACC_NB] = XXH3_INIT_ACC;
    XXH_ALIGN(64) uint8_t tail[XXH_STRIPE_LEN + KVT_BLOCK];
    size_t const body = (len - 1) / KVT_BLOCK * KVT_BLOCK;
    size_t b, s;
    __m256i d0 = _mm256_setzero_si256(), d1 = _mm256_setzero_si256();
    kvt_cursor cur;
    kvt_cursor_init(&cur, base, offsets, run_len);
    for (b = 0; b < body; b += KVT_BLOCK) {
        for (s = 0; s < KVT_STRIPES; s++) {
            const uint8_t *in = src + b + s * XXH_STRIPE_LEN;
            __m128i *out =
                (__m128i *) (runs ? kvt_cursor_stripe(&cur) : base + b + s * XXH_STRIPE_LEN);
            d0 = _mm256_loadu_si256((const __m256i *) in);
            d1 = _mm256_loadu_si256((const __m256i *) in + 1);
            _mm_prefetch((const char *) (in + KVT_PREFETCH), _MM_HINT_T0);
            _mm_stream_si128(out, _mm256_castsi256_si128(d0));
            _mm_stream_si128(out + 1, _mm256_extracti128_si256(d0, 1));
            _mm_stream_si128(out + 2, _mm256_castsi256_si128(d1));
            _mm_stream_si128(out + 3, _mm256_extracti128_si256(d1, 1));
            kvt_acc_avx2((__m256i *) acc, d0, d1, XXH3_kSecret + s * 8);
        }
        XXH3_scrambleAcc_avx2(acc, XXH3_kSecret + KVT_SECRET_SIZE - XXH_STRIPE_LEN);
    }
    _mm_sfence();
    _mm256_store_si256((__m256i *) tail, d0);
    _mm256_store_si256((__m256i *) tail + 1, d1);
    if (!runs)
        kvt_cursor_skip(&cur, body);
    KVT_FINISH(XXH3_accumulate_512_avx2);
}

/* One pass, SSE2 (every x86-64 CPU). */
static inline __attribute__((always_inline)) uint64_t
kvt_one_pass_sse2(uint8_t *base, const uint64_t *offsets, size_t run_len,
                  const uint8_t *XXH_RESTRICT src, size_t len, int const runs)
{
    XXH_ALIGN(64) xxh_u64 acc[XXH_ACC_NB] = XXH3_INIT_ACC;
    XXH_ALIGN(64) uint8_t tail[XXH_STRIPE_LEN + KVT_BLOCK];
    size_t const body = (len - 1) / KVT_BLOCK * KVT_BLOCK;
    size_t b, s;
    int i;
    __m128i data[4];
    kvt_cursor cur;
    kvt_cursor_init(&cur, base, offsets, run_len);
    for (i = 0; i < 4; i++)
        data[i] = _mm_setzero_si128();
    for (b = 0; b < body; b += KVT_BLOCK) {
        for (s = 0; s < KVT_STRIPES; s++) {
            const uint8_t *in = src + b + s * XXH_STRIPE_LEN;
            __m128i *out =
                (__m128i *) (runs ? kvt_cursor_stripe(&cur) : base + b + s * XXH_STRIPE_LEN);
            for (i = 0; i < 4; i++)
                data[i] = _mm_loadu_si128((const __m128i *) in + i);
            _mm_prefetch((const char *) (in + KVT_PREFETCH), _MM_HINT_T0);
            for (i = 0; i < 4; i++)
                _mm_stream_si128(out + i, data[i]);
            kvt_acc_sse2((__m128i *) acc, data, XXH3_kSecret + s * 8);
        }
        XXH3_scrambleAcc_sse2(acc, XXH3_kSecret + KVT_SECRET_SIZE - XXH_STRIPE_LEN);
    }
    _mm_sfence();
    for (i = 0; i < 4; i++)
        _mm_store_si128((__m128i *) tail + i, data[i]);
    if (!runs)
        kvt_cursor_skip(&cur, body);
    KVT_FINISH(XXH3_accumulate_512_sse2);
}

XXH_TARGET_AVX2 static uint64_t
kvt_one_pass_contiguous_avx2(uint8_t *dst, const uint8_t *XXH_RESTRICT src, size_t len)
{
    return kvt_one_pass_avx2(dst, kvt_no_offset, len, src, len, 0);
}

XXH_TARGET_AVX2 static uint64_t
kvt_one_pass_runs_avx2(uint8_t *base, const uint64_t *offsets, size_t run_len,
                       const uint8_t *XXH_RESTRICT src, size_t len)
{
    return kvt_one_pass_avx2(base, offsets, run_len, src, len, 1);
}

static uint64_t
kvt_one_pass_contiguous_sse2(uint8_t *dst, const uint8_t *XXH_RESTRICT src, size_t len)
{
    return kvt_one_pass_sse2(dst, kvt_no_offset, len, src, len, 0);
}

static uint64_t
kvt_one_pass_runs_sse2(uint8_t *base, const uint64_t *offsets, size_t run_len,
                       const uint8_t *XXH_RESTRICT src, size_t len)
{
    return kvt_one_pass_sse2(base, offsets, run_len, src, len, 1);
}

/* Piecewise: memcpy a piece, then accumulate it from the destination while it is cached,
   prefetching the next piece's source meanwhile. len > 240. */
#define KVT_PIECEWISE(NAME, TARGET, ACC512, SCRAMBLE)                                         \
TARGET static uint64_t                                                                        \
NAME(uint8_t *XXH_RESTRICT dst, const uint8_t *XXH_RESTRICT src, size_t len)                  \
{                                                                                             \
    XXH_ALIGN(64) xxh_u64 acc[XXH_ACC_NB] = XXH3_INIT_ACC;                                    \
    XXH_ALIGN(64) uint8_t tail[XXH_STRIPE_LEN + KVT_BLOCK];                                   \
    size_t const body = (len - 1) / KVT_BLOCK * KVT_BLOCK;                                    \
    size_t off, end, b, s;                                                                    \
    kvt_cursor cur;                                                                           \
    kvt_cursor_init(&cur, dst, kvt_no_offset, len);                                           \
    for (off = 0; off < body; off = end) {                                                    \
        end = body - off > KVT_PIECE ? off + KVT_PIECE : body;                                \
        memcpy(dst + off, src + off, end - off);                                              \
        for (b = off; b < end; b += KVT_BLOCK) {                                              \
            for (s = 0; s < KVT_STRIPES; s++) {                                               \
                size_t const ahead = b + s * XXH_STRIPE_LEN + KVT_PIECE;                      \
                if (ahead < len)                                                              \
                    _mm_prefetch((const char *) (src + ahead), _MM_HINT_T0);                  \
                ACC512(acc, dst + b + s * XXH_STRIPE_LEN, XXH3_kSecret + s * 8);              \
            }                                                                                 \
            SCRAMBLE(acc, XXH3_kSecret + KVT_SECRET_SIZE - XXH_STRIPE_LEN);                   \
        }                                                                                     \
    }                                                                                         \
    if (body)                                                                                 \
        memcpy(tail, dst + body - XXH_STRIPE_LEN, XXH_STRIPE_LEN);                            \
    kvt_cursor_skip(&cur, body);                                                              \
    KVT_FINISH(ACC512);                                                                       \
}
KVT_PIECEWISE(kvt_piecewise_avx2, XXH_TARGET_AVX2, XXH3_accumulate_512_avx2,
              XXH3_scrambleAcc_avx2)
KVT_PIECEWISE(kvt_piecewise_sse2, , XXH3_accumulate_512_sse2, XXH3_scrambleAcc_sse2)

static kvt_isa kvt_isa_found = (kvt_isa) -1;

static kvt_isa kvt_isa_now(void)
{
    if (kvt_isa_found == (kvt_isa) -1)
        kvt_isa_found = kvt_detect();  /* idempotent: a race only computes it twice */
    return kvt_isa_found;
}

/* Copy len bytes from src to dst (not overlapping); the xxh3-64 of the bytes stored. */
uint64_t kvt_copy_xxh3(void *dst, const void *src, size_t len)
{
    uint8_t *d = (uint8_t *) dst;
    const uint8_t *s = (const uint8_t *) src;
    int const avx2 = kvt_isa_now() == KVT_AVX2;
    if (len <= 240) {
        memcpy(d, s, len);
        return XXH3_64bits(d, len);
    }
    if (len >= KVT_ONE_PASS_MIN && ((uintptr_t) d & 15) == 0)
        return avx2 ? kvt_one_pass_contiguous_avx2(d, s, len)
                    : kvt_one_pass_contiguous_sse2(d, s, len);
    return avx2 ? kvt_piecewise_avx2(d, s, len) : kvt_piecewise_sse2(d, s, len);
}

/* Copy src into n destinations in order (lens[i] bytes into dsts[i]); the xxh3-64 of all the
   bytes stored, in order, by xxHash's streaming state fed each piece right after its copy. */
uint64_t kvt_copy_xxh3_scatter(void *const *dsts, const size_t *lens, size_t n, const void *src)
{
    XXH3_state_t state;
    const uint8_t *s = (const uint8_t *) src;
    size_t i, off, piece;
    XXH3_64bits_reset(&state);
    for (i = 0; i < n; i++) {
        uint8_t *d = (uint8_t *) dsts[i];
        for (off = 0; off < lens[i]; off += piece) {
            piece = lens[i] - off < KVT_PIECE ? lens[i] - off : KVT_PIECE;
            memcpy(d + off, s, piece);
            XXH3_64bits_update(&state, d + off, piece);
            s += piece;
        }
    }
    return XXH3_64bits_digest(&state);
}

/* Copy len bytes of src into n runs of run_len bytes at base + offsets[i], in order (len at
   most n * run_len; runs not overlapping each other or src); the xxh3-64 of the bytes stored.
   Runs of whole stripes at 16-byte aligned addresses take the one-pass kernel (a strided cache
   page: one run per layer and K/V); others the streaming state fed piece by piece. */
uint64_t kvt_copy_xxh3_runs(void *base, const uint64_t *offsets, size_t run_len, size_t n,
                            const void *src, size_t len)
{
    uint8_t *b = (uint8_t *) base;
    const uint8_t *s = (const uint8_t *) src;
    size_t const used = run_len ? (len + run_len - 1) / run_len : 0;
    size_t i, off, piece;
    int aligned = len >= KVT_ONE_PASS_MIN && run_len % XXH_STRIPE_LEN == 0 && used <= n;
    XXH3_state_t state;
    if (used == 1)
        return kvt_copy_xxh3(b + offsets[0], s, len);
    for (i = 0; aligned && i < used; i++)
        aligned = ((uintptr_t) (b + offsets[i]) & 15) == 0;
    if (aligned)
        return kvt_isa_now() == KVT_AVX2 ? kvt_one_pass_runs_avx2(b, offsets, run_len, s, len)
                                         : kvt_one_pass_runs_sse2(b, offsets, run_len, s, len);
    XXH3_64bits_reset(&state);
    for (i = 0; i < n && len; i++) {
        uint8_t *d = b + offsets[i];
        size_t const take = len < run_len ? len : run_len;
        for (off = 0; off < take; off += piece) {
            piece = take - off < KVT_PIECE ? take - off : KVT_PIECE;
            memcpy(d + off, s, piece);
            XXH3_64bits_update(&state, d + off, piece);
            s += piece;
        }
        len -= take;
    }
    return XXH3_64bits_digest(&state);
}

/* The xxh3-64 of each of ``n`` pieces of ``len`` bytes at ``base + offsets[i]``, into ``out``:
   the header checksums of a run of slots read at recovery, one call instead of one a slot. */
void kvt_xxh3_each(const void *base, const uint64_t *offsets, size_t len, size_t n,
                   uint64_t *out)
{
    const uint8_t *b = (const uint8_t *) base;
    size_t i;
    for (i = 0; i < n; i++)
        out[i] = XXH3_64bits(b + offsets[i], len);
}

/* Which kernels this CPU runs: "avx2" or "sse2". */
const char *kvt_kernel(void)
{
    return kvt_isa_now() == KVT_AVX2 ? "avx2" : "sse2";
}
"""

#: ``-march=x86-64`` undoes a ``-march=native``; ``-mno-avx`` also undoes an explicit ``-mavx2``
#: (the AVX2 kernels get AVX2 from their own function attribute, chosen at run time).
_GENERIC_TARGET = ["-O2", "-march=x86-64", "-mtune=generic", "-mno-avx"]

ffibuilder = cffi.FFI()
ffibuilder.cdef(CDEF)
ffibuilder.set_source(
    "kvtierd.store._copyhash",
    SOURCE,
    # Stated last so that CFLAGS in the build environment cannot widen the baseline.
    extra_compile_args=_GENERIC_TARGET if platform.machine() in ("x86_64", "AMD64") else [],
    # Elsewhere (no <immintrin.h>) and without xxhash.h the build fails and is skipped.
    optional=True,
)

if __name__ == "__main__":
    ffibuilder.compile(verbose=True)
