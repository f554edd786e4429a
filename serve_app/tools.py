"""Tools at the ingress: tool_choice resolved, tools rendered into the prompt, calls constrained.

One tool-call format, the Hermes / Qwen one, is used for the prompt, the grammar and the
parser (serve_app/tool_calls.py):

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

tool_choice:
- "none": tools are rendered (the model knows they exist) and no call is parsed.
- "auto" (the default with tools): free text; calls the model makes are parsed out.
- "required" / a named function: the output is constrained by a Lark grammar to one call
  (or, for "required" with parallel_tool_calls, several separated by newlines) of the allowed
  functions, each call's arguments by that function's own "parameters" schema (%json), so
  they validate by construction. A named function is called exactly once, whatever
  parallel_tool_calls says (as OpenAI does).
- parallel_tool_calls false: at most one call per choice; in "auto" mode the first call the
  model writes is returned and later ones are dropped (streamed and whole alike).

Rendering: a chat template that handles tools itself (its source mentions `tools`) gets them
as apply_chat_template(tools=...). A template that does not (SmolLM2's) gets them from us:
a system message (ours, or appended to the client's) that lists the functions and the call
format, and earlier assistant tool calls and tool results written into message text.

Every function's parameters schema is validated like a response_format schema (a 400 names
the tool), also when the mode does not compile it, so a bad schema never passes silently.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from serve_app.errors import OpenAIError
from serve_app.grammar import GrammarValidator, check_strict_schema, schema_spec
from serve_app.protocol import ChatCompletionRequest, FunctionDefinition
from scheduler.sampling_params import GrammarSpec
from workers.grammar_spec import json_format_for_lark

CALL_OPEN = "<tool_call>"
CALL_CLOSE = "</tool_call>"
NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}


@dataclass(frozen=True, slots=True)
class ToolPlan:
    functions: tuple[FunctionDefinition, ...]  # every tool of the request, in order
    mode: str  # "none" | "auto" | "required" | "named"
    allowed_names: tuple[str, ...]  # functions a call may name (one for "named")
    parallel: bool  # several calls per choice allowed (never for "named")

    @property
    def parses_calls(self) -> bool:
        return self.mode != "none"

    @property
    def max_calls(self) -> int | None:
        """Calls a choice may return; None: any number."""
        return None if self.parallel else 1

    def parameters(self, function: FunctionDefinition) -> dict[str, Any]:
        return NO_PARAMETERS if function.parameters is None else function.parameters


def resolve_tools(body: ChatCompletionRequest) -> ToolPlan | None:
    """The request's tools and tool_choice, checked (400s name the field); None: no tools."""
    choice = body.tool_choice
    if not body.tools:
        if choice is not None and choice != "none":
            raise OpenAIError("tool_choice needs tools", param="tool_choice", code="invalid_value")
        return None
    functions = tuple(tool.function for tool in body.tools)
    names = [function.name for function in functions]
    duplicates = sorted({name for name in names if names.count(name) > 1})
    if duplicates:
        raise OpenAIError(f"tools: function names must be unique; repeated: {', '.join(duplicates)}",
                          param="tools", code="invalid_value")
    for index, function in enumerate(functions):
        if function.strict and function.parameters is not None:
            check_strict_schema(function.parameters, f"tools.{index}.function.parameters")
    if choice is None or isinstance(choice, str):
        mode = choice or "auto"
        return ToolPlan(functions, mode, tuple(names), body.parallel_tool_calls)
    if choice.function.name not in names:
        raise OpenAIError(f"tool_choice names the function {choice.function.name!r}, which is not in tools",
                          param="tool_choice", code="invalid_value")
    return ToolPlan(functions, "named", (choice.function.name,), parallel=False)  # exactly one call


async def check_parameters(plan: ToolPlan, validator: GrammarValidator) -> None:
    for index, function in enumerate(plan.functions):
        await validator.check(schema_spec(plan.parameters(function)), f"tools.{index}.function.parameters")


def tool_call_grammar(plan: ToolPlan) -> GrammarSpec | None:
    """The Lark grammar that forces calls of the allowed functions ("required" / "named")."""
    if plan.mode not in ("required", "named"):
        return None
    by_name = {function.name: function for function in plan.functions}
    lines = ["start: call (\"\\n\" call)*" if plan.parallel else "start: call",
             "call: " + " | ".join(f"call_{index}" for index in range(len(plan.allowed_names)))]
    for index, name in enumerate(plan.allowed_names):
        head = json.dumps(f'{CALL_OPEN}\n{{"name": "{name}", "arguments": ')  # names are [A-Za-z0-9_-]
        tail = json.dumps(f"}}\n{CALL_CLOSE}")
        lines.append(f"call_{index}: {head} args_{index} {tail}")
        schema = json_format_for_lark(plan.parameters(by_name[name]))
        lines.append(f"args_{index}: %json {json.dumps(schema)}")
    return GrammarSpec("lark", "\n".join(lines) + "\n")


def template_tools(plan: ToolPlan) -> list[dict[str, Any]]:
    return [{"type": "function", "function": function.model_dump(exclude_none=True, by_alias=True)}
            for function in plan.functions]


def render_for_template(messages: list[dict[str, Any]], plan: ToolPlan | None,
                        template_renders_tools: bool) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """(messages, tools for apply_chat_template) with the tools rendered one way or the other."""
    if plan is None:
        return messages, None
    if template_renders_tools:
        return messages, template_tools(plan)
    rendered = [_message_as_text(message) for message in messages]
    prompt = _tools_system_prompt(plan)
    if rendered and rendered[0].get("role") == "system":
        rendered[0] = {**rendered[0], "content": f"{rendered[0].get('content') or ''}\n\n{prompt}".lstrip()}
    else:
        rendered.insert(0, {"role": "system", "content": prompt})
    return rendered, None


def _tools_system_prompt(plan: ToolPlan) -> str:
    listed = "\n".join(json.dumps(tool, ensure_ascii=False) for tool in template_tools(plan))
    return (
        "You can call functions to answer. These are the functions, one JSON object per line:\n"
        f"<tools>\n{listed}\n</tools>\n"
        f"To call one, reply with its name and arguments as a JSON object between {CALL_OPEN} and {CALL_CLOSE}:\n"
        f'{CALL_OPEN}\n{{"name": "the_function", "arguments": {{"argument": "value"}}}}\n{CALL_CLOSE}'
    )


def _message_as_text(message: dict[str, Any]) -> dict[str, Any]:
    """Earlier tool calls and tool results written into the text of their messages."""
    role = message.get("role")
    if role == "assistant" and message.get("tool_calls"):
        calls = [_call_text(call) for call in message["tool_calls"]]
        content = "\n".join(part for part in [message.get("content") or "", *calls] if part)
        return {key: value for key, value in message.items() if key != "tool_calls"} | {"content": content}
    if role == "tool":
        return {**message, "content": f"<tool_response>\n{message.get('content') or ''}\n</tool_response>"}
    return message


def _call_text(call: Any) -> str:
    function = call.get("function", {}) if isinstance(call, dict) else {}
    arguments = function.get("arguments", "{}")
    try:
        arguments = json.loads(arguments) if isinstance(arguments, str) else arguments
    except json.JSONDecodeError:
        pass  # written as the client sent it
    body = json.dumps({"name": function.get("name", ""), "arguments": arguments}, ensure_ascii=False)
    return f"{CALL_OPEN}\n{body}\n{CALL_CLOSE}"
