"""Tool calls out of generated text: whole (non-streaming) and incremental (streaming).

A call is `<tool_call>` JSON `</tool_call>` where the JSON is {"name": <one of the allowed
functions>, "arguments": <object>} (serve_app/tools.py writes the format into the prompt and,
for required / named tool_choice, into the grammar). `arguments` is returned as the exact
text the model wrote, so the streamed fragments concatenate to the non-streamed string.

parse_tool_calls: every call block must parse, or the text is all content (a model that
writes something call-like but broken has not made a call). The text outside the blocks,
stripped, is the message content (None when empty).

ToolCallStreamer turns text deltas into OpenAI chat deltas as they come:

    TEXT  --"<tool_call>"-->  HEAD  --'{"name": "f", "arguments": '-->  ARGS  --balanced }-->  TAIL
     ^                        | emits nothing     emits {id, type, name, arguments: ""}   |
     +----------------"</tool_call>"------------------------------------------------------+
    ARGS emits each piece of the arguments as {"index": i, "function": {"arguments": piece}}.

TEXT holds back any tail that could still become "<tool_call>" and whitespace after a call;
everything else is content. A HEAD that cannot become a call is given back as content.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from serve_app.text_pieces import run_states
from serve_app.tools import CALL_CLOSE, CALL_OPEN

_BLOCK = re.compile(re.escape(CALL_OPEN) + r"(.*?)" + re.escape(CALL_CLOSE), re.DOTALL)
_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"([^"\\]*)"\s*,\s*"arguments"\s*:\s*')
_HEAD_PREFIX = '{"name": "'  # a HEAD buffer that diverges from this (whitespace aside) is no call


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def tool_call_json(name: str, arguments: str, call_id: str | None = None) -> dict[str, Any]:
    return {"id": call_id or new_call_id(), "type": "function", "function": {"name": name, "arguments": arguments}}


def calls_from_deltas(deltas: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The whole calls that a stream's tool_calls deltas add up to (a delta with an id opens one)."""
    calls: list[dict[str, Any]] = []
    for call in (call for delta in deltas for call in delta.get("tool_calls", [])):
        if "id" in call:
            calls.append(tool_call_json(call["function"]["name"], "", call["id"]))
        calls[call["index"]]["function"]["arguments"] += call["function"]["arguments"]
    return calls


def is_json_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except json.JSONDecodeError:
        return False


def parse_tool_calls(text: str, allowed_names: tuple[str, ...],
                     max_calls: int | None = None) -> tuple[str | None, list[dict[str, Any]]]:
    """(content, tool calls) of a whole choice's text; no calls unless every block parses.
    max_calls: the first that many calls are returned, later ones dropped (None: all)."""
    calls = []
    for match in _BLOCK.finditer(text):
        call = _parse_call(match.group(1), allowed_names)
        if call is None:
            return text, []
        calls.append(tool_call_json(*call))
    if not calls:
        return text, []
    content = _BLOCK.sub("", text).strip()
    return content or None, calls[:max_calls]


def _parse_call(body: str, allowed_names: tuple[str, ...]) -> tuple[str, str] | None:
    head = _HEAD.match(body)
    if head is None or head.group(1) not in allowed_names:
        return None
    try:
        _, end = json.JSONDecoder().raw_decode(body, head.end())
        whole = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(whole.get("arguments"), dict) or set(whole) != {"name", "arguments"}:
        return None
    return head.group(1), body[head.end():end]


@dataclass(slots=True)
class JsonScanner:
    """Finds where a JSON value ends, piece by piece (strings and escapes respected)."""

    depth: int = 0
    in_string: bool = False
    escaped: bool = False
    started: bool = False

    def feed(self, text: str) -> int | None:
        """Characters of text that belong to the value; None: all of them, and it goes on."""
        for position, char in enumerate(text):
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif char == "\\":
                    self.escaped = True
                elif char == '"':
                    self.in_string = False
            elif char == '"':
                self.in_string = True
            elif char in "{[":
                self.depth += 1
                self.started = True
            elif char in "}]":
                self.depth -= 1
                if self.depth == 0:
                    return position + 1
        return None


