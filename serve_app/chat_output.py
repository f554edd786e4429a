"""A chat choice's text as OpenAI's message / deltas: reasoning, content, tool calls.

The text a choice generates goes through up to two parsers, in this order:

    text --reasoning parser--> reasoning_content
                          \\--> content text --tool-call parser--> content, tool_calls

- the reasoning parser (serve_app/reasoning.py) when the model's template has one and the
  output is free (a grammar-constrained output is all answer, so it is not parsed);
- the tool-call parser (serve_app/tool_parsers.py: hermes, llama3_json or mistral) when
  the request has tools and a tool_choice other than "none".

gpt-oss's harmony is the exception: its one parser (serve_app/harmony.py) reads reasoning,
content and function calls from the channel markers, and HarmonyCalls turns them into deltas.

With neither, the message is {"role": "assistant", "content": text} and each delta
{"content": text}, exactly as before either existed. With a reasoning parser the message
always carries "reasoning_content" (null when the model did not think).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from serve_app.harmony import HarmonyCalls, harmony_message
from serve_app.reasoning import HARMONY, QWEN3, make_reasoning_parser, split_reasoning
from serve_app.tool_parsers import HERMES, ToolStreamer, make_tool_streamer, parse_calls
from serve_app.tools import ToolPlan

TOOL_CALLS_FINISH_REASON = "tool_calls"


@dataclass(frozen=True, slots=True)
class OutputPlan:
    tools: ToolPlan | None  # the request's tools; None: no tools
    reasoning_prompt_tail: str | None  # the prompt's last text when reasoning is parsed; None: not parsed
    tool_parser: str = HERMES  # the format tool calls are read in (serve_app/tool_parsers.py)
    reasoning_parser: str = QWEN3  # the reasoning parser when reasoning is parsed (serve_app/reasoning.py)

    @property
    def parses_calls(self) -> bool:
        return self.tools is not None and self.tools.parses_calls

    @property
    def harmony_calls(self) -> bool:
        """Function calls are read by the harmony parser, with the reasoning (module docstring)."""
        return (self.parses_calls and self.tool_parser == HARMONY and self.reasoning_parser == HARMONY
                and self.reasoning_prompt_tail is not None)


def chat_message(text: str, finish_reason: str | None, plan: OutputPlan) -> tuple[dict[str, Any], str | None]:
    """(message, finish_reason) of a whole chat choice."""
    if plan.harmony_calls:
        assert plan.tools is not None
        reasoning, content, calls = harmony_message(text, plan.tools.allowed_names, plan.tools.max_calls)
        empty = not content and (calls or reasoning is not None)  # the model only thought or called
        message: dict[str, Any] = {"role": "assistant", "content": None if empty else content,
                                   "reasoning_content": reasoning}
        if not calls:
            return message, finish_reason
        message["tool_calls"] = calls
        return message, TOOL_CALLS_FINISH_REASON if finish_reason == "stop" else finish_reason
    reasoning = None
    if plan.reasoning_prompt_tail is not None:
        reasoning, text = split_reasoning(text, plan.reasoning_prompt_tail, plan.reasoning_parser)
    message = {"role": "assistant", "content": text}
    if plan.reasoning_prompt_tail is not None:
        if reasoning is not None and not text:
            message["content"] = None  # the model only thought
        message["reasoning_content"] = reasoning
    if not plan.parses_calls:
        return message, finish_reason
    assert plan.tools is not None
    content, calls = parse_calls(plan.tool_parser, text, plan.tools.allowed_names, plan.tools.max_calls)
    if not calls:
        return message, finish_reason
    message.update(content=content, tool_calls=calls)
    return message, TOOL_CALLS_FINISH_REASON if finish_reason == "stop" else finish_reason


class ChatStreams:
    """Per choice of a streamed chat response: its parsers, fed its text deltas."""

    def __init__(self, plan: OutputPlan) -> None:
        self._plan = plan
        self._reasoning: dict[int, Any] = {}  # index -> its ReasoningParser or HarmonyParser
        self._tools: dict[int, ToolStreamer] = {}

    def feed(self, index: int, text: str, finish_reason: str | None) -> tuple[list[dict[str, Any]], str | None]:
        """(chat deltas, finish_reason) for one choice's new text."""
        plan = self._plan
        pieces: list[tuple[str, str]] = [("content", text)] if text else []
        if plan.reasoning_prompt_tail is not None:
            parser = self._reasoning.get(index)
            if parser is None:
                parser = self._reasoning[index] = make_reasoning_parser(plan.reasoning_parser,
                                                                        plan.reasoning_prompt_tail,
                                                                        calls=plan.harmony_calls)
            pieces = parser.feed(text) if text else []
            if finish_reason is not None:
                pieces += parser.finish()
        if not plan.parses_calls:
            return [{_field(kind): piece} for kind, piece in pieces], finish_reason
        return self._feed_tools(index, pieces, finish_reason)

    def _feed_tools(self, index: int, pieces: list[tuple[str, str]],
                    finish_reason: str | None) -> tuple[list[dict[str, Any]], str | None]:
        assert self._plan.tools is not None
        streamer = self._tools.get(index)
        if streamer is None:
            tools = self._plan.tools
            streamer = self._tools[index] = make_tool_streamer(self._plan.tool_parser, tools.allowed_names,
                                                               tools.max_calls)
        deltas: list[dict[str, Any]] = []
        for kind, piece in pieces:
            if isinstance(streamer, HarmonyCalls):
                deltas += streamer.feed_piece(kind, piece)
            else:
                deltas += [{"reasoning_content": piece}] if kind == "reasoning" else streamer.feed(piece)
        if finish_reason is None:
            return deltas, None
        deltas += streamer.finish()
        if streamer.num_calls and finish_reason == "stop":
            finish_reason = TOOL_CALLS_FINISH_REASON
        return deltas, finish_reason


def _field(kind: str) -> str:
    return "reasoning_content" if kind == "reasoning" else "content"
