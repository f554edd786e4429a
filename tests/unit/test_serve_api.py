"""The OpenAI routes in-process over a byte tokenizer and a scripted engine (no Ray, no torch)."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from serve_app import chat, completions
from serve_app.api import create_api
from serve_app.protocol import ChatCompletionRequest, CompletionRequest
from serve_app.testing import ScriptedEngine, make_test_context, text_tokens

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def client_for(ctx) -> httpx.AsyncClient:
    transport = httpx.ASGITransport(app=create_api(ctx))
    return httpx.AsyncClient(transport=transport, base_url="http://test")


async def post(path: str, body, engine: ScriptedEngine | None = None, **ctx_kwargs) -> httpx.Response:
    ctx = make_test_context(engine, **ctx_kwargs)
    async with client_for(ctx) as client:
        if isinstance(body, (str, bytes)):
            return await client.post(path, content=body, headers={"content-type": "application/json"})
        return await client.post(path, json=body)


def sse_payloads(response: httpx.Response) -> list:
    events = [line[len("data: "):] for line in response.text.split("\n\n") if line]
    assert events[-1] == "[DONE]"
    return [json.loads(event) for event in events[:-1]]


async def test_completion_returns_text_finish_reason_and_usage() -> None:
    response = await post("/v1/completions", {"prompt": "hi there", "max_tokens": 50},
                          ScriptedEngine(num_cached_tokens=4))
    assert response.status_code == 200
    body = response.json()
    assert body["object"] == "text_completion" and body["model"] == "test-model"
    assert body["choices"] == [{"index": 0, "text": "hello world", "logprobs": None, "finish_reason": "stop"}]
    assert body["usage"] == {
        "prompt_tokens": 8, "completion_tokens": 12, "total_tokens": 20,
        "prompt_tokens_details": {"cached_tokens": 4},
    }


async def test_completion_max_tokens_gives_length() -> None:
    body = (await post("/v1/completions", {"prompt": "x", "max_tokens": 5})).json()
    assert body["choices"][0]["text"] == "hello"
    assert body["choices"][0]["finish_reason"] == "length"


async def test_completion_stream_matches_non_stream_and_ends_with_done_and_usage() -> None:
    request = {"prompt": "hi", "max_tokens": 50, "stream": True, "stream_options": {"include_usage": True}}
    chunks = sse_payloads(await post("/v1/completions", request))
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == "hello world"
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "stop"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 12
    assert all(c["usage"] is None for c in chunks[:-1])


async def test_stop_string_is_cut_and_the_engine_request_aborted() -> None:
    engine = ScriptedEngine()
    body = (await post("/v1/completions", {"prompt": "x", "max_tokens": 50, "stop": [" wor"]}, engine)).json()
    assert body["choices"][0]["text"] == "hello"
    assert body["choices"][0]["finish_reason"] == "stop"
    assert engine.aborted == [engine.submitted[0].request_id]


async def test_stream_stop_string_never_leaks_stop_text() -> None:
    request = {"prompt": "x", "max_tokens": 50, "stop": "o w", "stream": True}
    chunks = sse_payloads(await post("/v1/completions", request))
    assert "".join(c["choices"][0]["text"] for c in chunks) == "hell"


async def test_n_and_prompt_lists_give_indexed_choices() -> None:
    request = {"prompt": ["a", "bb"], "n": 3, "max_tokens": 3}
    body = (await post("/v1/completions", request)).json()
    assert sorted(c["index"] for c in body["choices"]) == list(range(6))
    assert {c["text"] for c in body["choices"]} == {"hel"}
    assert body["usage"]["prompt_tokens"] == 3
    assert body["usage"]["completion_tokens"] == 18


async def test_token_id_prompts_and_echo() -> None:
    engine = ScriptedEngine()
    body = (await post("/v1/completions", {"prompt": text_tokens("abc"), "max_tokens": 2, "echo": True}, engine)).json()
    assert body["choices"][0]["text"] == "abche"
    assert engine.submitted[0].prompt_token_ids == text_tokens("abc")
    nested = (await post("/v1/completions", {"prompt": [[97], [98, 99]], "max_tokens": 1})).json()
    assert len(nested["choices"]) == 2


async def test_completion_logprobs_legacy_shape() -> None:
    body = (await post("/v1/completions", {"prompt": "x", "max_tokens": 3, "logprobs": 2})).json()
    logprobs = body["choices"][0]["logprobs"]
    assert logprobs["tokens"] == ["h", "e", "l"]
    assert logprobs["token_logprobs"] == [-0.25] * 3
    assert logprobs["text_offset"] == [0, 1, 2]
    assert all(len(top) == 2 and top[t] == -0.25 for top, t in zip(logprobs["top_logprobs"], "hel"))


async def test_chat_completion_and_stream_agree() -> None:
    request = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 50}
    engine = ScriptedEngine()
    body = (await post("/v1/chat/completions", request, engine)).json()
    assert body["object"] == "chat.completion"
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "hello world"}
    prompt = engine.submitted[0].prompt_token_ids
    assert bytes(p for p in prompt if p < 256).decode().endswith("assistant\n")
    chunks = sse_payloads(await post("/v1/chat/completions", {**request, "stream": True}))
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    assert text == "hello world"
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


async def test_chat_logprobs_content_shape() -> None:
    request = {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
               "max_tokens": 2, "logprobs": True, "top_logprobs": 3}
    body = (await post("/v1/chat/completions", request)).json()
    content = body["choices"][0]["logprobs"]["content"]
    assert [entry["token"] for entry in content] == ["h", "e"]
    assert content[0]["bytes"] == [104]
    assert len(content[0]["top_logprobs"]) == 3
    assert content[0]["top_logprobs"][0]["token"] == "h"


@pytest.mark.parametrize(
    "path, body, status, param",
    [
        ("/v1/completions", "{not json", 400, None),
        ("/v1/completions", "[1, 2]", 400, None),
        ("/v1/completions", {"prompt": "x", "temperature": "hot"}, 400, "temperature"),
        ("/v1/completions", {"prompt": "x", "max_tokens": True}, 400, "max_tokens"),
        ("/v1/completions", {"prompt": "x", "top_p": 0}, 400, "top_p"),
        ("/v1/completions", {"prompt": "x", "n": 0}, 400, "n"),
        ("/v1/completions", {"prompt": "x", "logprobs": 21}, 400, "logprobs"),
        ("/v1/completions", {"prompt": []}, 400, "prompt"),
        ("/v1/completions", {"prompt": "x", "stop": [""]}, 400, "stop"),
        ("/v1/completions", {"max_tokens": 3}, 400, "prompt"),
        ("/v1/completions", {"prompt": "x" * 200}, 400, "prompt"),
        ("/v1/completions", {"prompt": "x", "max_tokens": 128}, 400, "max_tokens"),
        ("/v1/completions", {"prompt": [5, 9999]}, 400, "prompt"),
        ("/v1/completions", {"prompt": "x", "stop_token_ids": [9999]}, 400, "stop_token_ids"),
        ("/v1/completions", {"prompt": "x", "echo": True, "logprobs": 1}, 400, "echo"),
        ("/v1/completions", {"prompt": "x", "model": "gpt-4"}, 404, "model"),
        ("/v1/chat/completions", {"messages": []}, 400, "messages"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, 400, None),
        ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, 400, None),
        ("/v1/chat/completions", {"messages": [{"role": "assistant", "content": "x"}]}, 400, "messages"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400, None),
        ("/tokenize", {"nothing": 1}, 400, None),
        ("/detokenize", {"tokens": [-1]}, 400, None),
        ("/v1/nothing", {}, 404, None),
    ],
)
async def test_errors_have_openai_shape(path: str, body, status: int, param) -> None:
    response = await post(path, body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    if param is not None:
        assert error["param"] is not None and error["param"].startswith(param)


async def test_models_tokenize_detokenize_version() -> None:
    ctx = make_test_context()
    async with client_for(ctx) as client:
        models = (await client.get("/v1/models")).json()
        assert models["data"][0]["id"] == "test-model"
        assert models["data"][0]["max_model_len"] == 128
        assert models["data"][0]["root"] == "/models/test"
        tokens = (await client.post("/tokenize", json={"prompt": "héllo"})).json()
        assert tokens == {"tokens": text_tokens("héllo"), "count": 6, "max_model_len": 128}
        chat_tokens = (await client.post("/tokenize", json={"messages": [{"role": "user", "content": "x"}]})).json()
        assert chat_tokens["count"] == len(chat_tokens["tokens"]) > 3
        text = (await client.post("/detokenize", json={"tokens": tokens["tokens"]})).json()
        assert text == {"prompt": "héllo"}
        assert (await client.get("/version")).json() == {"version": "test"}


async def test_chat_prompt_tokens_equal_tokenize_count() -> None:
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    ctx = make_test_context()
    async with client_for(ctx) as client:
        count = (await client.post("/tokenize", json={"messages": messages})).json()["count"]
        usage = (await client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 2})).json()["usage"]
    assert usage["prompt_tokens"] == count


async def test_abandoned_stream_aborts_its_engine_request() -> None:
    engine = ScriptedEngine(step_delay_s=0.001)
    ctx = make_test_context(engine)
    body = CompletionRequest.model_validate({"prompt": "x", "max_tokens": 100, "stream": True})
    chunks = await completions.prepare_stream(body, ctx)
    for _ in range(3):
        await chunks.__anext__()
    await chunks.aclose()
    assert engine.aborted == [engine.submitted[0].request_id]
    await asyncio.sleep(0.01)
    assert not engine.running


async def test_cancelled_non_streaming_request_aborts_its_engine_request() -> None:
    engine = ScriptedEngine(step_delay_s=0.01)
    ctx = make_test_context(engine)
    body = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x"}], "max_tokens": 100})
    task = asyncio.create_task(chat.complete(body, ctx))
    await asyncio.sleep(0.05)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert engine.aborted == [engine.submitted[0].request_id]


async def test_finished_request_is_not_aborted() -> None:
    engine = ScriptedEngine()
    await post("/v1/completions", {"prompt": "x", "max_tokens": 50}, engine)
    assert engine.aborted == []


async def test_large_bodies_are_parsed_and_validated_like_small_ones() -> None:
    big_prompt = "y" * 400_000
    response = await post("/v1/completions", {"prompt": big_prompt, "max_tokens": 2}, max_model_len=500_000)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["prompt_tokens"] == 400_000
    broken = await post("/v1/completions", '{"prompt": "' + "z" * 300_000)
    assert broken.status_code == 400 and broken.json()["error"]["code"] == "invalid_json"


def real_engine_context():
    from scheduler.config import SchedulerConfig
    from scheduler.engine import Engine
    from scheduler.testing import FakeRunner
    from serve_app.testing import VOCAB_SIZE

    config = SchedulerConfig(block_size=4, num_blocks=256, max_model_len=128, max_num_batched_tokens=64)
    engine = Engine(config, FakeRunner(config.block_size, config.num_blocks, vocab_size=VOCAB_SIZE - 3))
    return engine, make_test_context(engine)


async def test_real_engine_streams_match_and_stops_free_the_pool() -> None:
    from scheduler.testing import assert_pool_full

    engine, ctx = real_engine_context()
    request = {"prompt": "hello there", "max_tokens": 20, "temperature": 0, "ignore_eos": True, "logprobs": 1}
    async with client_for(ctx) as client:
        whole = (await client.post("/v1/completions", json=request)).json()
        stream_request = {**request, "stream": True, "stream_options": {"include_usage": True}}
        streamed = sse_payloads(await client.post("/v1/completions", json=stream_request))
        text = whole["choices"][0]["text"]
        assert "".join(c["choices"][0]["text"] for c in streamed if c["choices"]) == text
        assert whole["usage"]["completion_tokens"] == 20
        assert streamed[-1]["usage"]["prompt_tokens_details"]["cached_tokens"] > 0  # same prompt twice
        cut = text[5:7] if text[5:7].strip("\ufffd") else None
        if cut:
            stopped = (await client.post("/v1/completions", json={**request, "stop": cut})).json()
            assert stopped["choices"][0]["text"] == text[: text.find(cut)]
        chat = await client.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "x"}], "n": 3, "max_tokens": 5})
        assert [c["index"] for c in chat.json()["choices"]] == [0, 1, 2]
    await asyncio.sleep(0.05)
    assert not engine.has_unfinished_requests()
    assert_pool_full(engine.scheduler)


def test_text_layer_imports_no_ray_torch_or_transformers() -> None:
    import subprocess
    import sys

    code = (
        "import sys\nimport serve_app.api, serve_app.config, serve_app.testing\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('ray', 'torch', 'transformers'))\n"
        "assert not bad, bad\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


class GatedEngine(ScriptedEngine):
    """A ScriptedEngine whose first token waits until `gate` is set (a slow prefill)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self.gate = asyncio.Event()

    async def add_request(self, request):
        await self.gate.wait()
        async for output in super().add_request(request):
            yield output


