"""What model families' chat formats bring to /v1/chat/completions, in-process (byte
tokenizer, one token per byte, so every tag is split across deltas; scripted engine):
reasoning_content (whole and streamed), and its interplay with stop strings, max_tokens,
tools and grammars; requests without a parser are unchanged."""

from __future__ import annotations

import json

import httpx
import pytest
from pydantic import ValidationError

from serve_app.api import create_api
from serve_app.config import AppArgs
from serve_app.testing import HARMONY_SPECIAL_TOKENS, ByteTokenizer, ScriptedEngine, make_test_context, text_tokens

pytestmark = pytest.mark.anyio

THINK_TEMPLATE = "{{- '<think>\\n\\n</think>\\n\\n' if enable_thinking is false }}"  # enough for detection
HARMONY_TEMPLATE = "{{- '<|start|>assistant<|channel|>final<|message|>' }}"  # enough for detection
HARMONY_TOOLS_TEMPLATE = HARMONY_TEMPLATE + "{#- renders tools: namespace functions #}"
OPENS_THINK = "<|im_start|>assistant\n<think>\n"  # a template that opens the thought itself
USER = [{"role": "user", "content": "hi"}]
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>'


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


async def post(body: dict, output: str, reasoning_parser: str | None = "qwen3",
               generation_prompt: str = "<|im_start|>assistant\n",
               path: str = "/v1/chat/completions", harmony: bool = False,
               tool_call_parser: str = "hermes") -> httpx.Response:
    if harmony:  # gpt-oss: harmony's markers are special tokens, in the output as in the template
        template = HARMONY_TOOLS_TEMPLATE if tool_call_parser == "harmony" else HARMONY_TEMPLATE
        tokenizer = ByteTokenizer(template, "<|start|>assistant", special_tokens=HARMONY_SPECIAL_TOKENS)
        engine = ScriptedEngine(responder=lambda request, index: tokenizer.encode(output))
    else:
        engine = ScriptedEngine(responder=lambda request, index: text_tokens(output))
        tokenizer = ByteTokenizer(THINK_TEMPLATE if reasoning_parser else "chatml", generation_prompt)
    ctx = make_test_context(engine, max_model_len=4096, tokenizer=tokenizer, reasoning_parser=reasoning_parser,
                            tool_call_parser=tool_call_parser)
    transport = httpx.ASGITransport(app=create_api(ctx))
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        if path == "/v1/models":
            return await client.get(path)
        return await client.post(path, json={"messages": USER, **body})


async def whole_and_streamed(body: dict, output: str, **kwargs) -> tuple[dict, list[dict]]:
    """The whole choice, and the streamed choice's deltas (with finish_reason) of one output."""
    whole = await post(body, output, **kwargs)
    assert whole.status_code == 200, whole.text
    streamed = await post({**body, "stream": True}, output, **kwargs)
    events = [line[len("data: "):] for line in streamed.text.split("\n\n") if line]
    assert events[-1] == "[DONE]"
    deltas = [{**chunk["choices"][0]["delta"], "finish_reason": chunk["choices"][0]["finish_reason"]}
              for chunk in map(json.loads, events[:-1]) if chunk["choices"]]
    return whole.json()["choices"][0], deltas


def joined(deltas: list[dict], key: str) -> str | None:
    parts = [delta[key] for delta in deltas if delta.get(key)]
    return "".join(parts) if parts else None


@pytest.mark.parametrize("output, generation_prompt, reasoning, content", [
    ("<think>\nThe user greets.\n</think>\n\nHello!", "<|im_start|>assistant\n", "The user greets.", "Hello!"),
    ("Short.\n</think>\n\nHi", OPENS_THINK, "Short.", "Hi"),  # the prompt opened the thought
    ("Hello, no thought.", "<|im_start|>assistant\n", None, "Hello, no thought."),
    ("<think>cut by max_tokens, no end tag", "<|im_start|>assistant\n", "cut by max_tokens, no end tag", None),
])
async def test_reasoning_comes_apart_from_content_whole_and_streamed(output, generation_prompt, reasoning,
                                                                     content) -> None:
    choice, deltas = await whole_and_streamed({}, output, generation_prompt=generation_prompt)
    assert choice["message"] == {"role": "assistant", "content": content, "reasoning_content": reasoning}
    assert choice["finish_reason"] == "stop" and deltas[-1]["finish_reason"] == "stop"
    assert joined(deltas, "reasoning_content") == reasoning and joined(deltas, "content") == content
    assert not any("think>" in (delta.get("content") or "") + (delta.get("reasoning_content") or "")
                   for delta in deltas)
    if reasoning and content:  # reasoning streams before the answer, a byte at a time
        kinds = [key for delta in deltas for key in ("reasoning_content", "content") if delta.get(key)]
        assert kinds == sorted(kinds, reverse=True) and len(kinds) > 3


