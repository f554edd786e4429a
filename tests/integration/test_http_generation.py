"""Generation over real HTTP with the official openai client, against the shared tiny-model app."""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest

GREEDY = {"temperature": 0.0, "extra_body": {"ignore_eos": True}}
MODEL = "tiny"
MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.openai_base_url, api_key="unused", max_retries=0, timeout=120)


def stream_completion_text(client: openai.OpenAI, **kwargs) -> tuple[dict[int, str], dict[int, str], object]:
    texts: dict[int, str] = {}
    finish: dict[int, str] = {}
    usage = None
    for chunk in client.completions.create(model=MODEL, stream=True, stream_options={"include_usage": True}, **kwargs):
        if chunk.usage is not None:
            assert chunk.choices == []
            usage = chunk.usage
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
            if choice.finish_reason is not None:
                finish[choice.index] = choice.finish_reason
    return texts, finish, usage


def stream_chat_text(client: openai.OpenAI, **kwargs) -> tuple[str, str | None, object]:
    text, finish, usage = "", None, None
    for chunk in client.chat.completions.create(model=MODEL, stream=True, stream_options={"include_usage": True}, **kwargs):
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            text += choice.delta.content or ""
            finish = choice.finish_reason or finish
    return text, finish, usage


def test_completion_stream_and_non_stream_agree(client: openai.OpenAI) -> None:
    kwargs = dict(prompt="The quick brown fox", max_tokens=24, **GREEDY)
    whole = client.completions.create(model=MODEL, **kwargs)
    assert whole.choices[0].finish_reason == "length"
    assert whole.usage.completion_tokens == 24
    texts, finish, usage = stream_completion_text(client, **kwargs)
    assert texts == {0: whole.choices[0].text}
    assert finish == {0: "length"}
    assert usage.completion_tokens == 24 and usage.prompt_tokens == whole.usage.prompt_tokens


def test_chat_stream_and_non_stream_agree(client: openai.OpenAI) -> None:
    kwargs = dict(messages=MESSAGES, max_tokens=24, **GREEDY)
    whole = client.chat.completions.create(model=MODEL, **kwargs)
    assert whole.choices[0].message.role == "assistant"
    assert whole.choices[0].finish_reason == "length"
    text, finish, usage = stream_chat_text(client, **kwargs)
    assert (text, finish) == (whole.choices[0].message.content, "length")
    assert usage.total_tokens == whole.usage.total_tokens


def test_sse_framing_ends_with_done(server) -> None:
    body = {"prompt": "Paris is", "max_tokens": 5, "stream": True, "temperature": 0}
    response = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
    assert response.headers["content-type"].startswith("text/event-stream")
    events = response.text.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    assert all(event.startswith("data: {") for event in events[:-2])
    assert json.loads(events[0][len("data: "):])["object"] == "text_completion"


def test_eos_finishes_with_stop(client: openai.OpenAI) -> None:
    # The random tiny model never picks EOS greedily, so 16 seeded samples at temperature 2 (each
    # of 64 tokens meets EOS about 1 time in 6): a choice that meets it ends with "stop" and
    # without EOS's text; the others run to the budget ("length")
    result = client.completions.create(model=MODEL, prompt="One, two, three", max_tokens=64, temperature=2.0,
                                       n=16, seed=1)
    reasons = [choice.finish_reason for choice in result.choices]
    assert "stop" in reasons and set(reasons) <= {"stop", "length"}, reasons
    assert all("<|im_end|>" not in choice.text for choice in result.choices)
    assert result.usage.completion_tokens < 16 * 64  # the stopped ones ended early


def test_stop_string_cuts_the_text_in_both_modes(client: openai.OpenAI) -> None:
    kwargs = dict(prompt="Once upon a time", max_tokens=32, **GREEDY)
    full = client.completions.create(model=MODEL, **kwargs).choices[0].text
    stop = full[10:13]
    assert stop.strip(), f"need a visible stop string, got {stop!r} from {full!r}"
    expected = full[: full.find(stop)]
    result = client.completions.create(model=MODEL, stop=[stop], **kwargs).choices[0]
    assert (result.text, result.finish_reason) == (expected, "stop")
    texts, finish, _ = stream_completion_text(client, stop=stop, **kwargs)
    assert (texts[0], finish[0]) == (expected, "stop")


def test_n_choices_have_indexes(client: openai.OpenAI) -> None:
    result = client.completions.create(model=MODEL, prompt="Tell me a story", n=3, max_tokens=8, temperature=1.0, seed=3,
                                       extra_body={"ignore_eos": True})
    assert sorted(choice.index for choice in result.choices) == [0, 1, 2]
    assert [choice.finish_reason for choice in result.choices] == ["length"] * 3
    assert result.usage.completion_tokens == 3 * 8
    texts, finish, _ = stream_completion_text(client, prompt="Tell me a story", n=3, max_tokens=8, temperature=1.0)
    assert sorted(texts) == [0, 1, 2] and sorted(finish) == [0, 1, 2]
    chat = client.chat.completions.create(model=MODEL, messages=MESSAGES, n=3, max_tokens=4, temperature=1.0)
    assert [choice.index for choice in chat.choices] == [0, 1, 2]


