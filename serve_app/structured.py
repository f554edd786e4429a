"""The hooks chat.py and completions.py call for structured outputs and tools.

Before generating (prepare):
    refused fields -> 400;  tools + tool_choice -> ToolPlan;  response_format or forced
    tool call -> one GrammarSpec, validated off the loop (400 naming the problem), carried in
    SamplingParams.grammar.
After: serve_app/chat_output.py turns each choice's text into content, tool calls (and
reasoning), whole or delta by delta.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from serve_app.errors import OpenAIError
from serve_app.grammar import check_combinable, response_format_spec, validator
from serve_app.protocol import ChatCompletionRequest, CompletionRequest
from serve_app.tools import ToolPlan, check_parameters, resolve_tools, tool_call_grammar
from scheduler.sampling_params import GrammarSpec, SamplingParams


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
