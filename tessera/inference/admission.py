"""Who gets into the engine: bounded admission, the body-size limit, and the refusals.

The engine's own queue is the waiting room. A request admitted here goes straight into it and
is served whole (every token delivered, or its own error: its deadline, a drain's cut). What is
bounded is how many engine requests are in flight, running or waiting: --inference-max-requests
+ --max-queued-requests (a request with n choices counts n). Past that the answer is 429 with
Retry-After, at once and before anything reaches the engine, so a flood grows neither memory nor
the latency of the requests already in. While the server drains (SIGTERM) every new request gets
503 with Retry-After. A place is free the moment its request's stream closes: it finished, its
client went away (waiting or running), or it ran past --request-timeout.
"""

from __future__ import annotations

from starlette.requests import Request

from tessera.inference.async_engine import AsyncEngine
from tessera.inference.protocol import APIError

RETRY_AFTER = {"Retry-After": "1"}   # seconds: a place frees when any request ends


class Admission:
    """At most `max_running + max_queued` engine requests in flight; none while draining."""

    def __init__(self, engine: AsyncEngine, max_running: int, max_queued: int):
        self.engine = engine
        self.capacity = max_running + max_queued
        self.draining = False

    def admit(self, count: int) -> None:
        """Raise the APIError that refuses a request of `count` engine requests, if it must be refused."""
        if self.draining:
            raise APIError("the server is shutting down: send the request again (to another replica)", status=503,
                           kind="server_error", code="shutting_down", headers=RETRY_AFTER)
        if count > self.capacity:
            raise APIError(f"{count} choices (prompts x n) in one request, and this server holds {self.capacity} at "
                           "once (--inference-max-requests + --max-queued-requests)", param="n")
        if self.engine.num_streams + count > self.capacity:
            raise APIError(f"the server is full ({self.capacity} requests running or queued): retry later",
                           status=429, kind="rate_limit_error", code="rate_limit_exceeded", headers=RETRY_AFTER)


async def read_body(request: Request, limit: int) -> bytes:
    """The request's body; 413 as soon as it is known to pass `limit` bytes (--max-request-bytes)."""
    too_large = APIError(f"the request body is larger than this server's limit of {limit} bytes "
                         "(--max-request-bytes)", status=413, code="request_too_large")
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise too_large
    chunks, size = [], 0
    async for chunk in request.stream():   # a chunked body has no length up front
        size += len(chunk)
        if size > limit:
            raise too_large
        chunks.append(chunk)
    return b"".join(chunks)
