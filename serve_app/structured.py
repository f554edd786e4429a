"""The hooks chat.py and completions.py call for structured outputs and tools.

Before generating (prepare):
    refused fields -> 400;  tools + tool_choice -> ToolPlan;  response_format or forced
    tool call -> one GrammarSpec, validated off the loop (400 naming the problem), carried in
    SamplingParams.grammar.
After (building the response):
    chat_message(): the choice's text as message content, or as message.tool_calls with
    finish_reason "tool_calls"; ChoiceToolStreams does the same for a stream, delta by delta.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from serve_app.errors import OpenAIError
from serve_app.grammar import check_combinable, response_format_spec, validator
from serve_app.protocol import ChatCompletionRequest, CompletionRequest
from serve_app.tool_calls import ToolCallStreamer, parse_tool_calls
from serve_app.tools import ToolPlan, check_parameters, resolve_tools, tool_call_grammar
from scheduler.sampling_params import GrammarSpec, SamplingParams

TOOL_CALLS_FINISH_REASON = "tool_calls"


@dataclasses.dataclass(frozen=True, slots=True)
class Constraints:
    grammar: GrammarSpec | None  # what the output must match; None: free text
    tools: ToolPlan | None  # the request's tools; None: no tools


def refuse_unsupported(body: ChatCompletionRequest | CompletionRequest) -> None:
    refused = body.refused_field()
    if refused is not None:
        raise OpenAIError(f"{refused[0]}: {refused[1]}", param=refused[0], code="unsupported_parameter")


async def completion_constraints(body: CompletionRequest, ctx: Any) -> Constraints:
    refuse_unsupported(body)
    grammar = response_format_spec(body.response_format)
    check_combinable(grammar, body.ignore_eos)
    await validator(ctx).check(grammar, "response_format")
    return Constraints(grammar, None)


async def chat_constraints(body: ChatCompletionRequest, ctx: Any) -> Constraints:
    refuse_unsupported(body)
    plan = resolve_tools(body)
    grammar = response_format_spec(body.response_format)
    if plan is not None:
        await check_parameters(plan, validator(ctx))
        if grammar is not None and plan.mode != "none":
            raise OpenAIError("response_format json_object / json_schema cannot be combined with tools unless "
                              "tool_choice is \"none\"", param="response_format", code="unsupported_parameter")
        grammar = grammar or tool_call_grammar(plan)
    check_combinable(grammar, body.ignore_eos)
    await validator(ctx).check(grammar, "tools" if plan is not None and plan.mode != "none" else "response_format")
    return Constraints(grammar, plan)


def with_grammar(params: SamplingParams, constraints: Constraints) -> SamplingParams:
    return params if constraints.grammar is None else dataclasses.replace(params, grammar=constraints.grammar)


def chat_message(text: str, finish_reason: str | None, plan: ToolPlan | None) -> tuple[dict[str, Any], str | None]:
    """(message, finish_reason) of a whole chat choice."""
    if plan is None or not plan.parses_calls:
        return {"role": "assistant", "content": text}, finish_reason
    content, calls = parse_tool_calls(text, plan.allowed_names, plan.max_calls)
    if not calls:
        return {"role": "assistant", "content": text}, finish_reason
    message = {"role": "assistant", "content": content, "tool_calls": calls}
    return message, TOOL_CALLS_FINISH_REASON if finish_reason == "stop" else finish_reason


class ChoiceToolStreams:
    """One ToolCallStreamer per choice of a streamed chat response that parses tool calls."""

    def __init__(self, plan: ToolPlan) -> None:
        self._plan = plan
        self._streamers: dict[int, ToolCallStreamer] = {}

    @classmethod
    def for_plan(cls, plan: ToolPlan | None) -> ChoiceToolStreams | None:
        return cls(plan) if plan is not None and plan.parses_calls else None

    def feed(self, index: int, text: str, finish_reason: str | None) -> tuple[list[dict[str, Any]], str | None]:
        """(chat deltas, finish_reason) for one choice's new text."""
        streamer = self._streamers.setdefault(index, ToolCallStreamer(self._plan.allowed_names, max_calls=self._plan.max_calls))
        deltas = streamer.feed(text) if text else []
        if finish_reason is None:
            return deltas, None
        deltas += streamer.finish()
        if streamer.num_calls and finish_reason == "stop":
            finish_reason = TOOL_CALLS_FINISH_REASON
        return deltas, finish_reason