def test_completion_logprobs_shapes(client: openai.OpenAI) -> None:
    result = client.completions.create(model=MODEL, prompt="Berlin is the capital of", max_tokens=6, logprobs=3, **GREEDY)
    logprobs = result.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.top_logprobs) == 6
    for token, logprob, top in zip(logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs):
        assert logprob <= 0.0
        assert 1 <= len(top) <= 4 and all(value <= 0.0 for value in top.values())
        assert max(top.values()) == pytest.approx(logprob)  # greedy: the sampled token is the top-1
        assert top[token] == pytest.approx(logprob)
    assert logprobs.text_offset == sorted(logprobs.text_offset)


def test_chat_logprobs_top1_is_the_sampled_token(client: openai.OpenAI) -> None:
    result = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=6, logprobs=True, top_logprobs=4, **GREEDY)
    content = result.choices[0].logprobs.content
    assert len(content) == 6
    for entry in content:
        assert entry.logprob <= 0.0
        assert len(entry.top_logprobs) == 4
        assert entry.top_logprobs[0].token == entry.token
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob)
        assert entry.bytes is not None
    # the tokens' bytes make the message (a random model can end mid-character: U+FFFD, as in the text)
    assert b"".join(bytes(entry.bytes) for entry in content).decode("utf-8", "replace") == result.choices[0].message.content


def test_seeds_reproduce_and_differ(client: openai.OpenAI) -> None:
    kwargs = dict(prompt="A small robot", max_tokens=32, temperature=1.0, extra_body={"ignore_eos": True})
    first = client.completions.create(model=MODEL, seed=11, **kwargs).choices[0].text
    again = client.completions.create(model=MODEL, seed=11, **kwargs).choices[0].text
    other = client.completions.create(model=MODEL, seed=12, **kwargs).choices[0].text
    assert first == again
    assert first != other


def test_prompt_tokens_equal_tokenize_count(server, client: openai.OpenAI) -> None:
    counted = httpx.post(f"{server.url}/tokenize", json={"messages": MESSAGES}, timeout=30).json()
    usage = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=1).usage
    assert usage.prompt_tokens == counted["count"] == len(counted["tokens"])
    counted = httpx.post(f"{server.url}/tokenize", json={"prompt": "Rome and Madrid"}, timeout=30).json()
    usage = client.completions.create(model=MODEL, prompt="Rome and Madrid", max_tokens=1).usage
    assert usage.prompt_tokens == counted["count"]


def test_repeated_long_prompt_reports_cached_tokens(client: openai.OpenAI) -> None:
    prompt = "The scheduler hands out a token budget every step. " * 12
    first = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    second = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    assert first.usage.prompt_tokens > 64
    assert second.usage.prompt_tokens_details.cached_tokens > 0
    assert second.usage.prompt_tokens_details.cached_tokens <= second.usage.prompt_tokens


def test_token_id_and_list_prompts_and_echo(server, client: openai.OpenAI) -> None:
    tokens = httpx.post(f"{server.url}/tokenize", json={"prompt": "Vienna is"}, timeout=30).json()["tokens"]
    by_text = client.completions.create(model=MODEL, prompt="Vienna is", max_tokens=5, **GREEDY).choices[0].text
    by_ids = client.completions.create(model=MODEL, prompt=tokens, max_tokens=5, **GREEDY).choices[0].text
    assert by_ids == by_text
    batch = client.completions.create(model=MODEL, prompt=["Vienna is", "Lisbon is"], max_tokens=5, **GREEDY)
    assert [choice.index for choice in batch.choices] == [0, 1]
    assert batch.choices[0].text == by_text
    echoed = client.completions.create(model=MODEL, prompt="Vienna is", max_tokens=5, echo=True, **GREEDY).choices[0].text
    assert echoed == "Vienna is" + by_text


def test_concurrent_streams_equal_their_solo_runs(server, client: openai.OpenAI) -> None:
    prompts = [f"Request number {i}: tell me about the capital of France." for i in range(16)]
    solo = [client.completions.create(model=MODEL, prompt=p, max_tokens=16, **GREEDY).choices[0].text for p in prompts]

    async def run_all() -> list[str]:
        async_client = openai.AsyncOpenAI(base_url=server.openai_base_url, api_key="unused", max_retries=0, timeout=120)

        async def one(prompt: str) -> str:
            stream = await async_client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, stream=True, **GREEDY)
            return "".join([chunk.choices[0].text async for chunk in stream if chunk.choices])

        try:
            return await asyncio.gather(*(one(p) for p in prompts))
        finally:
            await async_client.close()

    assert asyncio.run(run_all()) == solo
