"""kvtierd's benchmarks, soaks and demos, run from the repository's root as ``python -m
tools.NAME`` (``python -m tools.bench_daemon --json``). Each prints JSON and, with its record
option, writes its section of ``docs/benchmarks.md`` through :mod:`tools.benchlib`. They use the
real components in :mod:`kvtierd.testing` (daemons, redis-server, network namespaces, the crash
soak), as the tests do; tools and tests never import each other."""
