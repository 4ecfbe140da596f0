"""The wire protocol, sans-IO: bytes in, events out; events in, bytes out."""
