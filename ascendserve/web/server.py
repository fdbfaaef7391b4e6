"""Serve a Litestar app with granian, in this process, until SIGTERM/SIGINT."""

from __future__ import annotations

import asyncio
import signal

from granian.constants import Interfaces
from granian.server.embed import Server


async def serve(app, host: str, port: int, backlog: int = 2048) -> None:
    server = Server(app, address=host, port=port, interface=Interfaces.ASGI, log_enabled=False,
                    backlog=backlog)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, server.stop)
    await server.serve()


def run(app, host: str, port: int) -> int:
    try:
        import uvloop

        uvloop.run(serve(app, host, port))
    except ImportError:
        asyncio.run(serve(app, host, port))
    return 0
