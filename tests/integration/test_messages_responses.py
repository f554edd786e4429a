"""Anthropic's Messages API and OpenAI's Responses API over real HTTP on the session's Ray
cluster, called with the official `anthropic` and `openai` SDKs, unpatched: plain text whole and
streamed, the same greedy tokens as Chat Completions, a tool call and its result round-tripped,
a json_schema output, count_tokens, a thinking model's reasoning kept apart, and bad input
answered with a 400 in each API's own shape while other requests go on."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import openai
import pytest

APP = "thinking"
MODEL = "tiny"
GREEDY = {"temperature": 0.0}
WEATHER_SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Rome", "Paris"]}},
                  "required": ["city"], "additionalProperties": False}
ANTHROPIC_WEATHER = {"name": "get_weather", "description": "The weather in a city", "input_schema": WEATHER_SCHEMA}
RESPONSES_WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city",
                     "parameters": WEATHER_SCHEMA}
# A ChatML template that opens the thought itself, as Qwen3-Thinking's does: the reply is reasoning
# until the model writes </think>.
THINKING_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n<think>\n' }}{% endif %}"
    "{# a reply closes its thought with </think> #}"
)


@pytest.fixture(scope="module")
def clients(server) -> tuple[anthropic.Anthropic, openai.OpenAI]:
    return (anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=120),
            openai.OpenAI(base_url=server.openai_base_url, api_key="unused", max_retries=0, timeout=120))


def test_plain_text_whole_and_streamed_and_the_same_greedy_tokens_as_chat(clients) -> None:
    claude, gpt = clients
    ask = "Tell me a story about a robot."
    chat = gpt.chat.completions.create(model=MODEL, max_tokens=24, messages=[{"role": "user", "content": ask}],
                                       **GREEDY)
    message = claude.messages.create(model=MODEL, max_tokens=24, messages=[{"role": "user", "content": ask}],
                                     extra_body=GREEDY)
    response = gpt.responses.create(model=MODEL, max_output_tokens=24, input=ask, **GREEDY)
    text = chat.choices[0].message.content
    assert text and message.content[0].text == text and response.output_text == text
    assert message.usage.output_tokens == response.usage.output_tokens == chat.usage.completion_tokens
    assert message.usage.input_tokens == response.usage.input_tokens == chat.usage.prompt_tokens
    with claude.messages.stream(model=MODEL, max_tokens=24, messages=[{"role": "user", "content": ask}],
                                extra_body=GREEDY) as stream:
        assert "".join(stream.text_stream) == text
        assert stream.get_final_message().stop_reason == message.stop_reason
    with gpt.responses.stream(model=MODEL, max_output_tokens=24, input=ask, **GREEDY) as stream:
        events = list(stream)
    deltas = [event.delta for event in events if event.type == "response.output_text.delta"]
    # cut by max_output_tokens, the stream ends with response.incomplete, as OpenAI's does
    assert events[-1].type == f"response.{response.status}" and events[-1].response.output_text == text
    assert "".join(deltas) == text
    counted = claude.messages.count_tokens(model=MODEL, messages=[{"role": "user", "content": ask}])
    assert counted.input_tokens == message.usage.input_tokens


def test_a_tool_call_and_its_result_round_trip_in_both_apis(clients) -> None:
    claude, gpt = clients
    ask = {"role": "user", "content": "What is the weather in Rome?"}
    message = claude.messages.create(model=MODEL, max_tokens=200, messages=[ask], tools=[ANTHROPIC_WEATHER],
                                     tool_choice={"type": "tool", "name": "get_weather"})
    [call] = [block for block in message.content if block.type == "tool_use"]
    assert message.stop_reason == "tool_use" and call.name == "get_weather" and call.input["city"] in ("Rome", "Paris")
    answer = claude.messages.create(model=MODEL, max_tokens=8, tools=[ANTHROPIC_WEATHER], messages=[
        ask, {"role": "assistant", "content": [block.model_dump() for block in message.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "22 C, sunny"}]}])
    assert answer.stop_reason in ("end_turn", "max_tokens") and answer.usage.input_tokens > message.usage.input_tokens

    response = gpt.responses.create(model=MODEL, max_output_tokens=200, input=[ask], tools=[RESPONSES_WEATHER],
                                    tool_choice={"type": "function", "name": "get_weather"})
    [function_call] = [item for item in response.output if item.type == "function_call"]
    assert json.loads(function_call.arguments)["city"] in ("Rome", "Paris")
    followed = gpt.responses.create(model=MODEL, max_output_tokens=8, tools=[RESPONSES_WEATHER], input=[
        ask, {"type": "function_call", "call_id": function_call.call_id, "name": "get_weather",
              "arguments": function_call.arguments},
        {"type": "function_call_output", "call_id": function_call.call_id, "output": "22 C, sunny"}])
    assert followed.status in ("completed", "incomplete") and followed.usage.input_tokens > response.usage.input_tokens


def test_a_json_schema_output_parses_in_both_apis(clients) -> None:
    claude, gpt = clients
    response = gpt.responses.create(model=MODEL, max_output_tokens=32, input="Which city?", text={"format": {
        "type": "json_schema", "name": "city", "schema": WEATHER_SCHEMA, "strict": True}})
    assert json.loads(response.output_text)["city"] in ("Rome", "Paris")
    message = claude.messages.create(model=MODEL, max_tokens=32, messages=[{"role": "user", "content": "Which?"}],
                                     output_config={"format": {"type": "json_schema", "schema": WEATHER_SCHEMA}})
    assert json.loads(message.content[0].text)["city"] in ("Rome", "Paris")


def test_bad_input_gets_each_apis_400_and_other_requests_go_on(clients, server) -> None:
    claude, gpt = clients
    with pytest.raises(anthropic.BadRequestError) as unknown_block:
        claude.messages.create(model=MODEL, max_tokens=8, messages=[
            {"role": "user", "content": [{"type": "image", "source": {"type": "url", "url": "http://x/y.png"}}]}])
    assert unknown_block.value.body["type"] == "error"
    assert "content block type 'image'" in unknown_block.value.body["error"]["message"]
    with pytest.raises(anthropic.BadRequestError) as orphan:
        claude.messages.create(model=MODEL, max_tokens=8, messages=[
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_x", "content": "1"}]}])
    assert orphan.value.body["error"]["type"] == "invalid_request_error"
    with pytest.raises(anthropic.BadRequestError) as no_max_tokens:
        claude.messages.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                               max_tokens=anthropic.omit)  # the SDK sends what it is given
    assert "max_tokens" in no_max_tokens.value.body["error"]["message"]
    with pytest.raises(openai.BadRequestError) as orphan_output:
        gpt.responses.create(model=MODEL, input=[{"type": "function_call_output", "call_id": "c", "output": "1"}])
    assert orphan_output.value.body["type"] == "invalid_request_error"
    with pytest.raises(openai.BadRequestError):
        gpt.responses.create(model=MODEL, input="hi", previous_response_id="resp_123")
    after = claude.messages.create(model=MODEL, max_tokens=4, messages=[{"role": "user", "content": "hi"}])
    assert after.usage.output_tokens >= 1


@pytest.fixture(scope="module")
def thinking_clients(server, tiny_model_dir: Path, tmp_path_factory) -> Iterator[tuple[anthropic.Anthropic, Any]]:
    """The tiny model with a template that opens the thought: a second app for this module."""
    model_dir = tmp_path_factory.mktemp("tiny-thinking")
    shutil.copytree(tiny_model_dir, model_dir, dirs_exist_ok=True)
    config_path = model_dir / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = THINKING_TEMPLATE
    config_path.write_text(json.dumps(config))
    (model_dir / "chat_template.jinja").unlink(missing_ok=True)
    args = {"model": str(model_dir), "served_model_name": MODEL, "name": "rayllm-thinking", "num_workers": 1,
            "worker_num_cpus": 0.5, "ingress_num_cpus": 0.1, "scheduler_num_cpus": 0.1, "worker_placement": "none",
            "num_kv_blocks": 64, "block_size": 16, "max_model_len": 512, "dtype": "float32"}
    with server.second_app(APP, args) as gpt:
        yield anthropic.Anthropic(base_url=str(gpt.base_url).removesuffix("/v1/"), api_key="unused", max_retries=0,
                                  timeout=120), gpt


def test_a_thinking_models_reasoning_is_kept_apart(thinking_clients) -> None:
    claude, gpt = thinking_clients
    ask = [{"role": "user", "content": "Why is the sky blue?"}]
    chat = gpt.chat.completions.create(model=MODEL, max_tokens=12, messages=ask, **GREEDY).choices[0].message
    reasoning = chat.model_dump()["reasoning_content"]
    assert reasoning  # the random model never closes its thought: all of it is reasoning
    message = claude.messages.create(model=MODEL, max_tokens=12, messages=ask, extra_body=GREEDY)
    assert [block.type for block in message.content] == ["thinking"] and message.content[0].thinking == reasoning
    hidden = claude.messages.create(model=MODEL, max_tokens=12, messages=ask, extra_body=GREEDY,
                                    thinking={"type": "disabled"})
    assert hidden.content == [] and hidden.usage.output_tokens == message.usage.output_tokens
    response = gpt.responses.create(model=MODEL, max_output_tokens=12, input=ask, **GREEDY)
    assert [item.type for item in response.output] == ["reasoning"]
    assert response.output[0].content[0].text == reasoning and response.output_text == ""
    with claude.messages.stream(model=MODEL, max_tokens=12, messages=ask, extra_body=GREEDY) as stream:
        final = stream.get_final_message()
    assert final.content[0].type == "thinking" and final.content[0].thinking == reasoning
