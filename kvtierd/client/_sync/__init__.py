"""The blocking face of the client: its transport (``connection``, hand-written) and its API
(``client``, generated from :mod:`kvtierd.client._async.client` by ``python -m
tools.unasync_client``: never edit it by hand)."""
