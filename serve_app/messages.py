"""POST /v1/messages and /v1/messages/count_tokens: Anthropic's Messages API.

A thin mapping onto the chat path: the request becomes a ChatCompletionRequest (system and
messages, content blocks, tools and tool_choice, sampling fields), serve_app/chat.py templates,
constrains and runs it, and its parsed reply (reasoning, text, tool calls) comes back as
content blocks (serve_app/reply_blocks.py):

    {"type": "thinking"}  <- the reasoning of a model whose template thinks (unless thinking is disabled)
    {"type": "text"}      <- the answer
    {"type": "tool_use"}  <- each function call, its input parsed from the arguments' JSON

stop_reason: end_turn (EOS), stop_sequence (with the stop_sequence that matched), max_tokens,
tool_use; a request cut by the server's deadline ends with "timeout". `output_config.format`
(a JSON schema) constrains the text as chat's response_format does. Streams follow Anthropic's
events: message_start, content_block_start / _delta / _stop per block, message_delta (stop
reason, output tokens), message_stop. Errors have Anthropic's shape (serve_app/errors.py).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from serve_app import chat
from serve_app.chat_output import ChatStreams, chat_message
from serve_app.context import ServingContext
from serve_app.errors import OpenAIError
from serve_app.generation import GenerationRun
from serve_app.protocol import (
    MAX_STOP_STRINGS,
    MAX_TIMEOUT_S,
    MAX_TOOLS,
    NAME_PATTERN,
    ChatCompletionRequest,
    chat_body,
)
from serve_app.reply_blocks import REASONING, TEXT, BlockEvent, BlockStream, ReplyBlock, reply_blocks

STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)


class TextBlock(_Body):
    type: Literal["text"]
    text: str


class ToolUseBlock(_Body):
    type: Literal["tool_use"]
    id: str = Field(min_length=1)
    name: str = Field(pattern=NAME_PATTERN)
    input: dict[str, Any]


class ToolResultBlock(_Body):
    type: Literal["tool_result"]
    tool_use_id: str = Field(min_length=1)
    content: str | list[TextBlock] = ""
    is_error: bool = False

    @property
    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "\n".join(part.text for part in self.content)


class ThinkingBlock(_Body):
    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


ContentBlock = Annotated[TextBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock, Field(discriminator="type")]


BLOCK_TYPES = ("text", "tool_use", "tool_result", "thinking")


class InputMessage(_Body):
    role: Literal["user", "assistant"]
    content: str | list[ContentBlock]

    @field_validator("content", mode="before")
    @classmethod
    def _known_blocks(cls, content: Any) -> Any:
        """An unknown block type (an image, a document) is named in the 400, not lost in union errors."""
        for block in content if isinstance(content, list) else ():
            kind = block.get("type") if isinstance(block, dict) else None
            if kind not in BLOCK_TYPES:
                raise ValueError(f"content block type {kind!r} is not supported here; expected one of "
                                 f"{', '.join(BLOCK_TYPES)}")
        return content


class Tool(_Body):
    name: str = Field(pattern=NAME_PATTERN)
    description: str | None = None
    input_schema: dict[str, Any]
    type: Literal["custom"] | None = None


class ToolChoice(_Body):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool = False


class Thinking(_Body):
    type: Literal["enabled", "disabled", "adaptive", "between_tools"]  # all but disabled show the reasoning
    budget_tokens: int | None = Field(None, ge=1)  # accepted; the reply's reasoning is not cut to it


class OutputFormat(_Body):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(_Body):
    format: OutputFormat | None = None  # the reply's text constrained to this JSON schema
    effort: str | None = None  # accepted and ignored


class CountTokensRequest(_Body):
    """Body of POST /v1/messages/count_tokens: what a message request is templated from."""

    model: str | None = None
    messages: list[InputMessage] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[Tool] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    output_config: OutputConfig | None = None


class MessagesRequest(CountTokensRequest):
    """Body of POST /v1/messages."""

    max_tokens: int = Field(ge=1)
    stop_sequences: list[Annotated[str, Field(min_length=1)]] | None = Field(None, max_length=MAX_STOP_STRINGS)
    temperature: float | None = Field(None, ge=0.0, le=1.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0)
    stream: bool = False
    metadata: Any = None  # accepted and ignored
    timeout: float | None = Field(None, gt=0.0, le=MAX_TIMEOUT_S)  # ours, as on chat: seconds to generate at most


def chat_request(body: CountTokensRequest) -> ChatCompletionRequest:
    """The same request in chat's terms (400s for what does not map: a tool_result without its tool_use)."""
    fields: dict[str, Any] = {"model": body.model, "messages": chat_messages(body)}
    if body.tools:
        fields["tools"] = [{"type": "function", "function": {"name": tool.name, "description": tool.description,
                                                             "parameters": tool.input_schema}} for tool in body.tools]
    choice = body.tool_choice
    if choice is not None:
        if choice.type == "tool" and not choice.name:
            raise OpenAIError("tool_choice of type tool needs a name", param="tool_choice", code="invalid_value")
        named = {"type": "function", "function": {"name": choice.name}}
        fields["tool_choice"] = {"auto": "auto", "any": "required", "none": "none", "tool": named}[choice.type]
        fields["parallel_tool_calls"] = not choice.disable_parallel_tool_use
    output_format = body.output_config.format if body.output_config is not None else None
    if output_format is not None:
        fields["response_format"] = {"type": "json_schema", "json_schema": {"name": "output",
                                                                            "schema": output_format.schema_}}
    if isinstance(body, MessagesRequest):
        fields.update(max_tokens=body.max_tokens, stream=body.stream, stop=body.stop_sequences, timeout=body.timeout)
        fields.update({name: getattr(body, name) for name in ("temperature", "top_p", "top_k")
                       if getattr(body, name) is not None})  # left out: the model's sampling defaults
    return chat_body(fields, "Messages")