async def test_a_stop_string_or_max_tokens_inside_the_thought_leaves_reasoning_only() -> None:
    output = "<think>\nfirst step. STOP second step\n</think>\n\nanswer"
    choice, deltas = await whole_and_streamed({"stop": ["STOP"]}, output)
    assert choice["message"]["reasoning_content"] == "first step." and choice["message"]["content"] is None
    assert joined(deltas, "reasoning_content") == "first step." and joined(deltas, "content") is None
    assert choice["finish_reason"] == "stop" and deltas[-1]["finish_reason"] == "stop"
    choice, deltas = await whole_and_streamed({"max_tokens": 12}, output)  # 12 bytes: "<think>\nfirs"
    assert choice["message"]["reasoning_content"] == "firs" and choice["message"]["content"] is None
    assert joined(deltas, "reasoning_content") == "firs" and choice["finish_reason"] == "length"


async def test_without_a_parser_the_text_is_content_as_before() -> None:
    output = "<think>\nhmm\n</think>\n\nHello"
    choice, deltas = await whole_and_streamed({}, output, reasoning_parser=None)
    assert choice["message"] == {"role": "assistant", "content": output}
    assert joined(deltas, "content") == output and not any("reasoning_content" in delta for delta in deltas)


async def test_reasoning_then_a_tool_call() -> None:
    output = f"<think>\nI need the weather.\n</think>\n\n{CALL}"
    choice, deltas = await whole_and_streamed({"tools": [WEATHER]}, output)
    message = choice["message"]
    assert message["reasoning_content"] == "I need the weather." and message["content"] is None
    (call,) = message["tool_calls"]
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Rome"}'}
    assert choice["finish_reason"] == "tool_calls" and deltas[-1]["finish_reason"] == "tool_calls"
    assert joined(deltas, "reasoning_content") == "I need the weather." and joined(deltas, "content") is None
    calls = [call for delta in deltas for call in delta.get("tool_calls") or []]
    assert "".join(call["function"]["arguments"] for call in calls) == '{"city": "Rome"}'


async def test_a_grammar_shaped_output_is_not_parsed_for_reasoning() -> None:
    """A constrained output is all answer, also where the prompt opened a thought."""
    output = '{"a": 1}'
    body = {"response_format": {"type": "json_object"}}
    choice, deltas = await whole_and_streamed(body, output, generation_prompt=OPENS_THINK)
    assert choice["message"] == {"role": "assistant", "content": output}
    assert joined(deltas, "content") == output


async def test_models_name_the_reasoning_parser_and_the_config_picks_it() -> None:
    backend = (await post({}, "", path="/v1/models")).json()["data"][0]["backend"]
    assert backend["reasoning_parser"] == "qwen3"
    backend = (await post({}, "", reasoning_parser=None, path="/v1/models")).json()["data"][0]["backend"]
    assert backend["reasoning_parser"] is None
    assert AppArgs().reasoning_parser == "auto" and AppArgs(reasoning_parser="none").reasoning_parser == "none"
    with pytest.raises(ValidationError, match="reasoning_parser"):
        AppArgs(reasoning_parser="deepseek")


async def test_each_choice_of_a_stream_has_its_own_parser_and_logprobs_still_cover_every_token() -> None:
    output = "<think>\nhmm\n</think>\n\nHello"
    streamed = await post({"n": 2, "stream": True, "logprobs": True}, output)
    events = [json.loads(line[len("data: "):]) for line in streamed.text.split("\n\n")[:-2]]
    assert streamed.text.endswith("data: [DONE]\n\n")
    for index in (0, 1):
        deltas = [event["choices"][0] for event in events if event["choices"][0]["index"] == index]
        assert joined([d["delta"] for d in deltas], "reasoning_content") == "hmm"
        assert joined([d["delta"] for d in deltas], "content") == "Hello"
        num_logprobs = sum(len((d["logprobs"] or {}).get("content") or []) for d in deltas)
        assert num_logprobs == len(output.encode()) + 1  # every byte and the end-of-sequence token


HARMONY_OUTPUT = ("<|channel|>analysis<|message|>The user greets.<|end|>"
                  "<|start|>assistant<|channel|>final<|message|>Hello there!")


@pytest.mark.anyio
async def test_harmony_analysis_is_reasoning_and_no_marker_reaches_the_reply() -> None:
    """gpt-oss: the markers are special tokens (decoding would skip them, leaving
    "analysisThe user greets.assistantfinalHello there!"); the route keeps them for the parser."""
    choice, deltas = await whole_and_streamed({}, HARMONY_OUTPUT, reasoning_parser="harmony", harmony=True)
    assert choice["message"] == {"role": "assistant", "content": "Hello there!", "reasoning_content": "The user greets."}
    assert joined(deltas, "reasoning_content") == "The user greets." and joined(deltas, "content") == "Hello there!"
    assert not any("<|" in (delta.get("content") or "") + (delta.get("reasoning_content") or "") for delta in deltas)
    kinds = [key for delta in deltas for key in ("reasoning_content", "content") if delta.get(key)]
    assert kinds.index("content") > kinds.index("reasoning_content") and kinds.count("reasoning_content") > 1
    # 20 tokens: the two markers, "analysis" and ten bytes of the thought
    cut = await whole_and_streamed({"max_tokens": 20}, HARMONY_OUTPUT, reasoning_parser="harmony", harmony=True)
    assert cut[0]["message"]["reasoning_content"] == "The user g" and cut[0]["message"]["content"] is None
    assert cut[0]["finish_reason"] == "length"


