"""POST /v1/chat/completions: messages -> the model's chat template -> n assistant replies.

Streaming follows OpenAI: each choice opens with a delta {"role": "assistant",
"content": ""} (sent once every choice has its first token, not before), then content
deltas (or reasoning_content / tool_calls deltas: serve_app/chat_output.py), then one chunk
with its finish_reason; with stream_options.include_usage a last chunk carries usage and no
choices.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

from serve_app.chat_output import ChatStreams, OutputPlan, chat_message
from serve_app.context import ServingContext
from serve_app.generation import ChoiceResult, GenerationRun
from serve_app.logprobs import ChatLogprobs
from serve_app.protocol import ChatCompletionRequest
from serve_app.reasoning import QWEN3, decodes_special_tokens
from serve_app.sse import ChunkEnvelope
from serve_app.sampling import to_sampling_params
from serve_app.structured import Constraints, chat_constraints, with_grammar
from serve_app.tool_parsers import HARMONY, HERMES
from serve_app.tools import render_for_template

PROMPT_TAIL_TOKENS = 32  # prompt tokens decoded to see whether the template opened a thought


async def prepare(body: ChatCompletionRequest, ctx: ServingContext,
                  id_prefix: str = "chatcmpl") -> tuple[GenerationRun, OutputPlan]:
    """The run and what to parse out of its text; the Messages and Responses APIs
    (serve_app/messages.py, serve_app/responses.py) come this way too, with ids of their own."""
    lora_name = ctx.card.check_model(body.model)
    ctx.limits.check_choices(body.n, 1)
    constraints, token_ids = await prompt(body, ctx)
    params = with_grammar(to_sampling_params(body, len(token_ids), ctx.card, ctx.limits), constraints)
    plan = _output_plan(constraints, token_ids, ctx)
    keep_special = plan.reasoning_prompt_tail is not None and decodes_special_tokens(plan.reasoning_parser)
    run = ctx.start_run(ctx.new_id(id_prefix), [token_ids], [params], body.stop_strings,
                        timeout_s=ctx.limits.timeout_for(body.timeout), client_timeout=body.timeout is not None,
                        skip_special_tokens=not keep_special, lora_name=lora_name)
    await run.start()  # admission errors (429, 503) and a timeout with nothing generated raise here
    return run, plan


async def prompt(body: ChatCompletionRequest, ctx: ServingContext) -> tuple[Constraints, list[int]]:
    """The request's constraints (response_format, tools: 400s here) and its templated prompt's tokens."""
    constraints = await chat_constraints(body, ctx)
    messages, tools = render_for_template([message.as_template_dict() for message in body.messages],
                                          constraints.tools, ctx.tokenizer.chat_template_renders_tools)
    token_ids = await ctx.tokenizer.encode_chat(messages, body.add_generation_prompt, ctx.card.max_model_len,
                                                tools=tools)
    return constraints, token_ids


def _output_plan(constraints: Constraints, token_ids: list[int], ctx: ServingContext) -> OutputPlan:
    """What to parse out of the text: reasoning only where the model's template thinks and no
    grammar shapes the output (a constrained output is all answer); tool calls in the
    template's format for "auto" replies of templates that render tools, else in the format of
    the grammar and of our own tools prompt (hermes)."""
    tail = None
    if ctx.card.reasoning_parser is not None and constraints.grammar is None:
        tail = ctx.tokenizer.decode_on_loop(token_ids[-PROMPT_TAIL_TOKENS:], skip_special_tokens=False)
    tools = constraints.tools
    tool_parser = HERMES
    if tools is not None and tools.mode == "auto" and ctx.tokenizer.chat_template_renders_tools:
        tool_parser = ctx.card.tool_call_parser
        if tool_parser == HARMONY and (tail is None or ctx.card.reasoning_parser != HARMONY):
            tool_parser = HERMES  # harmony's calls are read from its markers, which only its reasoning parser keeps
    return OutputPlan(tools, tail, tool_parser, ctx.card.reasoning_parser or QWEN3)


def _logprobs_builder(body: ChatCompletionRequest, ctx: ServingContext) -> ChatLogprobs | None:
    if not body.logprobs:
        return None
    return ChatLogprobs(ctx.tokenizer.token_text, ctx.tokenizer.token_bytes, body.top_logprobs or 0)


async def complete(body: ChatCompletionRequest, ctx: ServingContext) -> dict[str, Any]:
    run, plan = await prepare(body, ctx)
    results = await run.collect()
    builder = _logprobs_builder(body, ctx)
    return {
        "id": run.response_id,
        "object": "chat.completion",
        "created": int(ctx.clock()),
        "model": run.model,
        "choices": [_choice_json(result, builder, plan) for result in results],
        "usage": run.usage(),
    }


def _choice_json(result: ChoiceResult, builder: ChatLogprobs | None, plan: OutputPlan) -> dict[str, Any]:
    logprobs = None
    if builder is not None:
        logprobs = {"content": builder.format(result.logprobs), "refusal": None}
    message, finish_reason = chat_message(result.text, result.finish_reason, plan)
    return {
        "index": result.index,
        "message": message,
        "logprobs": logprobs,
        "finish_reason": finish_reason,
    }


async def prepare_stream(body: ChatCompletionRequest, ctx: ServingContext) -> AsyncIterator[dict[str, Any]]:
    """Validates first (errors become plain 400s), then returns the chunk iterator."""
    run, plan = await prepare(body, ctx)
    parses = plan.parses_calls or plan.reasoning_prompt_tail is not None
    return _stream_chunks(body, ctx, run, ChatStreams(plan) if parses else None)


async def _stream_chunks(body: ChatCompletionRequest, ctx: ServingContext, run: GenerationRun,
                         streams: ChatStreams | None) -> AsyncIterator[dict[str, Any]]:
    envelope = ChunkEnvelope(run.response_id, "chat.completion.chunk", int(ctx.clock()), run.model,
                             body.include_usage)
    builder = _logprobs_builder(body, ctx)

    def chunk(index: int, delta: dict[str, Any], logprobs: Any, finish_reason: str | None) -> dict[str, Any]:
        return envelope.choice({"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason})

    # prepare() returned this stream only once every choice had its first token (run.start()),
    # so no chunk, not even the role, goes out before one exists
    for index in range(run.num_choices):
        yield chunk(index, {"role": "assistant", "content": ""}, None, None)
    async with contextlib.aclosing(run.deltas()) as deltas:
        async for delta in deltas:
            logprobs = None
            if builder is not None and delta.logprobs:
                logprobs = {"content": builder.format(delta.logprobs), "refusal": None}
            pieces, finish_reason = [{"content": delta.text}] if delta.text else [], delta.finish_reason
            if streams is not None:  # content, reasoning or tool-call deltas
                pieces, finish_reason = streams.feed(delta.index, delta.text, delta.finish_reason)
            if not pieces and (logprobs or finish_reason):
                pieces = [{}]
            for position, piece in enumerate(pieces):
                last = position == len(pieces) - 1
                yield chunk(delta.index, piece, logprobs if position == 0 else None, finish_reason if last else None)
    if body.include_usage:
        yield envelope.usage(run.usage())
