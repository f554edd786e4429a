"""POST /v1/responses: OpenAI's Responses API, the stateless part.

A thin mapping onto the chat path, as serve_app/messages.py is: `instructions` and `input`
(a string, or items: messages, function calls and their outputs) become chat messages;
`tools` (function tools), `tool_choice`, `text.format` (json_object / json_schema),
`max_output_tokens`, `temperature` and `top_p` become their chat fields; serve_app/chat.py
templates, constrains and runs the request, and its parsed reply comes back as output items
(serve_app/reply_blocks.py):

    {"type": "reasoning"}      <- the reasoning of a model whose template thinks
    {"type": "message"}        <- the answer, one output_text part
    {"type": "function_call"}  <- each function call

Nothing is stored: `store: true` and `previous_response_id` are a 400 (send the whole
conversation in `input`). A reply cut by max_output_tokens has status "incomplete".
Streams send Responses events (response.created, response.output_item.added,
response.output_text.delta, response.function_call_arguments.delta, ...,
response.completed), each with its sequence_number.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import AsyncIterator
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from serve_app import chat
from serve_app.chat_output import ChatStreams, chat_message
from serve_app.context import ServingContext
from serve_app.errors import OpenAIError, validation_error
from serve_app.generation import GenerationRun
from serve_app.protocol import MAX_TIMEOUT_S, MAX_TOOLS, NAME_PATTERN, ChatCompletionRequest, chat_body
from serve_app.reply_blocks import REASONING, TEXT, BlockEvent, BlockStream, ReplyBlock, reply_blocks

ITEM_TYPES = ("message", "function_call", "function_call_output", "reasoning")


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)


class TextPart(_Body):
    type: Literal["input_text", "output_text"]
    text: str


class MessageItem(_Body):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[TextPart]

    @property
    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "\n".join(part.text for part in self.content)


class FunctionCallItem(_Body):
    type: Literal["function_call"]
    call_id: str = Field(min_length=1)
    name: str = Field(pattern=NAME_PATTERN)
    arguments: str


class FunctionCallOutputItem(_Body):
    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1)
    output: str


class ReasoningItem(_Body):
    type: Literal["reasoning"]  # an earlier turn's reasoning: left out of the prompt, as chat templates do


class FunctionTool(_Body):
    type: Literal["function"]
    name: str = Field(pattern=NAME_PATTERN)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedFunction(_Body):
    type: Literal["function"]
    name: str


class TextFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class TextOptions(_Body):
    format: TextFormat | None = None


class ResponsesRequest(_Body):
    """Body of POST /v1/responses."""

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    tools: list[FunctionTool] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | None = None
    parallel_tool_calls: bool | None = None
    text: TextOptions | None = None
    reasoning: dict[str, Any] | None = None  # accepted: a thinking model's reasoning is returned as it comes
    stream: bool = False
    store: bool | None = None
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    timeout: float | None = Field(None, gt=0.0, le=MAX_TIMEOUT_S)  # ours, as on chat: seconds to generate at most

    @field_validator("input")
    @classmethod
    def _known_items(cls, items: Any) -> Any:
        for item in items if isinstance(items, list) else ():
            kind = item.get("type", "message")
            if kind not in ITEM_TYPES:
                raise ValueError(f"input item type {kind!r} is not supported here; expected one of "
                                 f"{', '.join(ITEM_TYPES)}")
        return items


InputItem = Annotated[MessageItem | FunctionCallItem | FunctionCallOutputItem | ReasoningItem,
                      Field(discriminator="type")]


class _Items(BaseModel):
    input: list[InputItem]  # named as the request's field, so an error names input.N


def chat_request(body: ResponsesRequest) -> ChatCompletionRequest:
    """The same request in chat's terms; 400s for what this server does not do (stored state)."""
    if body.store:
        raise OpenAIError("store is not supported: responses are not kept; send store: false (or leave it out)",
                          param="store", code="unsupported_parameter")
    if body.previous_response_id is not None:
        raise OpenAIError("previous_response_id is not supported: responses are not kept; send the whole "
                          "conversation in input", param="previous_response_id", code="unsupported_parameter")
    fields: dict[str, Any] = {"model": body.model, "messages": chat_messages(body),
                              "max_completion_tokens": body.max_output_tokens, "stream": body.stream,
                              "parallel_tool_calls": body.parallel_tool_calls, "user": body.user,
                              "timeout": body.timeout}
    fields.update({name: getattr(body, name) for name in ("temperature", "top_p") if getattr(body, name) is not None})
    if body.tools:
        fields["tools"] = [{"type": "function", "function": tool.model_dump(exclude={"type"}, exclude_none=True)}
                           for tool in body.tools]
    if body.tool_choice is not None:
        choice = body.tool_choice
        fields["tool_choice"] = choice if isinstance(choice, str) else {"type": "function",
                                                                        "function": {"name": choice.name}}
    text_format = body.text.format if body.text is not None else None
    if text_format is not None and text_format.type != "text":
        fields["response_format"] = {"type": text_format.type}
        if text_format.type == "json_schema":
            fields["response_format"]["json_schema"] = {
                "name": text_format.name or "response", "schema": text_format.schema_, "strict": text_format.strict}
    return chat_body(fields, "Responses")


