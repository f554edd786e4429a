"""Logprobs in OpenAI's two response formats.

Completions (legacy), per choice or per chunk:
    {"tokens": [str], "token_logprobs": [float], "top_logprobs": [{str: float}],
     "text_offset": [int]}   # offsets into the choice's text (echoed prompt included)
    top_logprobs holds the k most likely tokens plus the sampled one (up to k + 1 keys).

Chat, per choice or per chunk:
    {"content": [{"token": str, "logprob": float, "bytes": [int],
                  "top_logprobs": [{"token", "logprob", "bytes"}] * k}], "refusal": None}

Values are log_softmax of the raw logits (see scheduler/outputs.py); -inf is sent as
-9999.0 because JSON has no infinity.
"""

from __future__ import annotations

import math
from typing import Any, Callable

from scheduler.outputs import TokenLogprobs

MIN_LOGPROB = -9999.0


def finite(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else MIN_LOGPROB


class CompletionLogprobs:
    """Builds legacy logprobs for one choice, keeping text_offset running across chunks."""

    def __init__(self, token_text: Callable[[int], str], num_top: int, text_offset: int = 0) -> None:
        self._token_text = token_text
        self._num_top = num_top
        self._text_offset = text_offset

    def format(self, entries: list[TokenLogprobs]) -> dict[str, Any]:
        tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
        for entry in entries:
            text = self._token_text(entry.token_id)
            tokens.append(text)
            token_logprobs.append(finite(entry.logprob))
            top = {self._token_text(tid): finite(lp) for tid, lp in entry.top[: self._num_top]}
            top.setdefault(text, finite(entry.logprob))
            top_logprobs.append(top)
            offsets.append(self._text_offset)
            self._text_offset += len(text)
        return {
            "tokens": tokens,
            "token_logprobs": token_logprobs,
            "top_logprobs": top_logprobs,
            "text_offset": offsets,
        }


class ChatLogprobs:
    """Builds chat `logprobs.content` entries."""

    def __init__(
        self,
        token_text: Callable[[int], str],
        token_bytes: Callable[[int], list[int] | None],
        num_top: int,
    ) -> None:
        self._token_text = token_text
        self._token_bytes = token_bytes
        self._num_top = num_top

    def _entry(self, token_id: int, logprob: float) -> dict[str, Any]:
        return {
            "token": self._token_text(token_id),
            "logprob": finite(logprob),
            "bytes": self._token_bytes(token_id),
        }

    def format(self, entries: list[TokenLogprobs]) -> list[dict[str, Any]]:
        content = []
        for entry in entries:
            item = self._entry(entry.token_id, entry.logprob)
            item["top_logprobs"] = [self._entry(tid, lp) for tid, lp in entry.top[: self._num_top]]
            content.append(item)
        return content
