"""The text layer against a real transformers tokenizer (the tiny model's byte-level BPE)."""

from __future__ import annotations

import asyncio
import random
import threading

import pytest

from serve_app.choice_tracker import ChoiceTracker
from serve_app.detokenizer import IncrementalDetokenizer
from serve_app.tokenizer import TokenizerService
from scheduler.outputs import FinishReason, RequestOutput

TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "héllo wörld, ça va? naïve café",
    "日本語のテキストと中文文本",
    "emoji 😀🎉👩‍👩‍👧 mixed ascii",
    "Ελληνικά и русский текст",
]


@pytest.fixture(scope="module")
def service() -> TokenizerService:
    from tiny_model import build_tokenizer

    return TokenizerService(build_tokenizer())


def full_decode(service: TokenizerService, ids: list[int]) -> str:
    return service.decode_on_loop(ids)


@pytest.mark.parametrize("text", TEXTS)
def test_streamed_text_equals_full_decode_for_any_chunking(service: TokenizerService, text: str) -> None:
    prompt = service.encode_sync("Prompt: ")
    ids = service.encode_sync(text, add_special_tokens=False)
    rng = random.Random(len(text))
    for _ in range(10):
        detokenizer = IncrementalDetokenizer(service.decode_on_loop, prompt)
        deltas, position = [], 0
        while position < len(ids):
            size = rng.randint(1, 4)
            deltas.append(detokenizer.add(ids[position : position + size]))
            position += size
        deltas.append(detokenizer.finish())
        assert "".join(deltas) == full_decode(service, ids) == text
        assert not any("\ufffd" in delta for delta in deltas)


def test_random_token_ids_stream_like_they_decode(service: TokenizerService) -> None:
    vocab = len(service.tokenizer)
    rng = random.Random(7)
    for _ in range(50):
        ids = [rng.randrange(3, vocab) for _ in range(30)]
        detokenizer = IncrementalDetokenizer(service.decode_on_loop, [])
        text = "".join(detokenizer.add([token]) for token in ids) + detokenizer.finish()
        assert text == full_decode(service, ids)


def test_token_bytes_are_exact_and_partial_tokens_are_marked(service: TokenizerService) -> None:
    for text in TEXTS:
        ids = service.encode_sync(text, add_special_tokens=False)
        assert bytes(b for token in ids for b in service.token_bytes(token)) == text.encode()
        for token in ids:
            piece = service.token_text(token)
            try:
                bytes(service.token_bytes(token)).decode()
                assert piece == bytes(service.token_bytes(token)).decode()
            except UnicodeDecodeError:
                assert piece.startswith("bytes:\\x")


def test_tracker_hides_eos_and_cuts_stop_strings_with_real_tokens(service: TokenizerService) -> None:
    eos = service.tokenizer.eos_token_id
    ids = service.encode_sync("Paris is the capital of France.", add_special_tokens=False)
    tracker = ChoiceTracker(0, service.decode_on_loop, [], ["capital"], frozenset({eos}))
    deltas = [tracker.update(RequestOutput("r", 0, [token], None, None, 1, 0)) for token in ids[:-1]]
    texts = [delta.text for delta in deltas if delta is not None]
    assert "".join(texts) == "Paris is the "
    assert deltas[-1] is None  # tokens after the stop string are dropped
    assert tracker.finish_reason == "stop"
    plain = ChoiceTracker(0, service.decode_on_loop, [], [], frozenset({eos}))
    first = plain.update(RequestOutput("r", 0, ids, None, None, 1, 0)).text
    last = plain.update(RequestOutput("r", 0, [eos], None, FinishReason.STOP, 1, 0))
    assert first + last.text == "Paris is the capital of France."


