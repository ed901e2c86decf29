"""The synchronous engine behind an asyncio server: its step loop in a thread of its own.

`Engine` is single-threaded and steps all its requests together. Here one background
thread owns it: it takes the requests and aborts that the event loop sends it (a queue),
runs `engine.step()` while anything is unfinished, and hands each step's outputs back to
the event loop, where every request reads its own stream. The event loop never waits for
a step, so HTTP keeps flowing while the model runs.

A stream that is closed before its request finished (a client that went away, a stop
string) aborts the request. Requests beyond the engine's capacity wait in its queue.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from typing import Any, Sequence

# Commands sent to the engine thread.
_ADD, _ABORT, _STOP = "add", "abort", "stop"


class EngineDeadError(RuntimeError):
    """The engine thread stopped (a step raised, or the server is shutting down)."""


class RequestStream:
    """The outputs of a group of requests (an HTTP request's choices), as one async iterator.

    Iteration ends when every request has finished; `close()` aborts those that have not.
    """

    def __init__(self, owner: "AsyncEngine", request_ids: Sequence[str]):
        self.request_ids = list(request_ids)
        self._owner = owner
        self._queue: asyncio.Queue = asyncio.Queue()
        self._unfinished = set(self.request_ids)

    @property
    def finished(self) -> bool:
        return not self._unfinished

    def _put(self, item: Any) -> None:
        self._queue.put_nowait(item)

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self):
        if self.finished:
            raise StopAsyncIteration
        item = await self._queue.get()
        if isinstance(item, BaseException):
            self._unfinished.clear()
            raise item
        if item.finished:
            self._unfinished.discard(item.request_id)
        return item

    def close(self) -> None:
        for request_id in self.request_ids:
            self._owner._forget(request_id)
        for request_id in sorted(self._unfinished):
            self._owner.abort(request_id)
        self._unfinished.clear()


class AsyncEngine:
    """Runs an `Engine` in a background thread; `await add_requests(...)` gives a `RequestStream`.

    `start()` must be called from the event loop that will read the streams.
    """

    def __init__(self, engine):
        self.engine = engine
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, RequestStream] = {}   # touched only on the event loop's thread
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.error: BaseException | None = None

    # -- event loop side ----------------------------------------------------------------

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="tessera-engine", daemon=True)
        self._thread.start()

    def shutdown(self) -> None:
        if self._thread is not None:
            self._commands.put((_STOP,))
            self._thread.join()
            self._thread = None

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.error is None

    @property
    def num_streams(self) -> int:
        """Requests being read now."""
        return len(self._streams)

    async def add_requests(self, requests: Sequence[tuple[str, Sequence[int], Any]]) -> RequestStream:
        """Queue (request id, prompt token ids, SamplingParams) triples and read them as one stream.

        Raises the engine's ValueError for one it refuses (too long, bad params), with none queued.
        """
        if not self.alive:
            raise EngineDeadError(f"the engine is not running ({self.error!r})")
        stream = RequestStream(self, [request_id for request_id, _, _ in requests])
        accepted = []
        for request_id, prompt, params in requests:
            self._streams[request_id] = stream
            accepted.append(self._loop.create_future())
            self._commands.put((_ADD, request_id, list(prompt), params, accepted[-1]))
        try:
            await asyncio.gather(*accepted)
        except BaseException:   # refused, or the client left before the engine took them
            stream.close()
            raise
        return stream

    def abort(self, request_id: str) -> None:
        """Stop a request (thread-safe; an unknown or finished id is ignored)."""
        self._commands.put((_ABORT, request_id))

    def cut_all(self, error: BaseException) -> int:
        """End every request being read: the engine aborts it (freeing its KV blocks) and its stream
        raises `error`. Returns how many there were (a drain's deadline)."""
        request_ids = list(self._streams)
        for request_id in request_ids:
            self.abort(request_id)
        self._fail_all(error)
        return len(request_ids)

    def _forget(self, request_id: str) -> None:
        self._streams.pop(request_id, None)

    def _deliver(self, outputs: list) -> None:
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is not None:
                stream._put(output)
                if output.finished:
                    self._forget(output.request_id)

    def _fail_all(self, error: BaseException) -> None:
        for stream in set(self._streams.values()):
            stream._put(error)
        self._streams.clear()

    @staticmethod
    def _settle(future: asyncio.Future, error: BaseException | None) -> None:
        if future.done():   # the caller was cancelled meanwhile
            return
        if error is None:
            future.set_result(None)
        else:
            future.set_exception(error)

    # -- engine thread ------------------------------------------------------------------

    def _call_soon(self, callback, *args) -> None:
        try:
            self._loop.call_soon_threadsafe(callback, *args)
        except RuntimeError:   # the event loop has closed: nobody is listening any more
            pass

    def _run(self) -> None:
        try:
            while True:
                busy = self.engine.has_unfinished_requests()
                if not self._apply(self._next_commands(block=not busy)):
                    return
                if self.engine.has_unfinished_requests():
                    outputs = self.engine.step()
                    if outputs:
                        self._call_soon(self._deliver, outputs)
        except Exception as exc:  # noqa: BLE001 -- every reader must hear of it, then the loop ends
            self.error = exc
            self._call_soon(self._fail_all, EngineDeadError(f"the engine failed: {exc!r}"))
            self._refuse_pending(exc)

    def _next_commands(self, block: bool) -> list[tuple]:
        commands = [self._commands.get()] if block else []
        while True:
            try:
                commands.append(self._commands.get_nowait())
            except queue.Empty:
                return commands

    def _apply(self, commands: list[tuple]) -> bool:
        """Apply adds and aborts in arrival order; False on a stop."""
        for command in commands:
            if command[0] == _STOP:
                stopping = EngineDeadError("the server is shutting down")
                self._call_soon(self._fail_all, stopping)
                self._refuse_pending(stopping)
                return False
            if command[0] == _ABORT:
                self.engine.abort_request(command[1])
                continue
            _, request_id, prompt, params, accepted = command
            try:
                self.engine.add_request(request_id, prompt, params)
                self._call_soon(self._settle, accepted, None)
            except ValueError as exc:
                self._call_soon(self._settle, accepted, exc)
        return True

    def _refuse_pending(self, error: BaseException) -> None:
        for command in self._next_commands(block=False):
            if command[0] == _ADD:
                self._call_soon(self._settle, command[4], EngineDeadError(str(error)))
