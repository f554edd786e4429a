"""gpt-oss's "harmony" output: its `analysis` channel becomes `reasoning_content`.

A gpt-oss reply is a run of messages, each a header and a body. The prompt ends with
`<|start|>assistant`, so the first header starts at its channel:

    <|channel|>analysis<|message|>The user greets.<|end|>
    <|start|>assistant<|channel|>final<|message|>Hello!<|return|>

(one line here; the model writes no newlines between them). A header runs up to `<|message|>`
and names its channel after `<|channel|>` (`commentary` headers may go on with ` to=...` and
`<|constrain|>json`). A body runs up to `<|end|>`, `<|return|>` or `<|call|>`, or to the end of
the text. `analysis` bodies are reasoning; every other channel's body (`final`, and
`commentary`: a preamble, or a tool call's arguments, which are not parsed into tool_calls
yet) is content. The markers are special tokens, so the route decodes a harmony reply with
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

from dataclasses import dataclass

from serve_app.text_pieces import Piece, merge_pieces, partial_suffix, run_states

CHANNEL = "<|channel|>"
MESSAGE = "<|message|>"
START = "<|start|>"
BODY_ENDS = ("<|end|>", "<|return|>", "<|call|>")
REASONING_CHANNEL = "analysis"
HARMONY_MARKER = CHANNEL  # a chat template that writes it is a harmony one



@dataclass(slots=True)
class HarmonyParser:
    """Splits one choice's text into reasoning and content, delta by delta (module docstring)."""

    state: str = "HEADER"  # HEADER | BODY | CONTENT
    buffer: str = ""  # text held back in the current state
    kind: str = "content"  # BODY: the kind of the current message's text
    first: bool = True  # HEADER: no message has been read yet

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
