"""Errors in each API's own shape (OpenAI's; Anthropic's under /v1/messages), and the ASGI
guards that run before a body is parsed: API key and request size."""

from __future__ import annotations

import hmac
import json
import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

log = logging.getLogger(__name__)

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
          405: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error",
          500: "server_error", 503: "service_unavailable"}


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.headers = status, message, param, headers


def error_body(status: int, message: str, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": _TYPES.get(status, "server_error"),
                      "param": param, "code": status}}


# Anthropic's routes, whose errors take its shape: {"type": "error", "error": {type, message}}.
ANTHROPIC_PATHS = ("/v1/messages",)
_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                    403: "permission_error", 404: "not_found_error", 405: "invalid_request_error",
                    413: "request_too_large", 429: "rate_limit_error", 500: "api_error",
                    503: "overloaded_error"}


def anthropic_error_body(status: int, message: str) -> dict:
    return {"type": "error", "error": {"type": _ANTHROPIC_TYPES.get(status, "api_error"),
                                       "message": message}}


def error_body_for(path: str, status: int, message: str, param: str | None = None) -> dict:
    """The error body of the API that `path` belongs to."""
    if path.startswith(ANTHROPIC_PATHS):
        return anthropic_error_body(status, message)
    return error_body(status, message, param)


def error_response(path: str, status: int, message: str, param: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body_for(path, status, message, param), status_code=status,
                        headers=headers)


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    if not errors:
        return "invalid request", None
    first = errors[0]
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    param = ".".join(loc) or None
    if first.get("type") == "json_invalid":
        return f"malformed JSON body: {first.get('msg', '')}", None
    if first.get("type") == "extra_forbidden":
        return f"unsupported field {param!r}: kvserve does not implement it", param
    msg = first.get("msg", "invalid value")
    return (f"{param}: {msg}" if param else msg), param


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return error_response(request.url.path, exc.status, exc.message, exc.param,
                              exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc)
        return error_response(request.url.path, 400, message, param)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if isinstance(exc.__cause__, BodyTooLarge):  # FastAPI wraps body-read errors
            return error_response(request.url.path, 413, str(exc.__cause__))
        return error_response(request.url.path, exc.status_code, str(exc.detail), None,
                              getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _crash(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error")
        return error_response(request.url.path, 500,
                              f"internal error: {type(exc).__name__}: {exc}")


async def _send_error(send: Send, path: str, status: int, message: str,
                      headers: dict[str, str] | None = None) -> None:
    body = json.dumps(error_body_for(path, status, message)).encode()
    raw_headers = [(b"content-type", b"application/json"),
                   (b"content-length", str(len(body)).encode())]
    raw_headers += [(k.encode(), v.encode()) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": raw_headers})
    await send({"type": "http.response.body", "body": body})


class GuardMiddleware:
    """Rejects, before any parsing: a missing or wrong API key on protected paths (401,
    compared in constant time; /metrics only with its own key, aggregates being public as in
    vLLM), and bodies over `max_body_bytes` (413), whether announced by Content-Length or
    discovered while streaming in. The key comes as `Authorization: Bearer KEY` (OpenAI's
    clients) or `x-api-key: KEY` (Anthropic's)."""

    PROTECTED = ("/v1", "/tokenize", "/detokenize")

    def __init__(self, app: ASGIApp, api_key: str | None, max_body_bytes: int,
                 metrics_api_key: str | None = None) -> None:
        self.app = app
        self.api_key = api_key.encode() if api_key else None
        self.metrics_api_key = metrics_api_key.encode() if metrics_api_key else None
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        path = scope["path"]
        key = self.api_key if path.startswith(self.PROTECTED) else \
            self.metrics_api_key if path == "/metrics" else None
        if key is not None:
            auth = headers.get(b"authorization", b"")
            token = auth[7:] if auth[:7].lower() == b"bearer " else \
                headers.get(b"x-api-key", b"")
            if not hmac.compare_digest(token, key):
                await _send_error(send, path, 401, "missing or invalid API key",
                                  {"www-authenticate": "Bearer"})
                return
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body_bytes:
            await _send_error(send, path, 413, f"request body of {int(length)} bytes exceeds "
                              f"the limit of {self.max_body_bytes}")
            return
        seen = 0
        started = False

        async def guarded_receive() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_body_bytes:
                    raise BodyTooLarge(
                        f"request body exceeds the limit of {self.max_body_bytes} bytes")
            return message

        async def tracking_send(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, guarded_receive, tracking_send)
        except BodyTooLarge as e:
            if not started:
                await _send_error(send, path, 413, str(e))


class BodyTooLarge(Exception):
    pass