@dataclass(slots=True)
class ToolCallStreamer:
    allowed_names: tuple[str, ...]
    state: str = "TEXT"  # TEXT | HEAD | ARGS | TAIL (see the module doc)
    buffer: str = ""  # text held back in the current state
    max_calls: int | None = None  # calls streamed at most; later ones are dropped (None: all)
    num_calls: int = 0  # calls opened so far (the next call's index)
    scanner: JsonScanner = field(default_factory=JsonScanner)
    dropping: bool = False  # the call in ARGS / TAIL is one past max_calls: nothing of it is sent

    def feed(self, text: str) -> list[dict[str, Any]]:
        """Chat deltas ({"content": ...} or {"tool_calls": [...]}) for the new text."""
        self.buffer += text
        return _merge(run_states(self, []))

    def finish(self) -> list[dict[str, Any]]:
        """The held-back text at the end of the choice (an unfinished call's text is content)."""
        held, self.buffer = self.buffer, ""
        if self.state == "HEAD":
            held = CALL_OPEN + held
        if self.state in ("TEXT", "HEAD") and held and (self.num_calls == 0 or held.strip()):
            return [{"content": held}]
        return []

    def _step_text(self, deltas: list[dict[str, Any]]) -> None:
        start = self.buffer.find(CALL_OPEN)
        if start >= 0:
            self._emit_content(self.buffer[:start], deltas)
            self.buffer = self.buffer[start + len(CALL_OPEN):]
            self.state = "HEAD"
            return
        keep = _partial_suffix(self.buffer, CALL_OPEN)
        if self.num_calls and not self.buffer[:len(self.buffer) - keep].strip():
            return  # whitespace between calls: held until something else shows up
        self._emit_content(self.buffer[:len(self.buffer) - keep], deltas)
        self.buffer = self.buffer[len(self.buffer) - keep:]

    def _emit_content(self, text: str, deltas: list[dict[str, Any]]) -> None:
        if text and (self.num_calls == 0 or text.strip()):
            deltas.append({"content": text})

    def _step_head(self, deltas: list[dict[str, Any]]) -> None:
        head = _HEAD.match(self.buffer)
        if head is not None and head.end() == len(self.buffer):
            return  # the whitespace before the arguments may go on
        if head is not None and head.group(1) in self.allowed_names:
            self.dropping = self.max_calls is not None and self.num_calls >= self.max_calls
            if not self.dropping:
                deltas.append({"tool_calls": [{"index": self.num_calls, **tool_call_json(head.group(1), "")}]})
                self.num_calls += 1
            self.buffer = self.buffer[head.end():]
            self.scanner = JsonScanner()
            self.state = "ARGS"
        elif head is not None or not _could_be_head(self.buffer):
            self._emit_content(CALL_OPEN + self.buffer, deltas)  # not a call after all
            self.buffer = ""
            self.state = "TEXT"

    def _step_args(self, deltas: list[dict[str, Any]]) -> None:
        if not self.buffer:
            return
        end = self.scanner.feed(self.buffer)
        piece = self.buffer if end is None else self.buffer[:end]
        if not self.dropping:
            deltas.append({"tool_calls": [{"index": self.num_calls - 1, "function": {"arguments": piece}}]})
        self.buffer = "" if end is None else self.buffer[end:]
        if end is not None:
            self.state = "TAIL"

    def _step_tail(self, deltas: list[dict[str, Any]]) -> None:
        end = self.buffer.find(CALL_CLOSE)
        if end >= 0:
            self.buffer = self.buffer[end + len(CALL_CLOSE):]
            self.state = "TEXT"


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest tail of text that is a proper prefix of marker."""
    for length in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-length:]):
            return length
    return 0


def _could_be_head(buffer: str) -> bool:
    """Whether more text could still make buffer a call head (whitespace aside, a prefix of it)."""
    compact = re.sub(r"\s+", "", buffer)
    expected = _HEAD_PREFIX.replace(" ", "")
    if len(compact) <= len(expected):
        return expected.startswith(compact)
    return compact.startswith(expected) and len(buffer) < 256


def _merge(deltas: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Adjacent content deltas as one, and argument pieces of one call as one (the header,
    with its id and name and arguments "", stays a delta of its own, as OpenAI sends it)."""
    merged: list[dict[str, Any]] = []
    for delta in deltas:
        last = merged[-1] if merged else None
        if last is not None and "content" in last and "content" in delta:
            last["content"] += delta["content"]
            continue
        if (last is not None and "tool_calls" in last and "tool_calls" in delta
                and last["tool_calls"][0]["index"] == delta["tool_calls"][0]["index"]
                and "id" not in delta["tool_calls"][0] and "id" not in last["tool_calls"][0]):
            last["tool_calls"][0]["function"]["arguments"] += delta["tool_calls"][0]["function"]["arguments"]
            continue
        merged.append(delta)
    return merged