@pytest.mark.parametrize("module, body", [
    (chat, ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], max_tokens=3, stream=True, n=2)),
    (completions, CompletionRequest(prompt="hi", max_tokens=3, stream=True)),
])
async def test_no_stream_chunk_before_the_first_token(module, body) -> None:
    # vLLM's benchmark takes TTFT at the first chunk with a choice: a role chunk sent before
    # any token exists would make TTFT look instant while the prompt is still being computed.
    # The stream (and so the response headers) is only handed out once every choice has its
    # first token: errors before it are plain HTTP errors, and no chunk can precede it.
    engine = GatedEngine()
    opening = asyncio.ensure_future(module.prepare_stream(body, make_test_context(engine)))
    for _ in range(20):  # let it run as far as it can without a token
        await asyncio.sleep(0)
    assert not opening.done() and len(engine.submitted) == 0
    engine.gate.set()
    chunks = await opening
    payload = await chunks.__anext__()
    rest = [chunk async for chunk in chunks]
    assert len(engine.submitted) == 1
    if module is chat:  # then every choice opens with its role, and the tokens follow
        assert [c["choices"][0]["delta"] for c in [payload] + rest[:1]] == [{"role": "assistant", "content": ""}] * 2
    texts = [""] * body.n
    for c in [payload] + rest:
        for choice in c["choices"]:
            texts[choice["index"]] += (choice.get("delta") or {}).get("content") or choice.get("text") or ""
    assert texts == ["hel"] * body.n


