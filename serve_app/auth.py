"""Optional API keys: `Authorization: Bearer <key>`, checked before anything else runs.

- Keys come from AppArgs.api_keys, or (when none are given there) from the environment
  variable RAYLLM_API_KEYS (comma-separated), read ONCE by the app builder. No keys: the
  server is open, as before.
- Every path needs a key except EXEMPT_PATHS: /health and /live (probes from the cluster)
  and /metrics (Prometheus scrapes without credentials by default; it carries counts and
  latencies, never request text). Everything else, /v1/*, /tokenize, /version and the
  OpenAPI docs included, answers 401 without a valid key.
- The key may also come as `x-api-key: <key>` (Anthropic's clients send it so); Authorization
  wins where both are sent.
- A missing header, another scheme than Bearer, an empty or a wrong key: 401 in OpenAI's
  error shape (Anthropic's on the Messages API's routes) with code "invalid_api_key" and
  `WWW-Authenticate: Bearer`.
- Keys are kept only as SHA-256 digests and compared with hmac.compare_digest against
  every configured key (no early exit), so neither timing nor the number of keys leaks
  which prefix matched. Nothing here logs a header or a key, and the message never echoes
  what the client sent.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from collections.abc import Iterable, Mapping
from typing import Any

from serve_app.errors import OpenAIError
from serve_app.limits import scope_path, send_error

API_KEYS_ENV = "RAYLLM_API_KEYS"
EXEMPT_PATHS = frozenset({"/health", "/live", "/metrics"})


def api_keys_from_env(environ: Mapping[str, str] = os.environ) -> list[str]:
    """The keys in RAYLLM_API_KEYS (comma-separated, blanks dropped); [] when unset."""
    return [key.strip() for key in environ.get(API_KEYS_ENV, "").split(",") if key.strip()]


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest()


class KeyChecker:
    def __init__(self, keys: Iterable[str]) -> None:
        self._digests = [_digest(key) for key in keys if key]

    @property
    def enabled(self) -> bool:
        return bool(self._digests)

    def is_valid(self, authorization: str | None) -> bool:
        if authorization is None:
            return False
        scheme, _, token = authorization.strip().partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or not token:
            return False
        presented = _digest(token)
        matched = False
        for digest in self._digests:
            matched |= hmac.compare_digest(presented, digest)
        return matched


def invalid_api_key() -> OpenAIError:
    return OpenAIError(
        "invalid or missing API key: send 'Authorization: Bearer <key>'", 401,
        code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"},
    )


class ApiKeyMiddleware:
    """Pure ASGI middleware; outermost, so a request without a key costs nothing more."""

    def __init__(self, app: Any, keys: Iterable[str], exempt_paths: frozenset[str] = EXEMPT_PATHS) -> None:
        self.app = app
        self.checker = KeyChecker(keys)
        self.exempt_paths = exempt_paths

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http" or not self.checker.enabled or scope_path(scope) in self.exempt_paths:
            await self.app(scope, receive, send)
            return
        authorization = None
        for name, value in scope.get("headers", ()):
            if name == b"authorization":
                authorization = value.decode("latin-1")
                break
            if name == b"x-api-key" and authorization is None:  # Anthropic's clients send the key so
                authorization = "Bearer " + value.decode("latin-1")
        if not self.checker.is_valid(authorization):
            await send_error(send, invalid_api_key(), scope_path(scope))
            return
        await self.app(scope, receive, send)
