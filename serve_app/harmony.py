"""gpt-oss's "harmony" output: its `analysis` channel becomes `reasoning_content`, and its
function calls become `tool_calls`.

A gpt-oss reply is a run of messages, each a header and a body. The prompt ends with
`<|start|>assistant`, so the first header starts at its channel:

    <|channel|>analysis<|message|>The user greets.<|end|>
    <|start|>assistant<|channel|>final<|message|>Hello!<|return|>

(one line here; the model writes no newlines between them). A header runs up to `<|message|>`
and names its channel after `<|channel|>` (`commentary` headers may go on with ` to=...` and
`<|constrain|>json`). A body runs up to `<|end|>`, `<|return|>` or `<|call|>`, or to the end of
the text. `analysis` bodies are reasoning; every other channel's body (`final`, and a
`commentary` preamble) is content. A message addressed to a function is a tool call:

    <|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city":"Paris"}<|call|>

(the recipient may also stand before the channel: `<|start|>assistant to=functions.NAME<|channel|>
commentary json<|message|>...`). A parser made with calls=True gives its name as a
("tool_call", NAME) piece and its body as ("tool_args", ...) pieces, which HarmonyCalls turns
into tool_calls deltas; without it (a request with no tools) the body is content, as written. The markers are special tokens, so the route decodes a harmony reply with
its special tokens kept (the EOS tokens `<|return|>` and `<|call|>` are never in the text:
they end the choice), and no marker reaches the message.

Output that does not start as a header (leading whitespace aside) is content, all of it, as
written. A header cut short by the end of the text is dropped; a body cut short is its
channel's text. The streaming parser gives the same pieces as the whole text, whatever the
cuts (the parser holds back a tail that could still become a marker).

    HEADER --"<|message|>"--> BODY --"<|end|>" | "<|return|>" | "<|call|>"--> HEADER
      +-- not a header --> CONTENT (to the end)
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from serve_app.text_pieces import Piece, merge_pieces, partial_suffix, run_states
from serve_app.tool_calls import calls_from_deltas, is_json_object, tool_call_json

CHANNEL = "<|channel|>"
MESSAGE = "<|message|>"
START = "<|start|>"
BODY_ENDS = ("<|end|>", "<|return|>", "<|call|>")
REASONING_CHANNEL = "analysis"
HARMONY_MARKER = CHANNEL  # a chat template that writes it is a harmony one
TOOL_CALL, TOOL_ARGS = "tool_call", "tool_args"  # the piece kinds of a function call (calls=True)
FUNCTION_RECIPIENT = re.compile(r"\bto=functions\.([^\s<]+)")


@dataclass(slots=True)
class HarmonyParser:
    """Splits one choice's text into reasoning and content, delta by delta (module docstring)."""

    state: str = "HEADER"  # HEADER | BODY | CONTENT
    buffer: str = ""  # text held back in the current state
    kind: str = "content"  # BODY: the kind of the current message's text
    first: bool = True  # HEADER: no message has been read yet
    calls: bool = False  # messages to functions are tool calls (module docstring); False: content

    def feed(self, text: str) -> list[Piece]:
        self.buffer += text
        return merge_pieces(run_states(self, []))

    def finish(self) -> list[Piece]:
        held, self.buffer = self.buffer, ""
        if self.state == "HEADER" and self.first and held and not _could_be_header(held):
            return [("content", held)]
        if self.state in ("BODY", "CONTENT") and held:
            return [(self.kind if self.state == "BODY" else "content", held)]
        return []  # a header cut short: markup, not text

    def _step_header(self, pieces: list[Piece]) -> None:
        if self.first and not _could_be_header(self.buffer):
            self.state = "CONTENT"  # not harmony: everything is content, as written
            return
        end = self.buffer.find(MESSAGE)
        if end < 0:
            return
        header, self.buffer = self.buffer[:end], self.buffer[end + len(MESSAGE):]
        self.kind = "reasoning" if _channel(header) == REASONING_CHANNEL else "content"
        function = FUNCTION_RECIPIENT.search(header) if self.calls else None
        if function is not None:
            pieces.append((TOOL_CALL, function.group(1)))
            self.kind = TOOL_ARGS
        self.state, self.first = "BODY", False

    def _step_body(self, pieces: list[Piece]) -> None:
        ends = [(at, marker) for marker in BODY_ENDS if (at := self.buffer.find(marker)) >= 0]
        if ends:
            at, marker = min(ends)
            _emit(pieces, self.kind, self.buffer[:at])
            self.buffer, self.state = self.buffer[at + len(marker):], "HEADER"
            return
        keep = max(partial_suffix(self.buffer, marker) for marker in BODY_ENDS)
        _emit(pieces, self.kind, self.buffer[:len(self.buffer) - keep])
        self.buffer = self.buffer[len(self.buffer) - keep:]

    def _step_content(self, pieces: list[Piece]) -> None:
        _emit(pieces, "content", self.buffer)
        self.buffer = ""


