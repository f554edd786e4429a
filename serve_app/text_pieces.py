"""What the reasoning parsers (serve_app/reasoning.py, serve_app/harmony.py) share: a reply's
text cut into (kind, text) pieces as it streams, and the two helpers over them."""

from __future__ import annotations

Piece = tuple[str, str]  # (kind: "reasoning" | "content", text), text never empty


def partial_suffix(text: str, marker: str) -> int:
    """Length of the longest tail of text that is a proper prefix of marker: what a stream must
    hold back because the next delta may complete the marker."""
    for length in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-length:]):
            return length
    return 0


def merge_pieces(pieces: list[Piece]) -> list[Piece]:
    """Neighbouring pieces of one kind joined."""
    merged: list[Piece] = []
    for kind, text in pieces:
        if merged and merged[-1][0] == kind:
            merged[-1] = (kind, merged[-1][1] + text)
        else:
            merged.append((kind, text))
    return merged
