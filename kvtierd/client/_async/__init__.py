"""The async face of the client: its transport (``connection``, hand-written) and its API
(``client``, the one source :mod:`kvtierd.client._sync.client` is generated from)."""
