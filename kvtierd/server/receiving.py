"""The session's receivers: :mod:`kvtierd.transport.receiving`, shared with the async client
(what the session uses of it; the receivers themselves are there)."""

from kvtierd.transport.receiving import Receiver, Taken, open_receiver

__all__ = ["Receiver", "Taken", "open_receiver"]
