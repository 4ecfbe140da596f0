"""kvtierd: a host-local daemon that tiers LLM KV-cache blocks and prefetches them.

The package is laid out by responsibility: ``protocol`` (sans-IO wire format), ``store``
(arena, index, tiers, policies), ``io`` (io_uring and thread-pool disk backends), ``slsap``
(pure prefetch engines), ``server`` (the daemon), ``client`` (the library engines link),
``pool`` (the shared tier), ``engines`` (adapters) and ``cli`` (``kvtierd``, ``kvtierctl``).
"""

__version__ = "0.1.0"
