"""Reading what the daemon says last on a connection it is about to close."""

from __future__ import annotations

import socket
import ssl

import pytest

from kvtierd.errors import KvtierError
from kvtierd.protocol import ClientConnection, ReplyReceived


def last_word(sock: socket.socket, deadline_s: float) -> KvtierError | None:
    """The error of the daemon's last frame (unique id 0) on ``sock``, read until the daemon
    closes it; ``None`` if it closed without one. Fails the test if it never closes (``sock``'s
    timeout, ``deadline_s``, passed)."""
    conn = ClientConnection()
    error = None
    try:
        while data := sock.recv(1 << 16):
            conn.receive_data(data)
            event = conn.next_event()
            if isinstance(event, ReplyReceived) and event.header.unique == 0:
                error = event.error
    except (ConnectionResetError, ssl.SSLEOFError):
        pass  # what follows the frame when the daemon closed without reading all we sent
    except TimeoutError:
        pytest.fail(f"the daemon kept the connection open for {deadline_s} s")
    return error
