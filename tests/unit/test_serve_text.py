"""Incremental detokenization, stop strings and the per-choice tracker (no Ray, no torch)."""

from __future__ import annotations

import random

import pytest

from serve_app.choice_tracker import ChoiceTracker
from serve_app.detokenizer import IncrementalDetokenizer
from serve_app.stop_strings import StopStringMatcher
from serve_app.testing import EOS_ID, ByteTokenizer, text_tokens
from scheduler.outputs import FinishReason, RequestOutput

TOKENIZER = ByteTokenizer()


def decode(ids: list[int]) -> str:
    return TOKENIZER.decode(ids, skip_special_tokens=True)


def stream_text(detokenizer: IncrementalDetokenizer, ids: list[int], chunk_sizes: list[int]) -> list[str]:
    deltas, position = [], 0
    for size in chunk_sizes:
        deltas.append(detokenizer.add(ids[position : position + size]))
        position += size
    deltas.append(detokenizer.add(ids[position:]))
    deltas.append(detokenizer.finish())
    return deltas


@pytest.mark.parametrize("text", ["plain ascii", "héllo wörld", "日本語のテキスト", "emoji 😀🎉 end", "a\u0301b"])
def test_detokenizer_deltas_join_to_full_text_and_never_hold_partial_characters(text: str) -> None:
    ids = text_tokens(text)
    rng = random.Random(0)
    for _ in range(20):
        sizes = [rng.randint(1, 3) for _ in range(len(ids))]
        deltas = stream_text(IncrementalDetokenizer(decode, text_tokens("prompt ")), ids, sizes)
        assert "".join(deltas) == text
        assert not any("\ufffd" in delta for delta in deltas)


def test_detokenizer_one_token_at_a_time_emits_whole_characters() -> None:
    detokenizer = IncrementalDetokenizer(decode, [])
    deltas = [detokenizer.add([token]) for token in text_tokens("é😀")]
    assert deltas == ["", "é", "", "", "", "😀"]


def test_detokenizer_finish_flushes_an_incomplete_tail() -> None:
    detokenizer = IncrementalDetokenizer(decode, [])
    assert detokenizer.add(text_tokens("ab")) == "ab"
    assert detokenizer.add(text_tokens("😀")[:2]) == ""
    assert detokenizer.finish() == "\ufffd"


def test_detokenizer_skips_special_tokens() -> None:
    detokenizer = IncrementalDetokenizer(decode, [257])
    assert detokenizer.add(text_tokens("hi")) == "hi"
    assert detokenizer.add([EOS_ID]) == ""
    assert detokenizer.finish() == ""


def test_detokenizer_long_output_stays_correct_after_compaction() -> None:
    text = "ünïcödé " * 100
    deltas = stream_text(IncrementalDetokenizer(decode, []), text_tokens(text), [1] * 900)
    assert "".join(deltas) == text


def feed(matcher: StopStringMatcher, pieces: list[str]) -> tuple[str, bool]:
    out = []
    for piece in pieces:
        result = matcher.add(piece)
        out.append(result.text)
        if result.stopped:
            return "".join(out), True
    return "".join(out) + matcher.flush(), False


@pytest.mark.parametrize(
    "pieces, stops, expected",
    [
        (["Hello ", "wor", "ld"], ["world"], ("Hello ", True)),
        (["Hello", " END", " more"], [" END"], ("Hello", True)),
        (["abc"], ["x"], ("abc", False)),
        (["ab", "c", "d"], ["cd", "bc"], ("a", True)),  # earliest match wins
        (["a", "b", "a", "b", "c"], ["abc"], ("ab", True)),  # overlapping partial matches
        (["STOP"], ["STOP"], ("", True)),
        (["tail wo"], ["world"], ("tail wo", False)),  # held text is flushed at the end
    ],
)
def test_stop_strings_cut_before_the_stop_text(pieces, stops, expected) -> None:
    assert feed(StopStringMatcher(stops), pieces) == expected


def test_stop_strings_hold_back_only_possible_prefixes() -> None:
    matcher = StopStringMatcher(["world"])
    assert matcher.add("hello w").text == "hello "
    assert matcher.add("o").text == ""
    assert matcher.add("x").text == "wox"


def test_stop_strings_random_split_points_agree_with_whole_text() -> None:
    rng = random.Random(1)
    text = "the cat sat on the mat; the end. then more text follows"
    for stop in ["the end", "mat;", "zzz", "t", "follows"]:
        cut = text.find(stop)
        expected = (text[:cut], True) if cut >= 0 else (text, False)
        for _ in range(30):
            points = sorted(rng.sample(range(1, len(text)), 8))
            pieces = [text[i:j] for i, j in zip([0, *points], [*points, len(text)])]
            assert feed(StopStringMatcher([stop]), pieces) == expected


def output(ids: list[int], finish: FinishReason | None = None, index: int = 0) -> RequestOutput:
    return RequestOutput("r", index, ids, None, finish, 3, 0)


def make_tracker(stops: list[str]) -> ChoiceTracker:
    return ChoiceTracker(0, decode, [1, 2, 3], stops, frozenset({EOS_ID}))


def test_tracker_hides_eos_text_and_reports_finish_reason() -> None:
    tracker = make_tracker([])
    first = tracker.update(output(text_tokens("hi")))
    last = tracker.update(output([EOS_ID], FinishReason.STOP))
    assert (first.text, first.finish_reason) == ("hi", None)
    assert (last.text, last.finish_reason) == ("", "stop")
    assert tracker.num_output_tokens == 3


def test_tracker_stop_string_finishes_and_drops_later_tokens() -> None:
    tracker = make_tracker(["</s>"])
    assert tracker.update(output(text_tokens("ok </"))).text == "ok "
    delta = tracker.update(output(text_tokens("s> trailing")))
    assert (delta.text, delta.finish_reason) == ("", "stop")
    assert tracker.stopped_by_string and tracker.finished
    assert tracker.update(output(text_tokens("more"))) is None


def test_tracker_length_finish_flushes_held_text() -> None:
    tracker = make_tracker(["world"])
    assert tracker.update(output(text_tokens("hello wor"))).text == "hello "
    delta = tracker.update(output(text_tokens("l"), FinishReason.LENGTH))
    assert (delta.text, delta.finish_reason) == ("worl", "length")
