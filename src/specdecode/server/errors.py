"""Error responses in the shape each API's clients expect, and the handlers that send them.

OpenAI routes answer `{"error": {"message", "type", "param", "code"}}`; the
Anthropic route (/v1/messages) answers `{"type": "error", "error": {"type",
"message"}}`. Every handler here turns bad input into a 4xx with one of these
bodies: no 5xx and no traceback for anything a client can send.
"""

from __future__ import annotations

import json
import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger("specdecode.server")

OPENAI_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                404: "not_found_error", 405: "invalid_request_error",
                408: "invalid_request_error", 413: "invalid_request_error",
                415: "invalid_request_error", 422: "invalid_request_error",
                429: "rate_limit_error", 500: "server_error", 503: "server_error"}
ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                   404: "not_found_error", 405: "invalid_request_error",
                   408: "invalid_request_error", 413: "request_too_large",
                   415: "invalid_request_error", 422: "invalid_request_error",
                   429: "rate_limit_error", 500: "api_error", 503: "overloaded_error"}


class APIError(Exception):
    """A request the server refuses; the handler renders it in the route's API shape."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers


def is_anthropic(path: str) -> bool:
    return path.rstrip("/") == "/v1/messages"


def shorten(text: str, limit: int = 64) -> str:
    """`text`, or its first `limit` characters and how long it was (for echoing input)."""
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def error_body(path: str, status: int, message: str, param: str | None = None,
               code: str | None = None) -> dict:
    """The JSON body of an error for a request to `path`."""
    if is_anthropic(path):
        kind = ANTHROPIC_TYPES.get(status, "invalid_request_error")
        return {"type": "error", "error": {"type": kind, "message": message}}
    kind = OPENAI_TYPES.get(status, "invalid_request_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


class AsciiJSONResponse(JSONResponse):
    """JSON with non-ASCII escaped: an echoed lone surrogate cannot break the encoding."""

    def render(self, content: object) -> bytes:
        return json.dumps(content, ensure_ascii=True, separators=(",", ":")).encode()


def error_response(path: str, status: int, message: str, param: str | None = None,
                   code: str | None = None, headers: dict | None = None) -> JSONResponse:
    return AsciiJSONResponse(error_body(path, status, message, param, code),
                             status_code=status, headers=headers)


def _loc(loc: tuple) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def describe_validation(errors: list[dict]) -> tuple[int, str, str | None]:
    """(status, message, param) for pydantic errors on a request body.

    A body that is not a JSON object is the wrong shape (422); a bad or missing
    field is an invalid request (400). Union members show up as extra errors
    under one field; they are folded into one message.
    """
    if not errors:
        return 400, "invalid request body", None
    locs = [tuple(p for p in e.get("loc", ()) if p != "body") for e in errors]
    first = errors[0]
    if first.get("type") == "json_invalid":
        return 400, f"the request body is not valid JSON: {first.get('msg', '')}", None
    if not locs[0]:
        return 422, "the request body must be a JSON object", None
    common = locs[0]
    for loc in locs[1:]:
        n = 0
        while n < min(len(common), len(loc)) and common[n] == loc[n]:
            n += 1
        common = common[:n]
    if len(errors) == 1:
        common = locs[0]
    param = _loc(common) or None
    if first.get("type") == "missing":
        return 400, f"missing required field '{param}'", param
    messages = list(dict.fromkeys(str(e.get("msg", "invalid value")) for e in errors))
    return 400, f"invalid value for '{param}': {' or '.join(messages)}", param


def install_handlers(app: FastAPI) -> None:
    """Route every error through the API shapes above."""

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return error_response(request.url.path, exc.status, exc.message, exc.param, exc.code,
                              headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        status, message, param = describe_validation(list(exc.errors()))
        return error_response(request.url.path, status, message, param)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        path = request.url.path
        if exc.status_code == 404:
            return error_response(path, 404, f"no route {request.method} {shorten(path)}",
                                  code="unknown_url")
        if exc.status_code == 405:
            return error_response(path, 405, f"method {request.method} is not allowed on "
                                             f"{shorten(path)}", headers=exc.headers)
        return error_response(path, exc.status_code, str(exc.detail), headers=exc.headers)

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> JSONResponse:
        log.exception("internal error on %s", request.url.path)
        return error_response(request.url.path, 500, "internal server error")
