"""`ascendserve status`: a running cluster at a glance (command.py has the whole shape)."""

from ascendserve.status.command import main

__all__ = ["main"]
