"""Reasoning text out of generated text: `<think>…</think>` becomes `reasoning_content`.

Pure Python (no ray, no torch): the chat route feeds it each choice's text deltas and sends
what it returns as `delta.reasoning_content` / `delta.content` (streamed), or joins them
into `message.reasoning_content` / `message.content` (whole responses run the same parser
over the whole text, so both agree exactly).

The parser is chosen from the chat template (choose_reasoning_parser): a template whose
text mentions `<think>` and `</think>` (Qwen3, SmolLM3, DeepSeek-R1 distills) gets
"qwen3"; one that writes harmony's `<|channel|>` (gpt-oss) gets "harmony"
(serve_app/harmony.py: the `analysis` channel is the reasoning); any other template gets
None, and the output is content exactly as without a parser. The tags must reach the text: in these families they are ordinary added tokens,
not special ones, so the detokenizer keeps them.

Where the thought starts:
- in the prompt: the template opens `<think>` itself (the rendered prompt's tail has an
  unclosed `<think>`, as Qwen3-Thinking and DeepSeek-R1 templates write it): the output
  starts as reasoning and only `</think>` is looked for;
- in the output: the output (leading whitespace aside) starts with `<think>`; output that
  starts with anything else is content, all of it.

Layout: the whitespace right after `<think>`, right before `</think>` and right after
`</think>` is dropped (the template's newlines, not the model's words). Text after
`</think>` is content; a second `<think>` there is content too.

No `</think>` at all (the output ended by max_tokens, a stop string or a timeout inside the
thought): everything after the start is reasoning and content is null. vLLM's Qwen3 parser
calls such text content in whole responses; here it stays reasoning so that the streamed
and the whole response agree (a stream cannot take back reasoning deltas it has sent), and
because an unfinished thought is not an answer.

States of the streaming parser:

    START --"<think>"--> REASONING --"</think>"--> AFTER --non-space--> CONTENT
      |  (prompt opened it: starts in REASONING)                           ^
      +------------------------- anything else ----------------------------+

START holds text that could still become `<think>`; REASONING holds a tail that could still
become `</think>` and trailing whitespace; AFTER drops whitespace.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from serve_app.harmony import HARMONY_MARKER, HarmonyParser, split_harmony
from serve_app.text_pieces import merge_pieces, partial_suffix, run_states

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"
QWEN3 = "qwen3"
HARMONY = "harmony"
REASONING_PARSERS = (QWEN3, HARMONY)  # names an app config may pick

Kind = Literal["reasoning", "content"]
Piece = tuple[Kind, str]  # (kind, text), text never empty


def choose_reasoning_parser(chat_template: str | None, override: str | None = "auto",
                            tags_reach_text: bool = True) -> str | None:
    """The parser for this template: override "none" -> None, a parser name -> it, "auto"
    (or None) -> "harmony" when the template writes harmony's channels, "qwen3" when it writes
    think tags, else None. tags_reach_text False (the tokenizer makes the think tags special
    tokens, which decoding skips): no "qwen3", since the parser would never see `</think>` and
    would call every reply a thought. (harmony's markers are special tokens too: a harmony
    reply is decoded with them kept, decodes_special_tokens.)"""
    if override == "none":
        return None
    template = chat_template or ""
    if override in (None, "auto"):
        thinks = THINK_OPEN in template and THINK_CLOSE in template
        override = HARMONY if HARMONY_MARKER in template else QWEN3 if thinks else None
    if override == QWEN3 and not tags_reach_text:
        return None
    return override


def decodes_special_tokens(parser: str | None) -> bool:
    """Whether a reply parsed by `parser` is decoded with its special tokens (harmony's markers)."""
    return parser == HARMONY


def make_reasoning_parser(parser: str, prompt_tail: str, calls: bool = False) -> ReasoningParser | HarmonyParser:
    """A fresh streaming parser of that name for one choice (calls: harmony's function calls
    come out as tool-call pieces, serve_app/harmony.py)."""
    return HarmonyParser(calls=calls) if parser == HARMONY else ReasoningParser.for_prompt(prompt_tail)


def prompt_opens_reasoning(prompt_tail: str) -> bool:
    """Whether the rendered prompt ends inside a thought (its last `<think>` is unclosed)."""
    return prompt_tail.rfind(THINK_OPEN) > prompt_tail.rfind(THINK_CLOSE)


@dataclass(slots=True)
class ReasoningParser:
    """Splits one choice's text into reasoning and content, delta by delta (module doc)."""

    state: str = "START"  # START | REASONING | AFTER | CONTENT
    buffer: str = ""  # text held back in the current state
    started: bool = False  # REASONING has sent text (its leading whitespace is gone)

    @classmethod
    def for_prompt(cls, prompt_tail: str) -> ReasoningParser:
        return cls(state="REASONING" if prompt_opens_reasoning(prompt_tail) else "START")

    def feed(self, text: str) -> list[Piece]:
        self.buffer += text
        return merge_pieces(run_states(self, []))

    def finish(self) -> list[Piece]:
        """What is held at the end of the choice: a partial tag is text of its state."""
        held, self.buffer = self.buffer, ""
        if self.state == "START" and held:
            return [("content", held)]
        if self.state == "REASONING" and held.strip():
            return [("reasoning", held.rstrip() if self.started else held.strip())]
        return []

    def _step_start(self, pieces: list[Piece]) -> None:
        stripped = self.buffer.lstrip()
        if stripped.startswith(THINK_OPEN):
            self.buffer = stripped[len(THINK_OPEN):]
            self.state = "REASONING"
        elif not THINK_OPEN.startswith(stripped):
            self.state = "CONTENT"  # no thought: everything is content, as written

    def _step_reasoning(self, pieces: list[Piece]) -> None:
        if not self.started:
            self.buffer = self.buffer.lstrip()
            if not self.buffer:
                return
        end = self.buffer.find(THINK_CLOSE)
        if end >= 0:
            self._emit(self.buffer[:end].rstrip(), pieces)
            self.buffer = self.buffer[end + len(THINK_CLOSE):]
            self.state = "AFTER"
            return
        keep = partial_suffix(self.buffer, THINK_CLOSE)
        body = self.buffer[:len(self.buffer) - keep]
        sent = body.rstrip()  # trailing whitespace waits: it may come right before </think>
        self._emit(sent, pieces)
        self.buffer = self.buffer[len(sent):]

    def _emit(self, text: str, pieces: list[Piece]) -> None:
        if text:
            pieces.append(("reasoning", text))
            self.started = True

    def _step_after(self, pieces: list[Piece]) -> None:
        self.buffer = self.buffer.lstrip()
        if self.buffer:
            self.state = "CONTENT"

    def _step_content(self, pieces: list[Piece]) -> None:
        if self.buffer:
            pieces.append(("content", self.buffer))
            self.buffer = ""


def split_reasoning(text: str, prompt_tail: str, parser_name: str = QWEN3) -> tuple[str | None, str]:
    """(reasoning or None, content) of a whole choice's text, as the stream would give them."""
    if parser_name == HARMONY:
        return split_harmony(text)
    parser = ReasoningParser.for_prompt(prompt_tail)
    pieces = parser.feed(text) + parser.finish()
    reasoning = "".join(piece for kind, piece in pieces if kind == "reasoning")
    content = "".join(piece for kind, piece in pieces if kind == "content")
    return reasoning or None, content
