"""Tests use the package's own daemon supervisor (also used by the tools and the demo)."""

from kvtierd.testing import DaemonProcess

__all__ = ["DaemonProcess"]
