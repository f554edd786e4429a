"""Server-sent events as OpenAI streams them: `data: <json>\\n\\n` ... `data: [DONE]\\n\\n`.

An error after the response has started (headers are gone, so no status code can change)
is sent as one `data: {"error": {...}}` event, then [DONE], as vLLM does.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from serve_app.errors import OpenAIError

logger = logging.getLogger(__name__)

DONE = b"data: [DONE]\n\n"


@dataclass(frozen=True, slots=True)
class ChunkEnvelope:
    """What every chunk of one streamed response shares: id, object, created, model, usage."""

    response_id: str
    object: str  # "text_completion" or "chat.completion.chunk"
    created: int
    model: str
    include_usage: bool  # stream_options.include_usage: "usage": null on every choice chunk

    def choice(self, choice: dict[str, Any]) -> dict[str, Any]:
        payload = self._head([choice])
        if self.include_usage:
            payload["usage"] = None
        return payload

    def usage(self, usage: dict[str, Any]) -> dict[str, Any]:
        """The last chunk when include_usage is set: no choices, the whole response's usage."""
        return {**self._head([]), "usage": usage}

    def _head(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.response_id, "object": self.object, "created": self.created, "model": self.model,
                "choices": choices}


def sse_event(payload: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


async def sse_stream(chunks: AsyncIterator[dict[str, Any]]) -> AsyncIterator[bytes]:
    """Encodes chunks as events and always ends with [DONE] (unless the client is gone)."""
    try:
        async for chunk in chunks:
            yield sse_event(chunk)
    except OpenAIError as error:
        yield sse_event(error.body())
    except Exception as error:  # the stream has started: report in-band, never drop silently
        logger.exception("error while streaming")
        failure = OpenAIError(f"internal error while streaming: {type(error).__name__}", 500)
        yield sse_event(failure.body())
    finally:
        close = getattr(chunks, "aclose", None)
        if close is not None:
            await close()
    yield DONE


def named_sse_event(name: str, payload: dict[str, Any]) -> bytes:
    return (b"event: " + name.encode() + b"\ndata: "
            + json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n")


async def named_sse_stream(events: AsyncIterator[tuple[str, dict[str, Any]]],
                           error_body: Callable[[OpenAIError], dict[str, Any]]) -> AsyncIterator[bytes]:
    """Named events (`event: <name>` then `data: <json>`), as the Messages and Responses APIs
    stream them, no [DONE]; an error after the response has started is one `error` event,
    error_body(error) in the API's own shape."""
    try:
        async for name, payload in events:
            yield named_sse_event(name, payload)
    except OpenAIError as error:
        yield named_sse_event("error", error_body(error))
    except Exception as error:  # the stream has started: report in-band, never drop silently
        logger.exception("error while streaming")
        failure = OpenAIError(f"internal error while streaming: {type(error).__name__}", 500)
        yield named_sse_event("error", error_body(failure))
    finally:
        close = getattr(events, "aclose", None)
        if close is not None:
            await close()
