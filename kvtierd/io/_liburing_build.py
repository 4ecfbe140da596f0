"""Build script of ``kvtierd.io._liburing``: the system's liburing, reached through cffi.

Run by setuptools at install time (``cffi_modules`` in ``setup.py``), never imported by the
daemon. It compiles a small C module against the distribution's liburing (Debian's
``liburing-dev``, Fedora's ``liburing-devel``) with the compiler's generic target, so the
result runs on every x86-64 CPU the distribution supports: no ``-march`` beyond the baseline,
whatever the build machine has (the PyPI ``liburing`` wheel was built for AVX-512 and dies with
SIGILL elsewhere).

The C side is deliberately small: liburing's inline ``io_uring_prep_*`` helpers cannot be called
through an ABI binding, so each request kind is one C function that claims an SQE, prepares it
and tags it in a single call, and completions are reaped in batches into caller arrays. The
fixed vectored opcodes (``READV_FIXED``/``WRITEV_FIXED``, Linux 6.15) are newer than some
distributions' liburing headers; they are ordinary read/write SQEs with another opcode and a
buffer index, so the opcode number comes from the caller (the kernel's UAPI value). Only
liburing 2.0's API is used (tags and cancel flags are set on the SQE's fields, not through the
2.2 helpers), so the distributions of the last years all build it; checked with Debian's 2.3.

The extension is optional: without liburing's headers the build skips it with a warning and
kvtierd uses its thread-pool backend (``kvtierd --check`` says why).
"""

from __future__ import annotations

import platform

import cffi

CDEF = """
struct io_uring { ...; };
struct iovec { void *iov_base; size_t iov_len; };

int io_uring_queue_init(unsigned entries, struct io_uring *ring, unsigned flags);
void io_uring_queue_exit(struct io_uring *ring);
int io_uring_submit(struct io_uring *ring);
int io_uring_register_eventfd(struct io_uring *ring, int fd);
int io_uring_register_buffers(struct io_uring *ring, const struct iovec *iovecs, unsigned nr);
unsigned io_uring_cq_ready(const struct io_uring *ring);

int kvt_prep_rw(struct io_uring *ring, int opcode, int fd, const struct iovec *iovecs,
                unsigned nr, uint64_t offset, int buf_index, uint64_t user_data);
int kvt_prep_fsync(struct io_uring *ring, int fd, unsigned flags, uint64_t user_data);
int kvt_prep_nop(struct io_uring *ring, uint64_t user_data);
int kvt_prep_cancel_all(struct io_uring *ring, uint64_t user_data);
unsigned kvt_reap(struct io_uring *ring, uint64_t *user_data, int32_t *results, unsigned max);
int kvt_opcode_supported(struct io_uring *ring, int opcode);
int kvt_version(int *major, int *minor);
const char *kvt_library_path(void);
"""

SOURCE = r"""
#include <dlfcn.h>
#include <errno.h>
#include <stdint.h>
#include <liburing.h>

/* The cancel flags of Linux 5.19, by their UAPI values: headers before liburing 2.2 lack them. */
#define KVT_ASYNC_CANCEL_ALL (1U << 0)
#define KVT_ASYNC_CANCEL_ANY (1U << 2)

/* Each prep claims an SQE, prepares it and tags it in one call: -EBUSY when the SQ is full. */

/* A vectored read or write; buf_index >= 0 makes it a fixed-buffer request (opcode given). */
int kvt_prep_rw(struct io_uring *ring, int opcode, int fd, const struct iovec *iovecs,
                unsigned nr, uint64_t offset, int buf_index, uint64_t user_data)
{
    struct io_uring_sqe *sqe = io_uring_get_sqe(ring);
    if (sqe == NULL)
        return -EBUSY;
    io_uring_prep_rw(opcode, sqe, fd, iovecs, nr, offset);
    if (buf_index >= 0)
        sqe->buf_index = (__u16) buf_index;
    sqe->user_data = user_data;
    return 0;
}

int kvt_prep_fsync(struct io_uring *ring, int fd, unsigned flags, uint64_t user_data)
{
    struct io_uring_sqe *sqe = io_uring_get_sqe(ring);
    if (sqe == NULL)
        return -EBUSY;
    io_uring_prep_fsync(sqe, fd, flags);
    sqe->user_data = user_data;
    return 0;
}

int kvt_prep_nop(struct io_uring *ring, uint64_t user_data)
{
    struct io_uring_sqe *sqe = io_uring_get_sqe(ring);
    if (sqe == NULL)
        return -EBUSY;
    io_uring_prep_nop(sqe);
    sqe->user_data = user_data;
    return 0;
}

/* Ask the kernel to cancel every request of this ring. */
int kvt_prep_cancel_all(struct io_uring *ring, uint64_t user_data)
{
    struct io_uring_sqe *sqe = io_uring_get_sqe(ring);
    if (sqe == NULL)
        return -EBUSY;
    io_uring_prep_rw(IORING_OP_ASYNC_CANCEL, sqe, -1, NULL, 0, 0);
    sqe->cancel_flags = KVT_ASYNC_CANCEL_ALL | KVT_ASYNC_CANCEL_ANY;
    sqe->user_data = user_data;
    return 0;
}

/* Copy up to max completions out and mark them seen; returns how many. */
unsigned kvt_reap(struct io_uring *ring, uint64_t *user_data, int32_t *results, unsigned max)
{
    struct io_uring_cqe *cqe;
    unsigned head, n = 0;
    io_uring_for_each_cqe(ring, head, cqe) {
        if (n == max)
            break;
        user_data[n] = cqe->user_data;
        results[n] = cqe->res;
        n++;
    }
    io_uring_cq_advance(ring, n);
    return n;
}

/* 1 when the kernel supports the opcode, 0 when not, -errno when it cannot be asked. */
int kvt_opcode_supported(struct io_uring *ring, int opcode)
{
    struct io_uring_probe *probe = io_uring_get_probe_ring(ring);
    int supported;
    if (probe == NULL)
        return -ENOSYS;
    supported = io_uring_opcode_supported(probe, opcode);
    io_uring_free_probe(probe);
    return supported;
}

/* The file liburing was loaded from ("" when linked in statically), as the dynamic linker says. */
const char *kvt_library_path(void)
{
    Dl_info info;
    if (dladdr((void *) &io_uring_queue_init, &info) && info.dli_fname != NULL)
        return info.dli_fname;
    return "";
}

/* The liburing version this module was compiled against. */
int kvt_version(int *major, int *minor)
{
#ifdef IO_URING_VERSION_MAJOR
    *major = IO_URING_VERSION_MAJOR;
    *minor = IO_URING_VERSION_MINOR;
    return 0;
#else
    *major = 0;
    *minor = 0;
    return -1;
#endif
}
"""

#: ``-march=x86-64`` undoes a ``-march=native``; ``-mno-avx`` also undoes an explicit ``-mavx2``
#: or ``-mavx512f`` (each implies AVX, and turning AVX off turns them off).
_GENERIC_TARGET = {"x86_64": ["-march=x86-64", "-mtune=generic", "-mno-avx"]}

ffibuilder = cffi.FFI()
ffibuilder.cdef(CDEF)
ffibuilder.set_source(
    "kvtierd.io._liburing",
    SOURCE,
    libraries=["uring"],
    # The generic target, stated last so that CFLAGS in the build environment (-march=native,
    # -mavx512f) cannot make the module unusable on the next host.
    extra_compile_args=_GENERIC_TARGET.get(platform.machine(), []),
    optional=True,
)

if __name__ == "__main__":
    ffibuilder.compile(verbose=True)