def chat_messages(body: CountTokensRequest) -> list[dict[str, Any]]:
    """system, then each message; a user message's tool_result blocks become tool messages ahead
    of its text, and an assistant message's tool_use blocks its tool_calls. Thinking blocks of
    earlier turns are left out, as the chat templates of thinking models leave them out."""
    messages: list[dict[str, Any]] = []
    if body.system:
        messages.append({"role": "system", "content": _joined(body.system)})
    called: set[str] = set()
    for message in body.messages:
        blocks = [TextBlock(type="text", text=message.content)] if isinstance(message.content, str) else message.content
        texts = [block.text for block in blocks if isinstance(block, TextBlock)]
        if message.role == "assistant":
            if any(isinstance(block, ToolResultBlock) for block in blocks):
                raise OpenAIError("tool_result blocks belong in user messages", param="messages", code="invalid_value")
            calls = [{"id": block.id, "type": "function",
                      "function": {"name": block.name, "arguments": json.dumps(block.input)}}
                     for block in blocks if isinstance(block, ToolUseBlock)]
            called.update(call["id"] for call in calls)
            reply: dict[str, Any] = {"role": "assistant", "content": "".join(texts)}
            if calls:
                reply["tool_calls"] = calls
            messages.append(reply)
            continue
        for block in blocks:
            if isinstance(block, ToolUseBlock):
                raise OpenAIError("tool_use blocks belong in assistant messages", param="messages",
                                  code="invalid_value")
            if isinstance(block, ToolResultBlock):
                if block.tool_use_id not in called:
                    raise OpenAIError(f"tool_result block for {block.tool_use_id!r} has no tool_use block with "
                                      "that id in an earlier assistant message", param="messages",
                                      code="invalid_value")
                messages.append({"role": "tool", "tool_call_id": block.tool_use_id, "content": block.text})
        if texts or not any(isinstance(block, ToolResultBlock) for block in blocks):
            messages.append({"role": "user", "content": "\n".join(texts)})
    return messages


def _joined(system: str | list[TextBlock]) -> str:
    return system if isinstance(system, str) else "\n".join(block.text for block in system)


async def count_tokens(body: CountTokensRequest, ctx: ServingContext) -> dict[str, Any]:
    request = chat_request(body)
    ctx.card.check_model(request.model)
    _, token_ids = await chat.prompt(request, ctx)
    return {"input_tokens": len(token_ids)}


async def prepare(body: MessagesRequest, ctx: ServingContext) -> tuple[GenerationRun, Any]:
    return await chat.prepare(chat_request(body), ctx, id_prefix="msg")


