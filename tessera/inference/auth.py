"""API keys: with keys set, every route but /health needs `Authorization: Bearer KEY` (as vLLM's --api-key).

A pure ASGI middleware rather than a FastAPI dependency: it guards every path, unknown ones
included, before a body is read. The key sent is compared with every key in constant time
(hmac.compare_digest), so neither the time taken nor which key matched tells a caller
anything. No key appears in a log line or an answer.
"""

from __future__ import annotations

import hmac
import ipaddress
from typing import Sequence

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from tessera.inference.protocol import APIError

OPEN_PATHS = frozenset({"/health"})   # load balancers' probes carry no key


class RequireKey:
    """Answers 401 (OpenAI's error body, code `invalid_api_key`) to a request without one of `keys`."""

    def __init__(self, app: ASGIApp, keys: Sequence[str]):
        self.app = app
        self.keys = [key.encode() for key in keys]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS or self._holds_key(scope):
            await self.app(scope, receive, send)
            return
        error = APIError("a valid API key is needed: send the header 'Authorization: Bearer KEY'", status=401,
                         code="invalid_api_key")
        await JSONResponse(error.body(), status_code=401, headers={"WWW-Authenticate": "Bearer"})(scope, receive, send)

    def _holds_key(self, scope: Scope) -> bool:
        header = dict(scope["headers"]).get(b"authorization", b"")
        scheme, _, token = header.partition(b" ")
        matched = False
        for key in self.keys:   # every key, whatever matched: the time says nothing
            matched |= hmac.compare_digest(token.strip(), key)
        return matched and scheme.lower() == b"bearer"


def is_loopback(host: str) -> bool:
    """Whether `host` (an address to listen on) takes connections from this machine only."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:   # a name: it may resolve to anything
        return False