def chat_messages(body: ResponsesRequest) -> list[dict[str, Any]]:
    """instructions, then the input items in order; an assistant's consecutive function calls
    become one message's tool_calls, and each output a tool message after its call."""
    messages: list[dict[str, Any]] = []
    if body.instructions:
        messages.append({"role": "system", "content": body.instructions})
    if isinstance(body.input, str):
        return messages + [{"role": "user", "content": body.input}]
    try:
        items = _Items.model_validate({"input": [{"type": "message", **item} for item in body.input]}).input
    except ValidationError as error:
        raise validation_error(error) from None
    called: set[str] = set()
    for item in items:
        if isinstance(item, MessageItem):
            role = "system" if item.role == "developer" else item.role
            messages.append({"role": role, "content": item.text})
        elif isinstance(item, FunctionCallItem):
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and "tool_calls" in last:
                last["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
            called.add(item.call_id)
        elif isinstance(item, FunctionCallOutputItem):
            if item.call_id not in called:
                raise OpenAIError(f"function_call_output for {item.call_id!r} has no function_call item with that "
                                  "call_id before it", param="input", code="invalid_value")
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": item.output})
    if not messages or all(message["role"] == "system" for message in messages):
        raise OpenAIError("input has no message to answer", param="input", code="invalid_value")
    return messages


def error_event(error: OpenAIError) -> dict[str, Any]:
    """The stream's `error` event: the response has started, so the error goes in-band."""
    return {"type": "error", "code": error.code, "message": error.message, "param": error.param}


def _output_item(block: ReplyBlock, item_id: str) -> dict[str, Any]:
    if block.kind == REASONING:
        return {"type": "reasoning", "id": item_id, "summary": [],
                "content": [{"type": "reasoning_text", "text": block.text}]}
    if block.kind == TEXT:
        return {"type": "message", "id": item_id, "status": "completed", "role": "assistant",
                "content": [_text_part(block.text)]}
    return {"type": "function_call", "id": item_id, "call_id": block.call_id, "name": block.name,
            "arguments": block.text, "status": "completed"}


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _item_id(run: GenerationRun, kind: str, index: int) -> str:
    prefix = {REASONING: "rs", TEXT: "msg"}.get(kind, "fc")
    return f"{prefix}_{run.response_id.removeprefix('resp-')}_{index}"


def _response(body: ResponsesRequest, ctx: ServingContext, run: GenerationRun, created: int,
              output: list[dict[str, Any]], finish_reason: str | None) -> dict[str, Any]:
    """The response object; finish_reason None: still in progress."""
    usage = run.usage()
    incomplete = finish_reason in ("length", "timeout", "abort")
    status = "in_progress" if finish_reason is None else "incomplete" if incomplete else "completed"
    return {
        "id": run.response_id, "object": "response", "created_at": created, "status": status, "error": None,
        "incomplete_details": {"reason": "max_output_tokens" if finish_reason == "length" else finish_reason}
        if incomplete else None,
        "instructions": body.instructions, "model": run.model, "output": output,
        "parallel_tool_calls": body.parallel_tool_calls is not False,
        "tool_choice": body.tool_choice if isinstance(body.tool_choice, str) or body.tool_choice is None
        else body.tool_choice.model_dump(),
        "tools": [tool.model_dump(exclude_none=True) for tool in body.tools or ()],
        "temperature": body.temperature, "top_p": body.top_p, "max_output_tokens": body.max_output_tokens,
        "text": {"format": {"type": "text"}} if body.text is None or body.text.format is None
        else {"format": body.text.format.model_dump(by_alias=True, exclude_none=True)},
        "reasoning": body.reasoning, "store": False, "metadata": body.metadata or {},
        "usage": None if finish_reason is None else {
            "input_tokens": usage["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": usage["prompt_tokens_details"]["cached_tokens"]},
            "output_tokens": usage["completion_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": usage["total_tokens"]},
    }


async def prepare(body: ResponsesRequest, ctx: ServingContext) -> tuple[GenerationRun, Any]:
    return await chat.prepare(chat_request(body), ctx, id_prefix="resp")


async def complete(body: ResponsesRequest, ctx: ServingContext) -> dict[str, Any]:
    run, plan = await prepare(body, ctx)
    [result] = await run.collect()
    message, finish_reason = chat_message(result.text, result.finish_reason, plan)
    output = [_output_item(block, _item_id(run, block.kind, index))
              for index, block in enumerate(reply_blocks(message))]
    return _response(body, ctx, run, int(ctx.clock()), output, finish_reason or "stop")


async def prepare_stream(body: ResponsesRequest, ctx: ServingContext) -> AsyncIterator[tuple[str, dict[str, Any]]]:
    """Validates and starts first (errors become plain HTTP errors), then returns the events."""
    run, plan = await prepare(body, ctx)
    return _events(body, ctx, run, ChatStreams(plan))


async def _events(body: ResponsesRequest, ctx: ServingContext, run: GenerationRun,
                  streams: ChatStreams) -> AsyncIterator[tuple[str, dict[str, Any]]]:
    created = int(ctx.clock())
    numbers = itertools.count()

    def event(kind: str, **fields: Any) -> tuple[str, dict[str, Any]]:
        return kind, {"type": kind, "sequence_number": next(numbers), **fields}

    in_progress = _response(body, ctx, run, created, [], None)
    yield event("response.created", response=in_progress)
    yield event("response.in_progress", response=in_progress)
    blocks, items = BlockStream(), ItemEvents(run)
    async with contextlib.aclosing(blocks.events(run, streams)) as block_events:
        async for block_event in block_events:
            for kind, fields in items.on(block_event):
                yield event(kind, **fields)
    final = _response(body, ctx, run, created, items.done, blocks.finish_reason or "stop")
    yield event("response.completed" if final["status"] == "completed" else "response.incomplete", response=final)


class ItemEvents:
    """Block events -> the Responses stream's item events (without type and sequence_number)."""

    def __init__(self, run: GenerationRun) -> None:
        self._run = run
        self._text = ""  # the open item's text so far
        self.done: list[dict[str, Any]] = []  # the finished items, in order

    def on(self, block: BlockEvent) -> list[tuple[str, dict[str, Any]]]:
        item_id = _item_id(self._run, block.kind, block.index)
        where = {"item_id": item_id, "output_index": block.index}
        if block.action == "open":
            self._text = ""
            item = _output_item(ReplyBlock(block.kind, "", block.call_id, block.name), item_id)
            if block.kind == TEXT:
                item.update(status="in_progress", content=[])
                return [("response.output_item.added", {"output_index": block.index, "item": item}),
                        ("response.content_part.added", {**where, "content_index": 0, "part": _text_part("")})]
            if block.kind == REASONING:
                item["content"] = []
                return [("response.output_item.added", {"output_index": block.index, "item": item})]
            item["status"] = "in_progress"
            return [("response.output_item.added", {"output_index": block.index, "item": item})]
        if block.action == "delta":
            self._text += block.text
            if block.kind == TEXT:
                return [("response.output_text.delta", {**where, "content_index": 0, "delta": block.text,
                                                        "logprobs": []})]
            if block.kind == REASONING:
                return [("response.reasoning_text.delta", {**where, "content_index": 0, "delta": block.text})]
            return [("response.function_call_arguments.delta", {**where, "delta": block.text})]
        item = _output_item(ReplyBlock(block.kind, self._text, block.call_id, block.name), item_id)
        self.done.append(item)
        events: list[tuple[str, dict[str, Any]]] = []
        if block.kind == TEXT:
            events += [("response.output_text.done", {**where, "content_index": 0, "text": self._text,
                                                      "logprobs": []}),
                       ("response.content_part.done", {**where, "content_index": 0, "part": _text_part(self._text)})]
        elif block.kind == REASONING:
            events.append(("response.reasoning_text.done", {**where, "content_index": 0, "text": self._text}))
        else:
            events.append(("response.function_call_arguments.done", {**where, "arguments": self._text,
                                                                     "name": item["name"]}))
        return events + [("response.output_item.done", {"output_index": block.index, "item": item})]
