"""ASGI middleware in front of every route: API key, body size limit, request metrics.

- With an API key, every route but /health needs it, as `Authorization:
  Bearer KEY` (OpenAI clients) or `x-api-key: KEY` (Anthropic clients),
  compared in constant time.
- Request bodies over `max_body_bytes` get a 413 (checked on Content-Length
  and on the bytes actually received); the body is read here once and handed
  on, so routes and the disconnect watcher see a normal ASGI receive.
- Every response is counted by route and status.
"""

from __future__ import annotations

import hmac

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from specdecode.server.errors import error_response
from specdecode.server.metrics import Metrics

OPEN_PATHS = ("/health",)
DRAIN_FACTOR = 8  # read (and drop) up to this many times the limit before a 413


class Guard:
    def __init__(self, app: ASGIApp, *, api_key: str | None, max_body_bytes: int,
                 metrics: Metrics | None) -> None:
        self.app, self.max_body_bytes, self.metrics = app, max_body_bytes, metrics
        self.api_key = api_key.encode() if api_key else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        status = 500

        async def counted_send(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self._handle(scope, receive, counted_send, path)
        finally:
            if self.metrics is not None:
                self.metrics.observe_request(path, status)

    async def _handle(self, scope: Scope, receive: Receive, send: Send, path: str) -> None:
        headers = {k.decode("latin-1").lower(): v for k, v in scope.get("headers", [])}
        if self.api_key and path.rstrip("/") not in OPEN_PATHS and not self._authorized(headers):
            response = error_response(
                path, 401, "invalid or missing API key (send 'Authorization: Bearer KEY' or "
                "'x-api-key: KEY')", code="invalid_api_key",
                headers={"WWW-Authenticate": "Bearer"})
            await response(scope, receive, send)
            return
        too_large = error_response(
            path, 413, f"the request body is larger than {self.max_body_bytes} bytes",
            code="request_too_large")
        declared = headers.get("content-length", b"")
        if declared.isdigit() and int(declared) > DRAIN_FACTOR * self.max_body_bytes:
            await too_large(scope, receive, send)
            return
        body, size, disconnected = [], 0, False
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                disconnected = True
                break
            chunk = message.get("body", b"")
            size += len(chunk)
            if size <= self.max_body_bytes:
                body.append(chunk)
            if not message.get("more_body", False) or size > DRAIN_FACTOR * self.max_body_bytes:
                break
        if size > self.max_body_bytes:
            await too_large(scope, receive, send)
            return
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                if disconnected:
                    return {"type": "http.disconnect"}
                return {"type": "http.request", "body": b"".join(body), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    def _authorized(self, headers: dict[str, bytes]) -> bool:
        assert self.api_key is not None
        auth = headers.get("authorization", b"")
        bearer = auth[7:].strip() if auth[:7].lower() == b"bearer " else b""
        x_key = headers.get("x-api-key", b"")
        return hmac.compare_digest(bearer, self.api_key) | hmac.compare_digest(x_key,
                                                                                 self.api_key)
