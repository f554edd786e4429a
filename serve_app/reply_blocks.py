"""A chat reply as blocks: what the Messages and Responses APIs build their outputs from.

The chat path (serve_app/chat.py, chat_output.py) parses a reply into reasoning, content and
tool calls: a whole message, or a stream of chat deltas. Anthropic's Messages API and OpenAI's
Responses API both lay a reply out as a sequence of blocks instead (thinking / text / tool_use
content blocks; reasoning / message / function_call output items), each opened, filled and
closed in turn. This module turns the chat path's output into those blocks, once for both:

    whole:   reply_blocks(message)            -> [ReplyBlock("reasoning", ...), ReplyBlock("text", ...)]
    stream:  BlockStream().events(run, streams)  -> BlockEvent("open", 0, "text"),
                                                    BlockEvent("delta", 0, "text", "Hi"), ...,
                                                    the last block's "close"

Block kinds: "reasoning", "text" and "tool_call" (its text: the call's JSON arguments).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from serve_app.chat_output import ChatStreams
    from serve_app.generation import GenerationRun

REASONING, TEXT, TOOL_CALL = "reasoning", "text", "tool_call"


@dataclass(frozen=True, slots=True)
class ReplyBlock:
    kind: str  # REASONING, TEXT or TOOL_CALL
    text: str  # the reasoning, the text, or a call's JSON arguments
    call_id: str | None = None  # TOOL_CALL: the call's id
    name: str | None = None  # TOOL_CALL: the function's name


@dataclass(frozen=True, slots=True)
class BlockEvent:
    action: str  # "open", "delta" or "close"
    index: int  # the block's position in the reply, from 0
    kind: str  # REASONING, TEXT or TOOL_CALL
    text: str = ""  # "delta": the new text
    call_id: str | None = None  # "open" and "close" of a TOOL_CALL
    name: str | None = None  # "open" and "close" of a TOOL_CALL


def reply_blocks(message: dict[str, Any]) -> list[ReplyBlock]:
    """A whole chat message (chat_output.chat_message) as blocks, in the order the model wrote them."""
    blocks = []
    if message.get("reasoning_content"):
        blocks.append(ReplyBlock(REASONING, message["reasoning_content"]))
    if message.get("content"):
        blocks.append(ReplyBlock(TEXT, message["content"]))
    for call in message.get("tool_calls") or ():
        blocks.append(ReplyBlock(TOOL_CALL, call["function"]["arguments"], call["id"], call["function"]["name"]))
    return blocks


class BlockStream:
    """Chat deltas in, block events out: a block opens when text of another kind (or a new tool
    call) arrives, and the open one closes first. Empty text opens nothing."""

    def __init__(self) -> None:
        self._open: BlockEvent | None = None  # the "open" event of the block being filled
        self._next_index = 0
        self._calls: dict[int, int] = {}  # the chat delta's tool call index -> its block index
        self.finish_reason: str | None = None  # the choice's, once events() has ended

    async def events(self, run: GenerationRun, streams: ChatStreams) -> AsyncIterator[BlockEvent]:
        """The block events of a one-choice run, its text parsed by streams, to the last block's
        close; finish_reason is the choice's (as the chat path reports it) once they have ended."""
        async with contextlib.aclosing(run.deltas()) as deltas:
            async for delta in deltas:
                pieces, self.finish_reason = streams.feed(delta.index, delta.text, delta.finish_reason)
                for event in self.feed(pieces):
                    yield event
        for event in self.finish():
            yield event

    def feed(self, chat_deltas: list[dict[str, Any]]) -> list[BlockEvent]:
        events: list[BlockEvent] = []
        for delta in chat_deltas:
            if delta.get("reasoning_content"):
                events += self._text(REASONING, delta["reasoning_content"])
            if delta.get("content"):
                events += self._text(TEXT, delta["content"])
            for call in delta.get("tool_calls") or ():
                events += self._call(call)
        return events

    def finish(self) -> list[BlockEvent]:
        return self._close()

    def _text(self, kind: str, text: str) -> list[BlockEvent]:
        events = []
        if self._open is None or self._open.kind != kind:
            events += self._close() + [self._start(kind)]
        assert self._open is not None
        return events + [BlockEvent("delta", self._open.index, kind, text)]

    def _call(self, call: dict[str, Any]) -> list[BlockEvent]:
        events = []
        if "id" in call:  # a new call opens its block
            events += self._close() + [self._start(TOOL_CALL, call["id"], call["function"]["name"])]
            assert self._open is not None
            self._calls[call["index"]] = self._open.index
        arguments = call.get("function", {}).get("arguments", "")
        if arguments:
            events.append(BlockEvent("delta", self._calls[call["index"]], TOOL_CALL, arguments))
        return events

    def _start(self, kind: str, call_id: str | None = None, name: str | None = None) -> BlockEvent:
        self._open = BlockEvent("open", self._next_index, kind, call_id=call_id, name=name)
        self._next_index += 1
        return self._open

    def _close(self) -> list[BlockEvent]:
        if self._open is None:
            return []
        closed, self._open = self._open, None
        return [BlockEvent("close", closed.index, closed.kind, call_id=closed.call_id, name=closed.name)]
