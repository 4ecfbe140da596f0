"""NIXL transfers out of the daemon's arena regions (issue 19).

:mod:`kvtierd.nixl.probe` proves in a child process that NIXL works here before any process
that cannot die loads it; :mod:`kvtierd.nixl.agent` owns one NIXL agent. Nothing here imports
NIXL at import time.
"""
