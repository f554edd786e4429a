"""The reasoning parser (serve_app/reasoning.py): whole texts, and the same texts streamed in
pieces cut at every awkward place (inside `<think>`, inside `</think>`, in the whitespace
around them), which must add up to the whole parse."""

from __future__ import annotations

import random

import pytest

from serve_app.reasoning import (ReasoningParser, choose_reasoning_parser, decodes_special_tokens, make_reasoning_parser,
                                 prompt_opens_reasoning, split_reasoning)

QWEN3_GENERATION_PROMPT = "<|im_start|>assistant\n"
THINKING_GENERATION_PROMPT = "<|im_start|>assistant\n<think>\n"  # the template opens the thought itself
NO_THINKING_GENERATION_PROMPT = "<|im_start|>assistant\n<think>\n\n</think>\n\n"  # enable_thinking=False

CASES = [  # (prompt tail, output, reasoning, content)
    (QWEN3_GENERATION_PROMPT, "<think>\nThe user greets.\n</think>\n\nHello!", "The user greets.", "Hello!"),
    (QWEN3_GENERATION_PROMPT, "  <think>a < b </thin k></think>x", "a < b </thin k>", "x"),
    (QWEN3_GENERATION_PROMPT, "Hello! <think>no</think>", None, "Hello! <think>no</think>"),  # not at the start
    (QWEN3_GENERATION_PROMPT, "\n\nHi", None, "\n\nHi"),  # no thought: content as written
    (QWEN3_GENERATION_PROMPT, "<think>\n\n</think>\n\nHi", None, "Hi"),  # an empty thought
    (QWEN3_GENERATION_PROMPT, "<think>\nstill thinking, max_tokens hit\n", "still thinking, max_tokens hit", ""),
    (QWEN3_GENERATION_PROMPT, "<think>cut inside the end tag </thi", "cut inside the end tag </thi", ""),
    (QWEN3_GENERATION_PROMPT, "<thi", None, "<thi"),  # ended inside the start tag: text
    (QWEN3_GENERATION_PROMPT, "", None, ""),
    (THINKING_GENERATION_PROMPT, "Two plus two.\n</think>\n\n4", "Two plus two.", "4"),
    (THINKING_GENERATION_PROMPT, "no end tag at all", "no end tag at all", ""),
    (THINKING_GENERATION_PROMPT, "x</think>a</think>b<think>c", "x", "a</think>b<think>c"),
    (NO_THINKING_GENERATION_PROMPT, "4", None, "4"),  # the prompt closed the thought
    (NO_THINKING_GENERATION_PROMPT, "<think>x</think>4", "x", "4"),
]


@pytest.mark.parametrize("prompt_tail, output, reasoning, content", CASES)
def test_whole_texts_split_into_reasoning_and_content(prompt_tail, output, reasoning, content) -> None:
    assert split_reasoning(output, prompt_tail) == (reasoning, content)


def stream(prompt_tail: str, pieces: list[str]) -> tuple[str | None, str, list[tuple[str, str]]]:
    parser = ReasoningParser.for_prompt(prompt_tail)
    deltas = [delta for piece in pieces for delta in parser.feed(piece)] + parser.finish()
    assert all(text for _, text in deltas), deltas  # no empty deltas
    reasoning = "".join(text for kind, text in deltas if kind == "reasoning")
    return reasoning or None, "".join(text for kind, text in deltas if kind == "content"), deltas


@pytest.mark.parametrize("prompt_tail, output, reasoning, content", CASES)
def test_streamed_pieces_add_up_to_the_whole_split_at_every_cut(prompt_tail, output, reasoning, content) -> None:
    for size in (1, 2, 3, 7):
        pieces = [output[i:i + size] for i in range(0, len(output), size)]
        assert stream(prompt_tail, pieces)[:2] == (reasoning, content), (size, pieces)
    for first in range(len(output) + 1):  # every single cut, the second part maybe cut again
        for second in (first, (first + len(output)) // 2, len(output)):
            pieces = [output[:first], output[first:second], output[second:]]
            assert stream(prompt_tail, pieces)[:2] == (reasoning, content), pieces


def test_random_pieces_of_random_texts_agree_with_the_whole() -> None:
    rng = random.Random(7)
    alphabet = ["<think>", "</think>", "<", "/", "think", ">", "\n", " ", "a", "b", "</", "<th"]
    for _ in range(400):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 12)))
        tail = rng.choice([QWEN3_GENERATION_PROMPT, THINKING_GENERATION_PROMPT])
        cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, rng.randint(0, 5))))
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
        assert stream(tail, pieces)[:2] == split_reasoning(text, tail), (text, pieces)


def test_reasoning_is_sent_as_it_comes_and_the_tags_never_are() -> None:
    parser = ReasoningParser.for_prompt(QWEN3_GENERATION_PROMPT)
    assert parser.feed("<th") == []  # could still be the start tag
    assert parser.feed("ink>\nLet me") == [("reasoning", "Let me")]
    assert parser.feed(" see.\n</") == [("reasoning", " see.")]  # the newline and "</" wait
    assert parser.feed("think>\n\n") == []
    assert parser.feed("Paris.") == [("content", "Paris.")]
    assert parser.finish() == []
    _, _, deltas = stream(QWEN3_GENERATION_PROMPT, ["<think>a\n", "\nb</think>c"])
    assert deltas == [("reasoning", "a"), ("reasoning", "\n\nb"), ("content", "c")]


