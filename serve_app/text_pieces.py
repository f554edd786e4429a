"""What the streaming text parsers share (serve_app/reasoning.py, serve_app/harmony.py,
serve_app/tool_calls.py, serve_app/tool_parsers.py): a reply's text cut into (kind, text)
pieces as it streams, the helpers over them, and the loop that runs a parser's states."""

from __future__ import annotations

from typing import Any

Piece = tuple[str, str]  # (kind: "reasoning" | "content" | harmony's call kinds, text), text never empty


def partial_suffix(text: str, marker: str) -> int:
    """Length of the longest tail of text that is a proper prefix of marker: what a stream must
    hold back because the next delta may complete the marker."""
    for length in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-length:]):
            return length
    return 0


def merge_pieces(pieces: list[Piece]) -> list[Piece]:
    """Neighbouring pieces of one kind joined (a call's name, harmony's "tool_call", never is)."""
    merged: list[Piece] = []
    for kind, text in pieces:
        if merged and merged[-1][0] == kind and kind != "tool_call":
            merged[-1] = (kind, merged[-1][1] + text)
        else:
            merged.append((kind, text))
    return merged


def run_states(parser: Any, out: list) -> list:
    """Runs parser._step_<state>(out) over parser.buffer until a step changes neither the state
    nor the buffer's length (it needs more text); returns out. A parser's feed() appends the new
    text to its buffer and calls this."""
    while True:
        before = (parser.state, len(parser.buffer))
        getattr(parser, f"_step_{parser.state.lower()}")(out)
        if (parser.state, len(parser.buffer)) == before:
            return out