@pytest.mark.anyio
async def test_harmony_text_is_decoded_without_markers_when_not_parsed() -> None:
    choice, _ = await whole_and_streamed({}, HARMONY_OUTPUT, reasoning_parser=None, harmony=True)
    assert choice["message"] == {"role": "assistant", "content": "analysisThe user greets.assistantfinalHello there!"}


GPT_OSS_CALL = ("<|channel|>analysis<|message|>Need the weather.<|end|>"
                "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
                '{"city":"Rome"}')  # <|call|> ends the choice: an end-of-sequence token, never in the text


@pytest.mark.anyio
@pytest.mark.parametrize("output", [
    GPT_OSS_CALL,
    # the recipient before the channel, and a preamble to the user first
    ("<|channel|>commentary<|message|>Let me look.<|end|><|start|>assistant to=functions.get_weather"
     '<|channel|>commentary json<|message|>{"city":"Rome"}'),
])
async def test_gpt_oss_function_calls_become_tool_calls(output) -> None:
    choice, deltas = await whole_and_streamed({"tools": [WEATHER]}, output, reasoning_parser="harmony",
                                              harmony=True, tool_call_parser="harmony")
    message = choice["message"]
    (call,) = message["tool_calls"]
    assert call["function"] == {"name": "get_weather", "arguments": '{"city":"Rome"}'}
    assert choice["finish_reason"] == "tool_calls" and deltas[-1]["finish_reason"] == "tool_calls"
    streamed_calls = [call for delta in deltas for call in delta.get("tool_calls") or []]
    assert [c["function"]["name"] for c in streamed_calls if "id" in c] == ["get_weather"]
    assert "".join(c["function"].get("arguments", "") for c in streamed_calls) == '{"city":"Rome"}'
    assert joined(deltas, "reasoning_content") == message["reasoning_content"]
    assert joined(deltas, "content") == message["content"]
    if "analysis" in output:
        assert message["reasoning_content"] == "Need the weather." and message["content"] is None
    else:
        assert message["content"] == "Let me look." and message["reasoning_content"] is None
    assert not any("<|" in json.dumps(delta) for delta in deltas)


@pytest.mark.anyio
async def test_gpt_oss_calls_to_unknown_functions_and_without_tools_stay_content() -> None:
    unknown = GPT_OSS_CALL.replace("get_weather", "launch_rockets")
    choice, deltas = await whole_and_streamed({"tools": [WEATHER]}, unknown, reasoning_parser="harmony",
                                              harmony=True, tool_call_parser="harmony")
    assert "tool_calls" not in choice["message"] and choice["message"]["content"] == '{"city":"Rome"}'
    assert choice["finish_reason"] == "stop" and not any(delta.get("tool_calls") for delta in deltas)
    choice, _ = await whole_and_streamed({}, GPT_OSS_CALL, reasoning_parser="harmony", harmony=True,
                                         tool_call_parser="harmony")
    assert choice["message"] == {"role": "assistant", "content": '{"city":"Rome"}',
                                 "reasoning_content": "Need the weather."}


@pytest.mark.anyio
async def test_gpt_oss_parallel_calls_and_the_one_call_limit() -> None:
    second = '<|end|><|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city":"Oslo"}'
    output = GPT_OSS_CALL + second
    choice, deltas = await whole_and_streamed({"tools": [WEATHER]}, output, reasoning_parser="harmony",
                                              harmony=True, tool_call_parser="harmony")
    assert [c["function"]["arguments"] for c in choice["message"]["tool_calls"]] == ['{"city":"Rome"}', '{"city":"Oslo"}']
    assert [c["index"] for d in deltas for c in d.get("tool_calls") or [] if "id" in c] == [0, 1]
    choice, deltas = await whole_and_streamed({"tools": [WEATHER], "parallel_tool_calls": False}, output,
                                              reasoning_parser="harmony", harmony=True, tool_call_parser="harmony")
    assert [c["function"]["arguments"] for c in choice["message"]["tool_calls"]] == ['{"city":"Rome"}']
    assert "".join(c["function"].get("arguments", "") for d in deltas for c in d.get("tool_calls") or []) == (
        '{"city":"Rome"}')


@pytest.mark.anyio
async def test_gpt_oss_broken_arguments_leave_the_reply_as_content() -> None:
    choice, _ = await whole_and_streamed({"tools": [WEATHER]}, GPT_OSS_CALL[:-3], reasoning_parser="harmony",
                                         harmony=True, tool_call_parser="harmony")
    assert "tool_calls" not in choice["message"] and choice["message"]["content"] == '{"city":"Rom'