def split_harmony(text: str) -> tuple[str | None, str]:
    """(reasoning or None, content) of a whole choice's text, as the stream would give them."""
    parser = HarmonyParser()
    pieces = parser.feed(text) + parser.finish()
    reasoning = "".join(piece for kind, piece in pieces if kind == "reasoning")
    return reasoning or None, "".join(piece for kind, piece in pieces if kind == "content")


@dataclass(slots=True)
class HarmonyCalls:
    """One choice's harmony pieces (a parser with calls=True) as chat deltas: a call to an
    allowed function opens a tool call and its body streams as the call's arguments; calls past
    max_calls are dropped; a call to a function the request did not offer stays content."""

    allowed_names: tuple[str, ...]
    max_calls: int | None = None
    num_calls: int = 0  # calls sent so far
    target: str = "content"  # where the current message's tool_args go: "call", "content" or "drop"

    def feed(self, text: str) -> list[dict[str, Any]]:
        return [{"content": text}] if text else []

    def feed_piece(self, kind: str, text: str) -> list[dict[str, Any]]:
        if kind == TOOL_CALL:
            if text not in self.allowed_names:
                self.target = "content"
                return []
            if self.max_calls is not None and self.num_calls >= self.max_calls:
                self.target = "drop"
                return []
            self.target = "call"
            self.num_calls += 1
            return [{"tool_calls": [{"index": self.num_calls - 1, **tool_call_json(text, "")}]}]
        if kind == TOOL_ARGS:
            if self.target == "call":
                return [{"tool_calls": [{"index": self.num_calls - 1, "function": {"arguments": text}}]}]
            return self.feed(text) if self.target == "content" else []
        return [{"reasoning_content": text}] if kind == "reasoning" else self.feed(text)

    def finish(self) -> list[dict[str, Any]]:
        return []


def harmony_message(text: str, allowed_names: tuple[str, ...],
                    max_calls: int | None = None) -> tuple[str | None, str, list[dict[str, Any]]]:
    """(reasoning or None, content, tool calls) of a whole choice's text. Calls whose arguments
    are not a JSON object make it a reply without calls (their bodies are content), as with the
    other parsers' broken calls."""
    parser = HarmonyParser(calls=True)
    calls_reader = HarmonyCalls(allowed_names, max_calls)
    deltas = [delta for kind, piece in parser.feed(text) + parser.finish()
              for delta in calls_reader.feed_piece(kind, piece)]
    reasoning = "".join(delta.get("reasoning_content", "") for delta in deltas)
    calls = calls_from_deltas(deltas)
    if not all(is_json_object(call["function"]["arguments"]) for call in calls):
        reasoning_only, content = split_harmony(text)
        return reasoning_only, content, []
    return reasoning or None, "".join(delta.get("content", "") for delta in deltas), calls


def _could_be_header(text: str) -> bool:
    """Whether text (a reply's start) is, or could still grow into, a header's beginning."""
    stripped = text.lstrip()
    return any(stripped.startswith(marker) or marker.startswith(stripped) for marker in (CHANNEL, START))


def _channel(header: str) -> str:
    """The channel a header names: the word after <|channel|>, up to a space or a marker."""
    at = header.find(CHANNEL)
    if at < 0:
        return ""
    name = header[at + len(CHANNEL):]
    return name.split("<|", 1)[0].split(" ", 1)[0].strip()


def _emit(pieces: list[Piece], kind: str, text: str) -> None:
    if text:
        pieces.append((kind, text))
