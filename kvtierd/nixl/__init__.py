"""NIXL transfers out of the daemon's arena regions (issue 19), an optional extra
(``kvtierd[nixl]``; ``docs/nixl.md``).

:mod:`kvtierd.nixl.probe` proves in a child process that NIXL works here before any process
that cannot die loads it; :mod:`kvtierd.nixl.agent` owns one NIXL agent (made through
:func:`~kvtierd.nixl.agent.start_agent` after the probe) and maps NIXL's errors;
:mod:`kvtierd.nixl.descriptors` is the pure, pickle-free format of the extents an owner hands a
puller; :mod:`kvtierd.nixl.export` is the daemon's side: each tenant region exported by a
process of its own (:mod:`kvtierd.nixl.exporter`, run and restarted by
:mod:`kvtierd.nixl.exporters` over :mod:`kvtierd.nixl.control`'s frames, with
:mod:`kvtierd.nixl.restarts`' back-off), so that the daemon's process never loads NIXL and a
NIXL peer can reach no memory but its tenant's region. Nothing here imports NIXL at import
time.
"""
