"""Socket I/O shared by the daemon and the async client: how a connection's bytes (and the
descriptors passed with them) are read on asyncio and trio. No import from ``server`` or
``client``: both sides use it."""
