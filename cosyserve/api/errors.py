"""OpenAI's error envelope, ``{"error": {"message", "type", "param", "code"}}``, for every failure,
and how Triton's errors map onto HTTP statuses."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from tritonclient.utils import InferenceServerException

from ..errors import is_overload

logger = logging.getLogger("cosyserve.api")
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
               413: "invalid_request_error", 422: "invalid_request_error", 429: "rate_limit_error",
               500: "server_error", 503: "service_unavailable", 504: "timeout_error"}


class APIError(Exception):
    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 retry_after_s: int | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.retry_after_s = retry_after_s

    def envelope(self) -> dict:
        return {"error": {"message": self.message, "type": ERROR_TYPES.get(self.status, "server_error"),
                          "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        headers = {"Retry-After": str(self.retry_after_s)} if self.retry_after_s is not None else None
        return JSONResponse(self.envelope(), status_code=self.status, headers=headers)


# What a refused client is told to wait (Retry-After): a queued request starts when a running one
# ends, which takes seconds; one second spreads the retries without idling a freed instance long.
RETRY_AFTER_S = 1
_UNAVAILABLE = ("statuscode.unavailable", "unknown model", "is not ready", "failed to connect", "connection refused")


def triton_error(exc: InferenceServerException) -> APIError:
    """Triton's error as an APIError with its original message.

    Errors inside a gRPC stream carry only their message: the front door's per-request errors are the
    caller's (400, or 404 for an unknown voice) unless Triton marked them internal.
    """
    message = exc.message() or str(exc)
    lowered = f"{exc.status() or ''} {message}".lower()
    if "request timed out after" in lowered:  # the front door's request_timeout_s (REQUEST_TIMEOUT_S)
        return APIError(504, message, code="timeout")
    if lowered.strip().startswith("statuscode.cancelled"):
        return APIError(499, message, code="cancelled")
    if message.startswith(("unknown voice", "unknown speaker id")):
        return APIError(404, message, param="voice", code="voice_not_found")
    if is_overload(lowered):
        return APIError(429, message, code="overloaded", retry_after_s=RETRY_AFTER_S)
    if any(part in lowered for part in _UNAVAILABLE):
        return APIError(503, message, code="triton_unavailable", retry_after_s=RETRY_AFTER_S)
    if message.startswith("internal error") or "statuscode.internal" in lowered:
        return APIError(500, message, code="triton_error")
    return APIError(400, message, code="invalid_input")


def install_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        location = [str(part) for part in first.get("loc", ()) if part not in ("body", "form")]
        param = ".".join(location) or None
        message = f"{param}: {first.get('msg', 'invalid value')}" if param else first.get("msg", "invalid request")
        return APIError(400, message, param=param, code="invalid_value").response()

    @app.exception_handler(Exception)
    async def unexpected_error(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error on %s %s", request.method, request.url.path)
        return APIError(500, f"internal error: {type(exc).__name__}: {exc}", code="internal_error").response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return APIError(exc.status_code, str(exc.detail)).response()
