"""Errors in OpenAI's shape, and the FastAPI handlers that guarantee every failure has it.

    {"error": {"message": str, "type": str, "param": str | None, "code": str | int | None}}

The Messages API's routes answer in Anthropic's shape instead (error_payload):

    {"type": "error", "error": {"type": str, "message": str}}

Malformed JSON, wrong types and out-of-range values are 400 (FastAPI's default is 422);
an unknown route or model is 404; an engine that cannot be reached is 503; anything
unexpected is a 500 in the same shape (and a bug to fix).
"""

from __future__ import annotations

import logging
from http import HTTPStatus
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

logger = logging.getLogger(__name__)

# Retry-After of a 503 (draining, engine unavailable), seconds: the smallest whole-second hint.
# While an app is deleted or redeployed, another replica or the new version may take the retry at once.
UNAVAILABLE_RETRY_AFTER_S = 1

_TYPE_BY_STATUS = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    503: "service_unavailable_error",
}


class OpenAIError(Exception):
    """Raised anywhere below a route; becomes an OpenAI error response."""

    def __init__(
        self,
        message: str,
        status: int = 400,
        *,
        param: str | None = None,
        code: str | int | None = None,
        error_type: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param
        self.code = code
        self.error_type = error_type or _TYPE_BY_STATUS.get(status, "server_error")
        self.headers = headers  # extra response headers (Retry-After, WWW-Authenticate)

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.error_type, self.param, self.code)


class EngineUnavailableError(OpenAIError):
    """The scheduler (or every worker) cannot be reached."""

    def __init__(self, message: str = "the engine is unavailable; retry later") -> None:
        super().__init__(message, 503, code="engine_unavailable",
                         headers={"Retry-After": str(UNAVAILABLE_RETRY_AFTER_S)})


class SchedulerGoneError(EngineUnavailableError):
    """The scheduler actor itself died mid-call (Ray restarts it): a request may be resubmitted."""


def queue_full_error(message: str, retry_after_s: int) -> OpenAIError:
    """429 with Retry-After: the engine's waiting queue is full."""
    return OpenAIError(message, 429, code="queue_full", headers={"Retry-After": str(max(0, retry_after_s))})


def draining_error() -> OpenAIError:
    """503 with Retry-After: the app (this replica, or the engine behind it) is shutting down."""
    return OpenAIError("the server is shutting down and takes no new requests; retry on another replica",
                       503, code="server_draining", headers={"Retry-After": str(UNAVAILABLE_RETRY_AFTER_S)})


def error_body(
    message: str, error_type: str, param: str | None = None, code: str | int | None = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


# Anthropic's error types by status, for the Messages API's routes (serve_app/messages.py)
_ANTHROPIC_TYPE_BY_STATUS = {
    400: "invalid_request_error", 401: "authentication_error", 403: "permission_error", 404: "not_found_error",
    408: "timeout_error", 413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error",
    504: "timeout_error",
}
ANTHROPIC_ROUTE = "/v1/messages"  # and /v1/messages/count_tokens


def speaks_anthropic(path: str) -> bool:
    """The route answers in Anthropic's shapes (a Serve route prefix may come before it)."""
    return ANTHROPIC_ROUTE in path


def anthropic_error_body(error: OpenAIError) -> dict[str, Any]:
    """{"type": "error", "error": {"type": ..., "message": ...}}: Anthropic's error shape."""
    error_type = _ANTHROPIC_TYPE_BY_STATUS.get(error.status, "api_error")
    return {"type": "error", "error": {"type": error_type, "message": error.message}}


def error_payload(error: OpenAIError, path: str = "") -> dict[str, Any]:
    """The error's body in the shape of the API the path belongs to."""
    return anthropic_error_body(error) if speaks_anthropic(path) else error.body()


def error_response(error: OpenAIError, path: str = "") -> JSONResponse:
    return JSONResponse(error_payload(error, path), status_code=error.status, headers=error.headers)


def validation_error(exc: RequestValidationError | ValidationError, context: str = "") -> OpenAIError:
    """The first pydantic error as one readable message, with its field as param (a request body's,
    or a model validated inside a route's: then `context` says what was being checked)."""
    errors = exc.errors()
    if not errors:
        return OpenAIError("invalid request body")
    first = errors[0]
    if first.get("type") == "json_invalid":
        return OpenAIError(f"request body is not valid JSON: {first.get('msg')}", code="invalid_json")
    location = [str(part) for part in first.get("loc", ()) if part != "body"]
    param = ".".join(location) or None
    message = first.get("msg", "invalid value")
    if param:
        message = f"{param}: {message}"
    if len(errors) > 1:
        message += f" (and {len(errors) - 1} more errors)"
    return OpenAIError(context + message, param=param, code="invalid_value")


def install_error_handlers(app: FastAPI) -> None:
    async def on_openai_error(request: Request, exc: OpenAIError) -> JSONResponse:
        return error_response(exc, request.url.path)

    async def on_validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(validation_error(exc), request.url.path)

    async def on_http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        phrase = HTTPStatus(exc.status_code).phrase if exc.status_code in HTTPStatus._value2member_map_ else ""
        message = exc.detail if isinstance(exc.detail, str) else phrase
        error = OpenAIError(message, exc.status_code, error_type=_TYPE_BY_STATUS.get(exc.status_code))
        return JSONResponse(error_payload(error, request.url.path), status_code=exc.status_code, headers=exc.headers)

    async def on_unexpected_error(request: Request, exc: Exception) -> JSONResponse:
        if getattr(getattr(request.app.state, "ctx", None), "draining", False):
            # a failure while the app shuts down (an executor closed, the engine gone) is the shutdown's
            logger.warning("error while draining, answered 503: %s", f"{type(exc).__name__}: {exc}"[:300])
            return error_response(draining_error(), request.url.path)
        logger.exception("unhandled error in a route")
        error = OpenAIError(f"internal error: {type(exc).__name__}", 500, error_type="server_error")
        return error_response(error, request.url.path)

    app.add_exception_handler(OpenAIError, on_openai_error)
    app.add_exception_handler(RequestValidationError, on_validation_error)
    app.add_exception_handler(StarletteHTTPException, on_http_error)
    app.add_exception_handler(Exception, on_unexpected_error)
