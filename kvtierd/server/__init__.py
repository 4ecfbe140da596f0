"""The daemon: accepts connections, dispatches requests, owns every background task."""
