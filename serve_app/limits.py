"""Server-side input limits, and the ASGI middleware that caps request body size.

Bounds that never change (types, finite numbers, temperature in [0, 2], at most 64 choices,
16 stop strings, 20 logprobs, ...) are in the pydantic models (protocol.py). The operator's
limits below are checked once the prompt is tokenized (sampling.py) and give a 400 naming
the field; the body size is checked before anything is parsed and gives a 413:

- Content-Length over max_body_bytes: refused at once, the body is never read;
- no Content-Length (chunked upload) or a lying one: bytes are counted as they arrive and
  the request is refused as soon as the count passes the limit (the rest is not read).

Per-request timeout: the body field `timeout` (seconds, >0) asks for a deadline; the server
uses min(timeout or default_timeout_s, max_timeout_s). At the deadline the engine request
is aborted (its KV blocks freed at once) and each unfinished choice ends with
finish_reason "timeout" and the text generated so far; a prompt with no token yet fails
the request (code "timeout"): 408 when the request's own `timeout` expired, 504 when the
server's default did.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from serve_app.errors import OpenAIError, error_payload
from serve_app.protocol import MAX_N

Scope = dict[str, Any]


@dataclass(frozen=True, slots=True)
class ServerLimits:
    max_body_bytes: int = 8 << 20  # request body size; larger: 413
    max_n: int = MAX_N  # sequences per prompt (<= protocol.MAX_N)
    max_choices: int = 256  # prompts x n in one request
    max_tokens: int | None = None  # output tokens per sequence; None: up to the context
    max_prompt_tokens: int | None = None  # prompt tokens; None: up to the context (max_model_len - 1)
    default_timeout_s: float | None = 600.0  # deadline of a request that sets none; None: no deadline
    max_timeout_s: float = 3600.0  # the longest deadline a request may ask for

    def __post_init__(self) -> None:
        assert self.max_body_bytes >= 1 and 1 <= self.max_n <= MAX_N and self.max_choices >= 1
        assert self.max_tokens is None or self.max_tokens >= 1
        assert self.max_prompt_tokens is None or self.max_prompt_tokens >= 1
        assert self.default_timeout_s is None or self.default_timeout_s > 0
        assert self.max_timeout_s > 0

    def timeout_for(self, requested_s: float | None) -> float | None:
        """The deadline (seconds from now) of a request that asked for `requested_s`."""
        timeout = requested_s if requested_s is not None else self.default_timeout_s
        return None if timeout is None else min(timeout, self.max_timeout_s)

    def check_choices(self, n: int, num_prompts: int) -> None:
        if n > self.max_n:
            raise OpenAIError(f"n is {n}; this server allows at most {self.max_n}", param="n", code="invalid_value")
        if n * num_prompts > self.max_choices:
            raise OpenAIError(
                f"{num_prompts} prompts x n={n} ask for {n * num_prompts} choices; at most {self.max_choices}",
                param="n", code="invalid_value")


def body_too_large(limit: int) -> OpenAIError:
    return OpenAIError(f"the request body exceeds {limit} bytes", 413, code="request_too_large")


class BodySizeLimitMiddleware:
    """Pure ASGI middleware: 413 for HTTP bodies over `max_body_bytes` (see the module doc)."""

    def __init__(self, app: Any, max_body_bytes: int) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = _content_length(scope)
        if length is not None and length > self.max_body_bytes:
            await send_error(send, body_too_large(self.max_body_bytes), scope_path(scope))
            return
        received = 0

        async def counted_receive() -> dict[str, Any]:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_body_bytes:
                    raise body_too_large(self.max_body_bytes)  # the app's OpenAIError handler answers 413
            return message

        await self.app(scope, counted_receive, send)


def _content_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


def scope_path(scope: Scope) -> str:
    """The path inside the app (Serve's route prefix, the root_path, removed)."""
    path, root = scope.get("path", "/"), scope.get("root_path", "")
    if root and path.startswith(root):
        path = path[len(root):]
    return path or "/"


async def send_error(send: Any, error: OpenAIError, path: str = "") -> None:
    """An error response sent straight from ASGI middleware, in the shape of the path's API."""
    body = json.dumps(error_payload(error, path)).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += [(k.lower().encode(), v.encode()) for k, v in (error.headers or {}).items()]
    await send({"type": "http.response.start", "status": error.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
