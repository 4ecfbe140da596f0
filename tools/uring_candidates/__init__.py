"""io_uring binding candidates, as bench apparatus for ``tools/bench_io.py`` (not part of kvtierd).

Each module here is a :class:`kvtierd.io.binding.UringBinding` (``open_ring`` and ``describe``)
over a Python io_uring package other than the one kvtierd ships (the control: over that one), so
that the backend can drive it unchanged and ``bench_io.py --bindings`` can measure it beside the
shipped binding, the threads backend and fio. ``docs/io.md`` ("Choosing the io_uring binding")
records what each candidate did and why kvtierd binds the system's liburing through cffi.

* :mod:`uring_candidates.pypi_liburing`: the PyPI ``liburing`` 2026.3.x wheel, driven as the
  backend drove it before (commit 08ed047). Built for AVX-512: it dies with SIGILL elsewhere.
* :mod:`uring_candidates.liburing_2024`: PyPI ``liburing`` 2024.5.3 built from its sdist with
  generic CPU flags; it has no vectored fixed opcodes, so it runs plain ``READV``/``WRITEV``.
* :mod:`uring_candidates.cffi_plain`: the shipped cffi binding with the fixed opcodes reported
  missing, a control that shows what registered buffers are worth on the same binding.

:mod:`uring_candidates.segments` holds the buffer objects the PyPI packages need, and
``per_request.py`` times what each binding itself costs per request, away from the disk.

The packages themselves are installed outside the project (``pip install --no-deps --target
DIR``) and found through ``bench_io.py --candidate-path DIR``; kvtierd never imports them.
"""
