"""The session's receivers: :mod:`kvtierd.transport.receiving`, shared with the async client."""

from kvtierd.transport.receiving import (
    ReadinessReceiver,
    Receiver,
    StreamReceiver,
    Taken,
    WaitingReceiver,
    open_receiver,
)

__all__ = [
    "ReadinessReceiver",
    "Receiver",
    "StreamReceiver",
    "Taken",
    "WaitingReceiver",
    "open_receiver",
]
