"""Graceful drain: on SIGTERM, finish what is in flight (up to a deadline), then exit normally.

uvicorn alone stops listening at once on SIGTERM, waits for every open connection however long,
and then raises the signal again, so the process dies of it. Behind a load balancer or under an
orchestrator that sends SIGTERM before SIGKILL, this server does instead:

1. new requests get 503 with Retry-After, and /health 503 (the balancer routes elsewhere);
2. requests in flight run on, for up to --drain-timeout seconds;
3. what is left then is cut (each gets a 503 error), one line says how many finished and how
   many were cut, and the server shuts down; `run()` returns, so the command exits 0.

SIGINT (Ctrl-C) and a second SIGTERM keep uvicorn's own behaviour.
"""

from __future__ import annotations

import asyncio
import signal
from typing import Awaitable, Callable

import uvicorn


class DrainingServer(uvicorn.Server):
    """uvicorn's server whose SIGTERM first awaits `drain()` (see the module), then shuts down."""

    def __init__(self, config: uvicorn.Config, drain: Callable[[], Awaitable[None]]):
        super().__init__(config)
        self._drain = drain
        self._loop: asyncio.AbstractEventLoop | None = None
        self._draining = False

    async def serve(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame) -> None:
        """uvicorn's signal handler (main thread), also callable from any thread."""
        if sig != signal.SIGTERM or self._draining or self._loop is None:
            super().handle_exit(sig, frame)
            return
        self._draining = True
        self._loop.call_soon_threadsafe(lambda: asyncio.ensure_future(self._drain_then_exit()))

    async def _drain_then_exit(self) -> None:
        try:
            await self._drain()
        finally:
            self.should_exit = True
