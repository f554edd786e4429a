"""One streaming OpenAI request (completions or chat), timed chunk by chunk.

Follows vLLM's `async_request_openai_completions` / `..._chat_completions`: TTFT is the
first SSE event that carries a choice, each later such event gives one ITL gap (per choice
index, so n > 1 streams are not mixed), E2E ends at the last such event, and token counts
come from `usage` (we ask for it with `stream_options.include_usage`).
"""

from __future__ import annotations

import codecs
import json
import time

import aiohttp

from bench.metrics import RequestResult


class SSEParser:
    """Bytes in, complete `data:` payloads out (comments and other fields dropped)."""

    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")()
        self._buffer = ""

    def feed(self, raw: bytes) -> list[str]:
        self._buffer = (self._buffer + self._decoder.decode(raw)).replace("\r\n", "\n")
        payloads = []
        while "\n\n" in self._buffer:
            event, self._buffer = self._buffer.split("\n\n", 1)
            data = [line[5:].lstrip() for line in event.split("\n") if line.startswith("data:")]
            if data:
                payloads.append("\n".join(data))
        return payloads


def _record_usage(result: RequestResult, usage: dict) -> None:
    if usage.get("completion_tokens") is not None:
        result.output_tokens = int(usage["completion_tokens"])
        result.usage_reported = True
    if usage.get("prompt_tokens") is not None:
        result.prompt_len = int(usage["prompt_tokens"])
    details = usage.get("prompt_tokens_details") or {}
    if details.get("cached_tokens") is not None:
        result.cached_tokens = int(details["cached_tokens"])


def _record_choices(result, msg, now, st, last_seen, texts, chat) -> None:
    for choice in msg.get("choices") or []:
        index = int(choice.get("index", 0))
        if not result.chunk_times:
            result.ttft = now - st
        if index in last_seen:
            result.itl.append(now - last_seen[index])
        last_seen[index] = now
        result.chunk_times.append(now - st)
        text = (choice.get("delta") or {}).get("content") if chat else choice.get("text")
        texts[index] = texts.get(index, "") + (text or "")
        if choice.get("finish_reason") is not None:
            while len(result.finish_reasons) <= index:
                result.finish_reasons.append(None)
            result.finish_reasons[index] = choice["finish_reason"]


async def send_request(
    session: aiohttp.ClientSession, url: str, body: dict, result: RequestResult, *, chat: bool
) -> RequestResult:
    """Streams one request into `result` (which carries group, n and the aimed prompt_len)."""
    last_seen: dict[int, float] = {}  # choice index -> perf_counter of its last content chunk
    texts: dict[int, str] = {}
    st = time.perf_counter()
    result.start_time = st
    most_recent = st
    try:
        async with session.post(url, json=body) as response:
            if response.status != 200:
                result.error = f"HTTP {response.status}: {(await response.text())[:300]}"
                return result
            parser = SSEParser()
            async for raw in response.content.iter_any():
                for data in parser.feed(raw):
                    if data == "[DONE]":
                        continue
                    now = time.perf_counter()
                    msg = json.loads(data)
                    if msg.get("error"):
                        result.error = f"server error in stream: {msg['error']}"
                        return result
                    if msg.get("choices"):
                        _record_choices(result, msg, now, st, last_seen, texts, chat)
                        most_recent = now
                    if msg.get("usage"):
                        _record_usage(result, msg["usage"])
    except Exception as e:  # noqa: BLE001 - any failure is one failed request, reported
        result.error = f"{type(e).__name__}: {e}"
        return result
    if not result.chunk_times:
        result.error = "no content chunk received: cannot time TTFT"
        return result
    if not result.usage_reported:  # fallback, counted in num_without_usage
        result.output_tokens = len(result.chunk_times)
    result.latency = most_recent - st
    result.generated_text = texts.get(0, "")
    result.success = True
    return result
