"""Incremental detokenization: token ids arrive a few at a time, text goes out as deltas.

Decoding each new token alone is wrong twice over: a multi-byte UTF-8 character can be
split across tokens (alone, each half decodes to U+FFFD), and tokenizers that mark word
starts (SentencePiece's "▁") decode a token differently with and without its left context.
So we decode a short window twice, with and without the new tokens:

    token_ids: [ ... | prefix_offset ...... | read_offset ...... new ]
                       |<-- prefix_text --->|
                       |<------------- new_text ----------------->|

    delta = new_text[len(prefix_text):], emitted only when it does not end in U+FFFD
    (an incomplete character); then prefix_offset = read_offset, read_offset = len.

The window starts inside the prompt (its last few tokens) so the first output token gets
its left context. Concatenated deltas (plus finish()) equal decode(output_ids) for
byte-level BPE and SentencePiece tokenizers alike.
"""

from __future__ import annotations

from typing import Callable

Decode = Callable[[list[int]], str]  # token ids -> text, special tokens skipped

PROMPT_CONTEXT_TOKENS = 5  # prompt tokens kept as left context for the first output token
REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    def __init__(self, decode: Decode, prompt_token_ids: list[int]) -> None:
        self._decode = decode
        context = prompt_token_ids[-PROMPT_CONTEXT_TOKENS:]
        self._token_ids: list[int] = list(context)
        self._prefix_offset = 0
        self._read_offset = len(context)

    def add(self, new_token_ids: list[int]) -> str:
        """Appends tokens; returns the text that is now certain (maybe "")."""
        self._token_ids.extend(new_token_ids)
        return self._advance(final=False)

    def finish(self) -> str:
        """Text still held back (an incomplete character at the very end), as decoded."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        if self._read_offset == len(self._token_ids):
            return ""
        prefix_text = self._decode(self._token_ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(self._token_ids[self._prefix_offset :])
        if not final and (len(new_text) <= len(prefix_text) or new_text.endswith(REPLACEMENT_CHAR)):
            return ""
        delta = new_text[len(prefix_text) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._token_ids)
        self._compact()
        return delta

    def _compact(self) -> None:
        """Drops ids left of the window so memory stays O(window), not O(output)."""
        if self._prefix_offset > 64:
            del self._token_ids[: self._prefix_offset]
            self._read_offset -= self._prefix_offset
            self._prefix_offset = 0