def test_the_parser_is_chosen_from_the_template_or_the_config() -> None:
    qwen3 = "{%- if enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    chatml = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>{% endfor %}"
    assert choose_reasoning_parser(qwen3) == "qwen3" and choose_reasoning_parser(chatml) is None
    assert choose_reasoning_parser(None) is None
    assert choose_reasoning_parser(qwen3, "none") is None and choose_reasoning_parser(chatml, "qwen3") == "qwen3"
    assert choose_reasoning_parser(qwen3, "auto", tags_reach_text=False) is None  # special tags: never seen
    assert choose_reasoning_parser(qwen3, "qwen3", tags_reach_text=False) is None
    assert prompt_opens_reasoning(THINKING_GENERATION_PROMPT)
    assert not prompt_opens_reasoning(NO_THINKING_GENERATION_PROMPT) and not prompt_opens_reasoning("")


# gpt-oss's harmony format (serve_app/harmony.py): the analysis channel is the reasoning
ANALYSIS = "<|channel|>analysis<|message|>"
FINAL = "<|start|>assistant<|channel|>final<|message|>"
HARMONY_CASES = [  # (output, reasoning, content)
    (f"{ANALYSIS}The user greets.<|end|>{FINAL}Hello!<|return|>", "The user greets.", "Hello!"),
    (f"{ANALYSIS}a <| b < c<|end|>{FINAL}x <|en d|> y", "a <| b < c", "x <|en d|> y"),  # marker-like text
    (f"{ANALYSIS}first<|end|><|start|>assistant{ANALYSIS}second<|end|>{FINAL}ok", "firstsecond", "ok"),
    ("<|channel|>final<|message|>Just the answer.", None, "Just the answer."),
    (f"{ANALYSIS}cut by max_tokens", "cut by max_tokens", ""),
    (f"{ANALYSIS}cut inside a marker <|en", "cut inside a marker <|en", ""),
    (f"{ANALYSIS}thought<|end|><|start|>assis", "thought", ""),  # a header cut short: dropped
    ("<|channel|>commentary to=functions.f <|constrain|>json<|message|>{\"a\": 1}<|call|>", None, '{"a": 1}'),
    ("Plain text, no harmony.", None, "Plain text, no harmony."),
    ("Text <|channel|>analysis<|message|>x", None, "Text <|channel|>analysis<|message|>x"),  # not at the start
    ("<|chan", None, ""),  # ended inside the first marker: markup
    ("<|im_start|>x", None, "<|im_start|>x"),
    ("", None, ""),
]


def harmony_stream(pieces: list[str]) -> tuple[str | None, str, list[tuple[str, str]]]:
    parser = make_reasoning_parser("harmony", "")
    deltas = [delta for piece in pieces for delta in parser.feed(piece)] + parser.finish()
    assert all(text for _, text in deltas), deltas
    reasoning = "".join(text for kind, text in deltas if kind == "reasoning")
    return reasoning or None, "".join(text for kind, text in deltas if kind == "content"), deltas


@pytest.mark.parametrize("output, reasoning, content", HARMONY_CASES)
def test_harmony_whole_and_streamed_at_every_cut(output, reasoning, content) -> None:
    assert split_reasoning(output, "", "harmony") == (reasoning, content)
    for size in (1, 2, 5):
        pieces = [output[i:i + size] for i in range(0, len(output), size)]
        assert harmony_stream(pieces)[:2] == (reasoning, content), (size, pieces)
    for first in range(len(output) + 1):
        for second in (first, (first + len(output)) // 2, len(output)):
            pieces = [output[:first], output[first:second], output[second:]]
            assert harmony_stream(pieces)[:2] == (reasoning, content), pieces


def test_harmony_random_pieces_agree_with_the_whole() -> None:
    rng = random.Random(11)
    alphabet = [ANALYSIS, FINAL, "<|end|>", "<|return|>", "<|", "|>", "<|start|>", "assistant", "<|channel|>",
                "final", "<|message|>", " ", "a", "<"]
    for _ in range(400):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 10)))
        cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, rng.randint(0, 5))))
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
        assert harmony_stream(pieces)[:2] == split_reasoning(text, "", "harmony"), (text, pieces)


def test_harmony_reasoning_is_sent_as_it_comes_and_markers_never_are() -> None:
    parser = make_reasoning_parser("harmony", "")
    assert parser.feed("<|chan") == []
    assert parser.feed("nel|>analysis<|mess") == []
    assert parser.feed("age|>Let me") == [("reasoning", "Let me")]
    assert parser.feed(" see.<|e") == [("reasoning", " see.")]  # "<|e" waits: it may be <|end|>
    assert parser.feed("nd|><|start|>assistant<|channel|>final<|message|>Par") == [("content", "Par")]
    assert parser.feed("is.") == [("content", "is.")]
    assert parser.finish() == []


def test_harmony_is_chosen_from_its_template() -> None:
    harmony = "{{- '<|start|>assistant<|channel|>final<|message|>' }}"
    assert choose_reasoning_parser(harmony) == "harmony"
    assert choose_reasoning_parser(harmony, tags_reach_text=False) == "harmony"  # its markers are decoded kept
    assert choose_reasoning_parser(harmony, "none") is None and choose_reasoning_parser("", "harmony") == "harmony"
    assert decodes_special_tokens("harmony") and not decodes_special_tokens("qwen3")
    assert not decodes_special_tokens(None)
