"""The lines of a server-sent event stream as SSE defines them: split at CR, LF or CRLF only.

httpx's iter_lines splits at every str.splitlines boundary, U+0085 and U+2028 among them,
which a JSON encoder leaves unescaped: a token of the tiny random model's byte-level vocabulary
then cuts one data line in two."""

from __future__ import annotations

import re
from collections.abc import AsyncIterator, Iterator

import httpx

_BREAK = re.compile(r"\r\n|\r|\n")


def _split(buffer: str) -> tuple[list[str], str]:
    parts = _BREAK.split(buffer)
    return parts[:-1], parts[-1]


async def sse_lines(response: httpx.Response) -> AsyncIterator[str]:
    buffer = ""
    async for text in response.aiter_text():
        lines, buffer = _split(buffer + text)
        for line in lines:
            yield line
    if buffer:
        yield buffer


def sse_lines_sync(response: httpx.Response) -> Iterator[str]:
    buffer = ""
    for text in response.iter_text():
        lines, buffer = _split(buffer + text)
        yield from lines
    if buffer:
        yield buffer
