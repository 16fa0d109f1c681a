"""ASGI middleware in front of every route: API key, body size limit, request metrics.

- With an API key, every route but /health needs it, as `Authorization:
  Bearer KEY` (OpenAI clients) or `x-api-key: KEY` (Anthropic clients),
  compared in constant time.
- Request bodies over `max_body_bytes` get a 413 (checked on Content-Length
  and on the bytes actually received); the body is read here once and handed
  on, so routes and the disconnect watcher see a normal ASGI receive. A body
  not received in full within `body_timeout` seconds (a client that declares
  more bytes than it sends, or trickles them) gets a 408.
- A POST to a generation route with a Content-Type other than JSON gets a 415
  (no Content-Type at all is read as JSON).
- Every response is counted by route and status.
"""

from __future__ import annotations

import asyncio
import hmac

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from specdecode.server.errors import error_response
from specdecode.server.metrics import Metrics

OPEN_PATHS = ("/health",)
JSON_ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/messages")
DRAIN_FACTOR = 8  # read (and drop) up to this many times the limit before a 413


def _json_post(scope: Scope, path: str) -> bool:
    """Whether this request is a POST to a generation route (whose body is JSON)."""
    return scope.get("method") == "POST" and path.rstrip("/") in JSON_ROUTES


class Guard:
    def __init__(self, app: ASGIApp, *, api_key: str | None, max_body_bytes: int,
                 metrics: Metrics | None, body_timeout: float = 20.0) -> None:
        self.app, self.max_body_bytes, self.metrics = app, max_body_bytes, metrics
        self.body_timeout = body_timeout
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
        refusal = self._refuse_content_type(scope, headers, path)
        too_large = error_response(
            path, 413, f"the request body is larger than {self.max_body_bytes} bytes",
            code="request_too_large")
        declared = headers.get("content-length", b"")
        if refusal is None and declared.isdigit() and (
                int(declared) > DRAIN_FACTOR * self.max_body_bytes):
            refusal = too_large
        if refusal is not None:
            await refusal(scope, receive, send)
            return
        scope = self._json_by_default(scope, headers, path)
        try:
            body, size, disconnected = await asyncio.wait_for(self._read(receive),
                                                              self.body_timeout)
        except TimeoutError:
            timeout = error_response(path, 408, f"the request body was not received within "
                                     f"{self.body_timeout:g} s", code="request_timeout",
                                     headers={"Connection": "close"})
            await timeout(scope, receive, send)
            return
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

    async def _read(self, receive: Receive) -> tuple[list[bytes], int, bool]:
        """(body chunks kept, bytes received, whether the client disconnected)."""
        body, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return body, size, True
            chunk = message.get("body", b"")
            size += len(chunk)
            if size <= self.max_body_bytes:
                body.append(chunk)
            if not message.get("more_body", False) or size > DRAIN_FACTOR * self.max_body_bytes:
                return body, size, False

    @staticmethod
    def _refuse_content_type(scope: Scope, headers: dict[str, bytes], path: str):
        """A 415 response for a non-JSON body on a generation route, else None."""
        if not _json_post(scope, path):
            return None
        raw = headers.get("content-type")
        if raw is None:
            return None
        media = raw.decode("latin-1").split(";", 1)[0].strip().lower()
        if media == "application/json" or media.endswith("+json"):
            return None
        shown = media[:64] + ("..." if len(media) > 64 else "")
        return error_response(path, 415, f"unsupported Content-Type '{shown}': send the body "
                              "as JSON with 'Content-Type: application/json'",
                              code="unsupported_media_type")

    @staticmethod
    def _json_by_default(scope: Scope, headers: dict[str, bytes], path: str) -> Scope:
        """A generation route's POST without a Content-Type, marked as JSON: the routes'
        body parsing (FastAPI's strict content type) would otherwise not read it."""
        if not _json_post(scope, path) or "content-type" in headers:
            return scope
        return {**scope, "headers": [*scope.get("headers", []),
                                     (b"content-type", b"application/json")]}

    def _authorized(self, headers: dict[str, bytes]) -> bool:
        assert self.api_key is not None
        auth = headers.get("authorization", b"")
        bearer = auth[7:].strip() if auth[:7].lower() == b"bearer " else b""
        x_key = headers.get("x-api-key", b"")
        return hmac.compare_digest(bearer, self.api_key) | hmac.compare_digest(x_key,
                                                                                 self.api_key)
