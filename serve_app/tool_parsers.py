"""Tool-call parsers, one per family's format, chosen from the chat template.

    hermes       <tool_call>{"name": ..., "arguments": {...}}</tool_call>, anywhere in the text,
                 any number (Hermes, Qwen2.5, Qwen3, SmolLM3; and the format serve_app/tools.py
                 writes into the prompt of templates that render no tools) -> serve_app/tool_calls.py
    llama3_json  [<|python_tag|>] {"name": ..., "parameters": {...}} [; {...}]*   (Llama 3.x;
                 "arguments" is accepted for "parameters")
    mistral      [TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]   (Mistral, Mixtral)
    harmony      <|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}<|call|>
                 (gpt-oss; read by the harmony reasoning parser: serve_app/harmony.py)

choose_tool_call_parser reads the template: harmony's "<|channel|>" -> harmony, "[TOOL_CALLS]"
-> mistral, "<|python_tag|>" or an "ipython" role with "parameters" -> llama3_json, anything
else -> hermes. The parser
reads "auto" replies of templates that render tools themselves; forced calls (tool_choice
"required" or named) follow the grammar's format, hermes, whatever the template, and so do
replies to our own tools prompt.

llama3_json and mistral calls open the reply (leading whitespace aside): their markers are
special tokens in those tokenizers and the detokenizer skips special tokens, so the marker
is optional in the text and the JSON at the start is what counts. A reply that starts with
anything else is content, all of it. JsonCallsStreamer reads them delta by delta:

    START --marker, "["--> HEAD --'{"name": "f", "parameters": '--> ARGS --balanced }--> TAIL
      |                     ^                                                          |
      |                     +------------- "}" then ";" (llama) / "," (mistral) -------+
      +--- other text --> CONTENT <---------- "}" then anything else / "]" -------------+

A HEAD that cannot become a call before any call was sent gives the whole text back as
content. The whole (non-streamed) parse runs the same streamer over the whole text, so for
well-formed calls the streamed pieces add up to it exactly. A reply whose calls are broken
(arguments that are not a JSON object, a call object or list left open, e.g. cut by
max_tokens) is all content in a whole response, as with hermes; a stream cannot take back
what it sent, so there the calls read so far stand and the rest is content.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Protocol

from serve_app.harmony import HARMONY_MARKER, HarmonyCalls
from serve_app.text_pieces import run_states
from serve_app.tool_calls import JsonScanner, ToolCallStreamer, calls_from_deltas, is_json_object, parse_tool_calls, tool_call_json

HERMES = "hermes"
LLAMA3_JSON = "llama3_json"
MISTRAL = "mistral"
HARMONY = "harmony"
TOOL_CALL_PARSERS = (HERMES, LLAMA3_JSON, MISTRAL, HARMONY)
HEAD_LIMIT = 256  # characters a call's head may take before the reply counts as content


class ToolStreamer(Protocol):
    num_calls: int

    def feed(self, text: str) -> list[dict[str, Any]]: ...

    def finish(self) -> list[dict[str, Any]]: ...


def choose_tool_call_parser(chat_template: str | None, override: str | None = "auto") -> str:
    """The parser for this template (module doc); override: a parser name, or "auto"."""
    if override not in (None, "auto"):
        return override
    template = chat_template or ""
    if HARMONY_MARKER in template:
        return HARMONY
    if "[TOOL_CALLS]" in template:
        return MISTRAL
    if "<|python_tag|>" in template or ("ipython" in template and '"parameters"' in template):
        return LLAMA3_JSON
    return HERMES


@dataclass(frozen=True, slots=True)
class JsonCallsFormat:
    marker: str  # written before the calls (a special token: often absent from the text)
    opens: str  # opens the list of calls ("" for none)
    separator: str  # between calls
    closes: str  # closes the list ("" for none: the calls end at the first other text)
    head: re.Pattern[str]  # a call object up to its arguments' opening brace


def _head(argument_keys: str) -> re.Pattern[str]:
    return re.compile(r'\s*\{\s*"name"\s*:\s*"([^"\\]*)"\s*,\s*"(?:' + argument_keys + r')"\s*:\s*(?=\{)')


FORMATS = {
    LLAMA3_JSON: JsonCallsFormat("<|python_tag|>", "", ";", "", _head("parameters|arguments")),
    MISTRAL: JsonCallsFormat("[TOOL_CALLS]", "[", ",", "]", _head("arguments")),
}
_HEAD_PREFIX = '{"name":"'  # a HEAD buffer that diverges from this (whitespace aside) is no call


@dataclass(slots=True)
class JsonCallsStreamer:
    """Calls at the start of a reply (llama3_json, mistral), delta by delta (module doc)."""

    fmt: JsonCallsFormat
    allowed_names: tuple[str, ...]
    max_calls: int | None = None  # calls sent at most; later ones are dropped (None: all)
    state: str = "START"  # START | HEAD | ARGS | TAIL | NEXT | AFTER | CONTENT
    buffer: str = ""  # text held in the current state
    consumed: str = ""  # text taken before the first call (marker, "["): content if no call comes
    num_calls: int = 0  # calls sent so far (the next call's index)
    num_seen: int = 0  # calls read so far, dropped ones included
    broken: bool = False  # a call was not well formed (see the module doc)
    scanner: JsonScanner = field(default_factory=JsonScanner)

    def feed(self, text: str) -> list[dict[str, Any]]:
        self.buffer += text
        return run_states(self, [])

    def finish(self) -> list[dict[str, Any]]:
        """Held text at the end: before any call it is content; after calls, only words are."""
        held, self.buffer = self.buffer, ""
        inside = self.state in ("ARGS", "TAIL") or (self.state == "HEAD" and held.strip())
        if self.num_seen and (inside or (self.state in ("HEAD", "NEXT") and self.fmt.closes)):
            self.broken = True  # ended inside a call, or before the list closed (a trailing ";" is fine)
        if self.state in ("START", "HEAD") and self.num_seen == 0:
            held = self.consumed + held
            return [{"content": held}] if held else []
        if self.state in ("HEAD", "NEXT", "AFTER", "CONTENT") and held.strip():
            return [{"content": held.strip() if self.state != "CONTENT" else held}]
        return []

    def _step_start(self, deltas: list[dict[str, Any]]) -> None:
        fmt = self.fmt
        stripped = self.buffer.lstrip()
        if stripped.startswith(fmt.marker):
            stripped = stripped[len(fmt.marker):].lstrip()
        elif fmt.marker.startswith(stripped):
            return  # may still become the marker
        if not stripped:
            return
        if not stripped.startswith(fmt.opens or "{"):
            self.state = "CONTENT"
            return
        taken = len(self.buffer) - len(stripped) + len(fmt.opens)
        self.consumed, self.buffer = self.buffer[:taken], self.buffer[taken:]
        self.state = "HEAD"

    def _step_head(self, deltas: list[dict[str, Any]]) -> None:
        head = self.fmt.head.match(self.buffer)
        if head is not None and head.group(1) in self.allowed_names:
            self.num_seen += 1
            if self.max_calls is None or self.num_calls < self.max_calls:
                deltas.append({"tool_calls": [{"index": self.num_calls, **tool_call_json(head.group(1), "")}]})
                self.num_calls += 1
            self.buffer = self.buffer[head.end():]
            self.scanner = JsonScanner()
            self.state = "ARGS"
        elif head is not None or not _could_be_head(self.buffer):
            if self.num_seen == 0:  # not a call after all: the whole reply is content
                self.buffer, self.consumed = self.consumed + self.buffer, ""
                self.state = "CONTENT"
            else:
                self.broken = True
                self.state = "AFTER"

    def _step_args(self, deltas: list[dict[str, Any]]) -> None:
        if not self.buffer:
            return
        end = self.scanner.feed(self.buffer)
        piece = self.buffer if end is None else self.buffer[:end]
        if self.num_calls == self.num_seen:  # not a dropped call
            deltas.append({"tool_calls": [{"index": self.num_calls - 1, "function": {"arguments": piece}}]})
        self.buffer = "" if end is None else self.buffer[end:]
        if end is not None:
            self.state = "TAIL"

    def _step_tail(self, deltas: list[dict[str, Any]]) -> None:
        stripped = self.buffer.lstrip()
        if not stripped:
            return
        if stripped.startswith("}"):
            self.buffer = stripped[1:]
            self.state = "NEXT"
        else:
            self.broken = True  # more keys after the arguments: the call stands, the rest is text
            self.state = "AFTER"

    def _step_next(self, deltas: list[dict[str, Any]]) -> None:
        stripped = self.buffer.lstrip()
        if not stripped:
            return
        fmt = self.fmt
        if stripped.startswith(fmt.separator):
            self.buffer = stripped[len(fmt.separator):]
            self.state = "HEAD"
        else:
            closed = bool(fmt.closes) and stripped.startswith(fmt.closes)
            self.broken = bool(fmt.closes) and not closed  # llama3_json's calls simply end at other text
            self.buffer = stripped[len(fmt.closes):] if closed else stripped
            self.state = "AFTER"

    def _step_after(self, deltas: list[dict[str, Any]]) -> None:
        self.buffer = self.buffer.lstrip()
        if self.buffer:
            self.state = "CONTENT"

    def _step_content(self, deltas: list[dict[str, Any]]) -> None:
        if self.buffer:
            deltas.append({"content": self.buffer})
            self.buffer = ""


def _could_be_head(buffer: str) -> bool:
    """Whether more text could still make buffer a call head (whitespace aside, a prefix of it)."""
    compact = re.sub(r"\s+", "", buffer)
    if len(compact) <= len(_HEAD_PREFIX):
        return _HEAD_PREFIX.startswith(compact)
    return compact.startswith(_HEAD_PREFIX) and len(buffer) < HEAD_LIMIT


def make_tool_streamer(parser: str, allowed_names: tuple[str, ...], max_calls: int | None) -> ToolStreamer:
    if parser == HERMES:
        return ToolCallStreamer(allowed_names, max_calls=max_calls)
    if parser == HARMONY:
        return HarmonyCalls(allowed_names, max_calls)
    return JsonCallsStreamer(FORMATS[parser], allowed_names, max_calls=max_calls)


def parse_calls(parser: str, text: str, allowed_names: tuple[str, ...],
                max_calls: int | None = None) -> tuple[str | None, list[dict[str, Any]]]:
    """(content, tool calls) of a whole reply; no calls (or broken ones): (text, [])."""
    if parser == HERMES:
        return parse_tool_calls(text, allowed_names, max_calls)
    streamer = JsonCallsStreamer(FORMATS[parser], allowed_names, max_calls=max_calls)
    deltas = streamer.feed(text) + streamer.finish()
    if streamer.broken:
        return text, []
    calls = calls_from_deltas(deltas)
    if not calls or not all(is_json_object(call["function"]["arguments"]) for call in calls):
        return text, []
    content = "".join(delta.get("content", "") for delta in deltas).strip()
    return content or None, calls
