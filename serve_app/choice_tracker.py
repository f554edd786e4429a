"""Per-sequence text state: engine token deltas in, client text deltas out.

One ChoiceTracker per returned choice (n per prompt). It turns each RequestOutput into a
ChoiceDelta: detokenizes incrementally, cuts at stop strings, hides the text of the token
that stopped generation (EOS or a stop_token_id, as OpenAI does), and counts tokens.
Once finished, later outputs for the sequence are dropped (tokens the engine produced
between a stop string and its abort).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from serve_app.detokenizer import Decode, IncrementalDetokenizer
from serve_app.stop_strings import StopStringMatcher
from scheduler.outputs import FinishReason, RequestOutput, TokenLogprobs


@dataclass(slots=True)
class ChoiceDelta:
    index: int  # choice index in the response (prompt_index * n + sequence index)
    text: str  # new text for the client (may be "")
    token_ids: list[int]  # tokens that arrived with this delta
    logprobs: list[TokenLogprobs] | None  # aligned with token_ids, where asked
    finish_reason: str | None  # "stop", "length" or "abort" on the last delta


class ChoiceTracker:
    def __init__(
        self,
        index: int,
        decode: Decode,
        prompt_token_ids: list[int],
        stop_strings: list[str],
        hidden_stop_token_ids: frozenset[int],
    ) -> None:
        self.index = index
        self._detokenizer = IncrementalDetokenizer(decode, prompt_token_ids)
        self._stop_matcher = StopStringMatcher(stop_strings)
        self._hidden_stop_token_ids = hidden_stop_token_ids
        self.num_output_tokens = 0
        self.finish_reason: str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def stopped_by_string(self) -> bool:
        return self._stop_matcher.stopped

    @property
    def stop_string(self) -> str | None:
        """The stop string that ended this choice; None: none did."""
        return self._stop_matcher.matched

    def update(self, output: RequestOutput) -> ChoiceDelta | None:
        if self.finished:
            return None
        token_ids = list(output.new_token_ids)
        text_token_ids = token_ids
        if (
            output.finish_reason is FinishReason.STOP
            and token_ids
            and token_ids[-1] in self._hidden_stop_token_ids
        ):
            text_token_ids = token_ids[:-1]
        text = self._detokenizer.add(text_token_ids)
        if output.finished:
            text += self._detokenizer.finish()
        result = self._stop_matcher.add(text)
        self.num_output_tokens += len(token_ids)
        text = result.text
        if result.stopped:
            self.finish_reason = FinishReason.STOP.value
        elif output.finished:
            text += self._stop_matcher.flush()
            self.finish_reason = output.finish_reason.value
        return ChoiceDelta(self.index, text, token_ids, output.new_logprobs, self.finish_reason)

    def finish(self, reason: str) -> ChoiceDelta | None:
        """Ends an unfinished choice here (a timeout): flushes held-back text; None if finished."""
        if self.finished:
            return None
        result = self._stop_matcher.add(self._detokenizer.finish())
        text = result.text if result.stopped else result.text + self._stop_matcher.flush()
        self.finish_reason = FinishReason.STOP.value if result.stopped else reason
        return ChoiceDelta(self.index, text, [], None, self.finish_reason)


@dataclass(slots=True)
class RequestTracker:
    """The choices of one engine request (one prompt), plus its prompt-side usage."""

    request_id: str
    prompt_token_ids: list[int]
    choices: list[ChoiceTracker]  # by sequence index within n
    num_cached_tokens: int = 0
    engine_finished: set[int] = field(default_factory=set)  # sequence indexes the engine ended

    @property
    def finished(self) -> bool:
        return all(choice.finished for choice in self.choices)

    @property
    def engine_done(self) -> bool:
        return len(self.engine_finished) == len(self.choices)

    @property
    def num_output_tokens(self) -> int:
        return sum(choice.num_output_tokens for choice in self.choices)

    def update(self, output: RequestOutput) -> ChoiceDelta | None:
        self.num_cached_tokens = max(self.num_cached_tokens, output.num_cached_tokens)
        if output.finished:
            self.engine_finished.add(output.index)
        return self.choices[output.index].update(output)


def make_request_tracker(
    request_id: str,
    prompt_token_ids: list[int],
    n: int,
    first_index: int,
    decode: Decode,
    stop_strings: list[str],
    hidden_stop_token_ids: frozenset[int],
) -> RequestTracker:
    choices = [
        ChoiceTracker(first_index + i, decode, prompt_token_ids, stop_strings, hidden_stop_token_ids)
        for i in range(n)
    ]
    return RequestTracker(request_id, prompt_token_ids, choices)