# --- stream_interval (vLLM's --stream-interval) -------------------------------------------------
def content_texts(chunks: list, index: int = 0) -> list[str]:
    return [c["choices"][0]["text"] for c in chunks if c["choices"] and c["choices"][0]["index"] == index]


async def test_stream_interval_sends_the_first_token_alone_then_chunks_of_at_least_that_many() -> None:
    request = {"prompt": "hi", "max_tokens": 50, "stream": True, "stream_options": {"include_usage": True}}
    every = content_texts(sse_payloads(await post("/v1/completions", request)))
    chunks = sse_payloads(await post("/v1/completions", request, stream_interval=4))
    texts = content_texts(chunks)
    assert "".join(texts) == "".join(every) == "hello world"  # one byte token per character
    assert len(every) == 12 and len(texts) < len(every)
    assert texts[0] == "h"  # the first token at once: TTFT is not delayed
    assert all(len(text) >= 4 for text in texts[1:-1])
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "stop"
    assert chunks[-1]["usage"]["completion_tokens"] == 12


async def test_stream_interval_keeps_choices_apart_and_logprobs_aligned() -> None:
    request = {"prompt": "x", "n": 2, "max_tokens": 9, "logprobs": 1, "stream": True}
    chunks = sse_payloads(await post("/v1/completions", request, stream_interval=3))
    for index in (0, 1):
        mine = [c["choices"][0] for c in chunks if c["choices"] and c["choices"][0]["index"] == index]
        assert "".join(choice["text"] for choice in mine) == "hello wor"
        assert [len(choice["text"]) for choice in mine] == [1, 3, 3, 2]  # the last one: the rest, finished
        assert [token for choice in mine for token in choice["logprobs"]["tokens"]] == list("hello wor")
        assert mine[-1]["finish_reason"] == "length"


async def test_stream_interval_with_a_stop_string_and_chat() -> None:
    request = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 50, "stop": "o w", "stream": True}
    chunks = sse_payloads(await post("/v1/chat/completions", request, stream_interval=4))
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    assert "".join(d.get("content") or "" for d in deltas) == "hell"
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "stop"


async def test_coalesce_sends_what_it_held_before_a_stream_error() -> None:
    from serve_app.choice_tracker import ChoiceDelta
    from serve_app.generation import coalesce

    async def failing():
        for i, char in enumerate("abcdef"):
            yield ChoiceDelta(0, char, [i], None, None)
        raise RuntimeError("worker error")

    got = []
    with pytest.raises(RuntimeError, match="worker error"):
        async for delta in coalesce(failing(), 4):
            got.append(delta)
    assert [d.text for d in got] == ["a", "bcde", "f"]  # "f" was held: it goes out before the error
    assert [t for d in got for t in d.token_ids] == list(range(6))
