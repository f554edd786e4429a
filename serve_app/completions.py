"""POST /v1/completions: prompts (text, token ids, or lists of either) -> text choices.

Choice indexes run prompt by prompt: prompt i's sequences are i*n .. i*n+n-1.
echo prepends the prompt text to each choice. Prompt logprobs are not computed by the
engine, so echo together with logprobs is refused with a 400 rather than faked.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

from serve_app.context import ServingContext
from serve_app.errors import OpenAIError
from serve_app.generation import ChoiceResult, GenerationRun
from serve_app.logprobs import CompletionLogprobs
from serve_app.protocol import CompletionRequest
from serve_app.sampling import to_sampling_params
from serve_app.sse import ChunkEnvelope
from serve_app.structured import completion_constraints, with_grammar


def split_prompts(body: CompletionRequest) -> list[str | list[int]]:
    prompt = body.prompt
    if isinstance(prompt, str):
        return [prompt]
    if isinstance(prompt[0], int):
        return [prompt]  # type: ignore[list-item]
    return list(prompt)  # type: ignore[arg-type]


async def prompt_token_ids(prompts: list[str | list[int]], ctx: ServingContext) -> list[list[int]]:
    """Every prompt as token ids; text is tokenized on the tokenizer thread."""
    token_lists = []
    for index, item in enumerate(prompts):
        if isinstance(item, str):
            limit = ctx.card.max_model_len
            token_lists.append(await ctx.tokenizer.encode(item, add_special_tokens=True, max_length=limit))
        else:
            ctx.card.check_token_ids(item, "prompt" if len(prompts) == 1 else f"prompt.{index}")
            token_lists.append(list(item))
    return token_lists


async def prepare(body: CompletionRequest, ctx: ServingContext) -> tuple[GenerationRun, list[str]]:
    """Validates and starts nothing yet: returns the run and each prompt's echo text."""
    lora_name = ctx.card.check_model(body.model)
    if body.echo and body.logprobs is not None:
        raise OpenAIError("echo with logprobs is not supported (prompt logprobs are not computed)",
                          param="echo", code="unsupported")
    prompts = split_prompts(body)
    ctx.limits.check_choices(body.n, len(prompts))
    constraints = await completion_constraints(body, ctx)  # response_format: 400s here
    token_lists = await prompt_token_ids(prompts, ctx)
    params = [with_grammar(to_sampling_params(body, len(token_ids), ctx.card, ctx.limits), constraints)
              for token_ids in token_lists]
    echoes = [""] * len(prompts)
    if body.echo:  # the client's own text, or the decoded ids of a token prompt
        echoes = [p if isinstance(p, str) else await ctx.tokenizer.decode(p) for p in prompts]
    run = ctx.start_run(ctx.new_id("cmpl"), token_lists, params, body.stop_strings,
                        timeout_s=ctx.limits.timeout_for(body.timeout), client_timeout=body.timeout is not None,
                        lora_name=lora_name)
    await run.start()  # admission errors (429, 503) and a timeout with nothing generated raise here
    return run, echoes


def _echo_by_choice(run: GenerationRun, echoes: list[str]) -> list[str]:
    return [echo for tracker, echo in zip(run.trackers, echoes) for _ in tracker.choices]


def _logprob_builders(body: CompletionRequest, ctx: ServingContext, run: GenerationRun,
                      echoes: list[str]) -> list[CompletionLogprobs] | None:
    if body.logprobs is None:
        return None
    return [
        CompletionLogprobs(ctx.tokenizer.token_text, body.logprobs, len(echo))
        for echo in _echo_by_choice(run, echoes)
    ]


async def complete(body: CompletionRequest, ctx: ServingContext) -> dict[str, Any]:
    run, echoes = await prepare(body, ctx)
    results = await run.collect()
    builders = _logprob_builders(body, ctx, run, echoes)
    choice_echoes = _echo_by_choice(run, echoes)
    choices = [_choice_json(result, choice_echoes[result.index], builders) for result in results]
    return {
        "id": run.response_id,
        "object": "text_completion",
        "created": int(ctx.clock()),
        "model": run.model,
        "choices": choices,
        "usage": run.usage(),
    }


def _choice_json(result: ChoiceResult, echo: str, builders: list[CompletionLogprobs] | None) -> dict[str, Any]:
    logprobs = None
    if builders is not None:
        logprobs = builders[result.index].format(result.logprobs)
    return {
        "index": result.index,
        "text": echo + result.text,
        "logprobs": logprobs,
        "finish_reason": result.finish_reason,
    }


async def prepare_stream(body: CompletionRequest, ctx: ServingContext) -> AsyncIterator[dict[str, Any]]:
    """Validates first (errors become plain 400s), then returns the chunk iterator."""
    run, echoes = await prepare(body, ctx)
    return _stream_chunks(body, ctx, run, echoes)


async def _stream_chunks(body: CompletionRequest, ctx: ServingContext, run: GenerationRun,
                         echoes: list[str]) -> AsyncIterator[dict[str, Any]]:
    envelope = ChunkEnvelope(run.response_id, "text_completion", int(ctx.clock()), run.model,
                             body.include_usage)
    builders = _logprob_builders(body, ctx, run, echoes)

    def chunk(index: int, text: str, logprobs: Any, finish_reason: str | None) -> dict[str, Any]:
        return envelope.choice({"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason})

    for index, echo in enumerate(_echo_by_choice(run, echoes)):
        if echo:
            yield chunk(index, echo, None, None)
    async with contextlib.aclosing(run.deltas()) as deltas:
        async for delta in deltas:
            logprobs = builders[delta.index].format(delta.logprobs or []) if builders else None
            if delta.text or delta.finish_reason or (logprobs and logprobs["tokens"]):
                yield chunk(delta.index, delta.text, logprobs, delta.finish_reason)
    if body.include_usage:
        yield envelope.usage(run.usage())