def test_chat_template_and_encoding_run_on_the_tokenizer_thread(service: TokenizerService) -> None:
    seen: list[str] = []
    original = service.encode_sync

    def recording_encode(text: str, add_special_tokens: bool = True, max_length: int | None = None) -> list[int]:
        seen.append(threading.current_thread().name)
        return original(text, add_special_tokens, max_length)

    service.encode_sync = recording_encode  # type: ignore[method-assign]
    try:
        messages = [{"role": "user", "content": "hi"}]
        ids = asyncio.run(service.encode_chat(messages))
        asyncio.run(service.encode("hello"))
    finally:
        del service.encode_sync
    assert all(name.startswith("tokenizer") for name in seen) and len(seen) == 2
    text = service.decode_on_loop(ids, skip_special_tokens=False)
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_bounded_encoding_judges_huge_prompts_by_their_head(service: TokenizerService) -> None:
    huge = "lorem ipsum " * 150_000
    tokenized_lengths = []  # characters of each text the tokenizer was given
    original = service.tokenizer.encode

    def spying_encode(text, *args, **kwargs):
        tokenized_lengths.append(len(text))
        return original(text, *args, **kwargs)

    service.tokenizer.encode = spying_encode
    try:
        ids = service.encode_sync(huge, max_length=1024)
    finally:
        del service.tokenizer.encode
    assert len(ids) >= 1024
    assert tokenized_lengths and max(tokenized_lengths) < len(huge) // 10  # a head (64k of 1.8M characters) only
    assert ids[:1024] == service.encode_sync(huge[:20_000])[:1024]


def test_bounded_encoding_is_exact_below_the_limit(service: TokenizerService) -> None:
    text = "Paris is the capital of France. " * 40
    assert service.encode_sync(text, max_length=100_000) == service.encode_sync(text)
    assert service.encode_sync(text, max_length=10) == service.encode_sync(text)[:10]
    spaced = "x" + " " * 70_000 + "y"  # over the limit: judged by its head, same leading ids
    bounded = service.encode_sync(spaced, max_length=4096)
    assert len(bounded) >= 4096 and bounded[:4096] == service.encode_sync(spaced)[:4096]


@pytest.mark.parametrize("tags_are_tokens", [False, True])
def test_reasoning_comes_apart_token_by_token_with_real_tokens(tags_are_tokens: bool) -> None:
    """Think tags as Qwen3 ships them (added, non-special tokens) and as plain BPE pieces."""
    from tiny_model import build_tokenizer

    from serve_app.reasoning import ReasoningParser

    tokenizer = build_tokenizer()
    if tags_are_tokens:
        tokenizer.add_tokens(["<think>", "</think>"], special_tokens=False)
    service = TokenizerService(tokenizer)
    assert service.keeps_text("<think>x</think>")
    text = "<think>\nWhy? Ünïcode 😀 thoughts.\n</think>\n\nBecause."
    ids = service.encode_sync(text, add_special_tokens=False)
    assert (len(service.encode_sync("</think>", add_special_tokens=False)) == 1) == tags_are_tokens
    tracker = ChoiceTracker(0, service.decode_on_loop, service.encode_sync("Prompt: "), [], frozenset())
    parser = ReasoningParser.for_prompt("assistant\n")
    pieces = []
    for position, token in enumerate(ids):
        finish = FinishReason.LENGTH if position == len(ids) - 1 else None
        pieces += parser.feed(tracker.update(RequestOutput("r", 0, [token], None, finish, 1, 0)).text)
    pieces += parser.finish()
    assert "".join(piece for kind, piece in pieces if kind == "reasoning") == "Why? Ünïcode 😀 thoughts."
    assert "".join(piece for kind, piece in pieces if kind == "content") == "Because."


def test_think_tags_made_special_do_not_reach_the_text() -> None:
    """Then decoding skips them, and the server turns its reasoning parser off (app.py)."""
    from tiny_model import build_tokenizer

    tokenizer = build_tokenizer()
    tokenizer.add_tokens(["<think>", "</think>"], special_tokens=True)
    assert not TokenizerService(tokenizer).keeps_text("<think>x</think>")
