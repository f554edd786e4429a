"""Stop strings matched on streamed text, with the smallest possible hold-back.

Text arrives in deltas. We emit it at once except for the longest tail that is still a
proper prefix of some stop string (it might complete into one with the next delta):

    pending = held + delta
    1. the earliest occurrence of any stop string in pending -> emit pending[:start], stop
    2. else hold h = the longest suffix of pending that a stop string starts with;
       emit pending[:-h]

Because every emitted text has no stop-string prefix at its end, a stop string can only
start inside `pending`, so step 1 never misses a match that spans deltas, and the stop
text (and anything after it) never reaches the client.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class StopResult:
    text: str  # safe to emit now
    stopped: bool  # a stop string was found; text ends right before it


class StopStringMatcher:
    def __init__(self, stop_strings: list[str]) -> None:
        assert all(stop_strings), "stop strings must be non-empty"
        self._stops = list(stop_strings)
        self._held = ""
        self.stopped = False
        self.matched: str | None = None  # the stop string that ended the sequence

    def add(self, delta: str) -> StopResult:
        assert not self.stopped, "no text after a stop string"
        if not self._stops:
            return StopResult(delta, False)
        pending = self._held + delta
        start = self._earliest_match(pending)
        if start is not None:
            self._held = ""
            self.stopped = True
            self.matched = min((stop for stop in self._stops if pending.find(stop) == start), key=len)
            return StopResult(pending[:start], True)
        hold = self._longest_partial_suffix(pending)
        self._held = pending[len(pending) - hold :]
        return StopResult(pending[: len(pending) - hold], False)

    def flush(self) -> str:
        """The held text, when the sequence ended without completing a stop string."""
        held, self._held = self._held, ""
        return held

    def _earliest_match(self, text: str) -> int | None:
        starts = [index for index in (text.find(stop) for stop in self._stops) if index >= 0]
        return min(starts) if starts else None

    def _longest_partial_suffix(self, text: str) -> int:
        longest = 0
        for stop in self._stops:
            for size in range(min(len(stop) - 1, len(text)), longest, -1):
                if text.endswith(stop[:size]):
                    longest = size
                    break
        return longest