def _stop(run: GenerationRun, finish_reason: str | None) -> tuple[str | None, str | None]:
    """(stop_reason, stop_sequence) of the run's one choice."""
    stop_string = run.trackers[0].choices[0].stop_string
    if finish_reason == "stop" and stop_string is not None:
        return "stop_sequence", stop_string
    return STOP_REASONS.get(finish_reason or "", finish_reason), None


def _usage(run: GenerationRun) -> dict[str, int]:
    usage = run.usage()
    return {"input_tokens": usage["prompt_tokens"], "output_tokens": usage["completion_tokens"],
            "cache_read_input_tokens": usage["prompt_tokens_details"]["cached_tokens"],
            "cache_creation_input_tokens": 0}


def _shows(kind: str, body: MessagesRequest) -> bool:
    """Reasoning is shown unless the request turned thinking off."""
    return kind != REASONING or body.thinking is None or body.thinking.type != "disabled"


def _content_block(block: ReplyBlock) -> dict[str, Any]:
    if block.kind == REASONING:
        return {"type": "thinking", "thinking": block.text, "signature": ""}
    if block.kind == TEXT:
        return {"type": "text", "text": block.text}
    return {"type": "tool_use", "id": block.call_id, "name": block.name, "input": json.loads(block.text or "{}")}


def _message(run: GenerationRun, ctx: ServingContext, content: list[dict[str, Any]], stop_reason: str | None,
             stop_sequence: str | None) -> dict[str, Any]:
    return {"id": run.response_id, "type": "message", "role": "assistant", "model": run.model,
            "content": content, "stop_reason": stop_reason, "stop_sequence": stop_sequence, "usage": _usage(run)}


async def complete(body: MessagesRequest, ctx: ServingContext) -> dict[str, Any]:
    run, plan = await prepare(body, ctx)
    [result] = await run.collect()
    message, finish_reason = chat_message(result.text, result.finish_reason, plan)
    content = [_content_block(block) for block in reply_blocks(message) if _shows(block.kind, body)]
    return _message(run, ctx, content, *_stop(run, finish_reason))


async def prepare_stream(body: MessagesRequest, ctx: ServingContext) -> AsyncIterator[tuple[str, dict[str, Any]]]:
    """Validates and starts first (errors become plain HTTP errors), then returns the events."""
    run, plan = await prepare(body, ctx)
    return _events(body, ctx, run, ChatStreams(plan))


async def _events(body: MessagesRequest, ctx: ServingContext, run: GenerationRun,
                  streams: ChatStreams) -> AsyncIterator[tuple[str, dict[str, Any]]]:
    start = _message(run, ctx, [], None, None)
    start["usage"]["output_tokens"] = 0
    yield "message_start", {"type": "message_start", "message": start}
    blocks, shown = BlockStream(), {}  # shown: our block index -> the client's (hidden reasoning skipped)
    async with contextlib.aclosing(blocks.events(run, streams)) as events:
        async for event in events:
            if _shows(event.kind, body):
                yield _block_event(event, shown)
    stop_reason, stop_sequence = _stop(run, blocks.finish_reason)
    yield "message_delta", {"type": "message_delta", "delta": {"stop_reason": stop_reason,
                                                               "stop_sequence": stop_sequence},
                            "usage": {"output_tokens": _usage(run)["output_tokens"]}}
    yield "message_stop", {"type": "message_stop"}


def _block_event(event: BlockEvent, shown: dict[int, int]) -> tuple[str, dict[str, Any]]:
    if event.action == "open":
        index = shown[event.index] = len(shown)
        block = _content_block(ReplyBlock(event.kind, "", event.call_id, event.name))  # empty, as it opens
        return "content_block_start", {"type": "content_block_start", "index": index, "content_block": block}
    index = shown[event.index]
    if event.action == "close":
        return "content_block_stop", {"type": "content_block_stop", "index": index}
    delta = {"type": "text_delta", "text": event.text}
    if event.kind == REASONING:
        delta = {"type": "thinking_delta", "thinking": event.text}
    elif event.kind != TEXT:
        delta = {"type": "input_json_delta", "partial_json": event.text}
    return "content_block_delta", {"type": "content_block_delta", "index": index, "delta": delta}
