"""`ascendserve doctor`: the pre-flight check of a serving host (command.py has the whole shape)."""

from ascendserve.doctor.command import main

__all__ = ["main"]
