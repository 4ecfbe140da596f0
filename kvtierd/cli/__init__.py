"""Command-line entry points: ``kvtierd`` (the daemon) and ``kvtierctl`` (the admin CLI)."""
