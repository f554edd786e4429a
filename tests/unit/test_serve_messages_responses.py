"""Anthropic's Messages API and OpenAI's Responses API, in-process, called with the official SDKs
(byte tokenizer, scripted engine): each maps onto the chat path, so the same conversation
reaches the engine as the same prompt tokens and sampling, and the parsed reply (reasoning,
text, tool calls) comes back as each API's blocks or items, whole and streamed. Bad input is a
400 in each API's own error shape, and nothing reaches the engine."""

from __future__ import annotations

import dataclasses
import json

import anthropic
import httpx2
import openai
import pytest

from serve_app.api import create_api
from serve_app.testing import ByteTokenizer, ScriptedEngine, make_test_context, text_tokens

pytestmark = pytest.mark.anyio

THINK_TEMPLATE = "{{- '<think>\\n\\n</think>\\n\\n' if enable_thinking is false }}"  # enough for detection
MODEL = "test-model"
THOUGHT_AND_CALL = ('<think>\nThe user wants the weather.\n</think>\n\n'
                    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>')
WEATHER_SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
                  "additionalProperties": False}
ANTHROPIC_TOOLS = [{"name": "get_weather", "description": "The weather in a city", "input_schema": WEATHER_SCHEMA}]
RESPONSES_TOOLS = [{"type": "function", "name": "get_weather", "description": "The weather in a city",
                    "parameters": WEATHER_SCHEMA}]
CHAT_TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                                "parameters": WEATHER_SCHEMA}}]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


class Server:
    """One in-process app; .anthropic and .openai are the official SDKs' async clients on it."""

    def __init__(self, output: str = "Hello there", reasoning_parser: str | None = None,
                 api_keys: tuple[str, ...] = ()) -> None:
        self.engine = ScriptedEngine(responder=lambda request, index: text_tokens(output))
        tokenizer = ByteTokenizer(THINK_TEMPLATE if reasoning_parser else "chatml")
        self.ctx = make_test_context(self.engine, max_model_len=4096, tokenizer=tokenizer,
                                     reasoning_parser=reasoning_parser)
        self.http = httpx2.AsyncClient(transport=httpx2.ASGITransport(app=create_api(self.ctx, api_keys)),
                                       base_url="http://test")
        key = api_keys[0] if api_keys else "unused"
        self.anthropic = anthropic.AsyncAnthropic(base_url="http://test", api_key=key, http_client=self.http,
                                                  max_retries=0)
        self.openai = openai.AsyncOpenAI(base_url="http://test/v1", api_key=key, http_client=self.http,
                                         max_retries=0)

    def prompt_text(self, index: int = -1) -> str:
        return self.ctx.tokenizer.decode_on_loop(self.engine.submitted[index].prompt_token_ids,
                                                 skip_special_tokens=False)


async def test_plain_text_whole_and_streamed_in_both_apis() -> None:
    server = Server("Hello there")
    message = await server.anthropic.messages.create(model=MODEL, max_tokens=64,
                                                     messages=[{"role": "user", "content": "hi"}])
    assert [block.type for block in message.content] == ["text"] and message.content[0].text == "Hello there"
    assert message.stop_reason == "end_turn" and message.usage.output_tokens == len("Hello there") + 1
    async with server.anthropic.messages.stream(model=MODEL, max_tokens=64,
                                                messages=[{"role": "user", "content": "hi"}]) as stream:
        kinds = [event.type async for event in stream]
        streamed = await stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop" and "content_block_delta" in kinds
    assert streamed.content[0].text == "Hello there" and streamed.stop_reason == "end_turn"

    response = await server.openai.responses.create(model=MODEL, input="hi", max_output_tokens=64)
    assert response.output_text == "Hello there" and response.status == "completed"
    assert response.usage.input_tokens == message.usage.input_tokens
    async with server.openai.responses.stream(model=MODEL, input="hi") as stream:
        kinds = [event.type async for event in stream]
        final = await stream.get_final_response()
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    assert "response.output_text.delta" in kinds and final.output_text == "Hello there"


async def test_the_same_conversation_reaches_the_engine_the_same_way_from_all_three_apis() -> None:
    server = Server()
    await server.openai.chat.completions.create(
        model=MODEL, max_tokens=20, temperature=0, stop=["x"],
        messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}])
    await server.openai.responses.create(model=MODEL, max_output_tokens=20, temperature=0, instructions="Be brief.",
                                         input="hi")
    await server.anthropic.messages.create(model=MODEL, max_tokens=20, extra_body={"temperature": 0},
                                           system="Be brief.", stop_sequences=["x"],
                                           messages=[{"role": "user", "content": "hi"}])
    chat, responses, messages = server.engine.submitted
    assert chat.prompt_token_ids == responses.prompt_token_ids == messages.prompt_token_ids
    assert chat.sampling_params == messages.sampling_params  # stop strings live in the ingress
    assert chat.sampling_params == responses.sampling_params


async def test_sampling_fields_left_out_take_the_models_defaults() -> None:
    server = Server()
    server.ctx.card = dataclasses.replace(server.ctx.card, sampling_defaults={"temperature": 0.2, "top_p": 0.9})
    await server.anthropic.messages.create(model=MODEL, max_tokens=8, messages=[{"role": "user", "content": "hi"}])
    await server.openai.responses.create(model=MODEL, max_output_tokens=8, input="hi")
    await server.anthropic.messages.create(model=MODEL, max_tokens=8, extra_body={
        "temperature": 1.0, "top_p": 0.5, "top_k": 5}, messages=[{"role": "user", "content": "hi"}])
    messages_default, responses_default, chosen = (request.sampling_params for request in server.engine.submitted)
    assert (messages_default.temperature, messages_default.top_p) == (0.2, 0.9) == (
        responses_default.temperature, responses_default.top_p)
    assert (chosen.temperature, chosen.top_p, chosen.top_k) == (1.0, 0.5, 5)


async def test_reasoning_and_a_tool_call_come_apart_as_blocks_and_items() -> None:
    server = Server(THOUGHT_AND_CALL, reasoning_parser="qwen3")
    ask = [{"role": "user", "content": "Weather in Rome?"}]
    message = await server.anthropic.messages.create(model=MODEL, max_tokens=400, tools=ANTHROPIC_TOOLS,
                                                     messages=ask)
    assert [block.type for block in message.content] == ["thinking", "tool_use"]
    assert message.content[0].thinking == "The user wants the weather."
    assert (message.content[1].name, message.content[1].input) == ("get_weather", {"city": "Rome"})
    assert message.stop_reason == "tool_use"
    async with server.anthropic.messages.stream(model=MODEL, max_tokens=400, tools=ANTHROPIC_TOOLS,
                                                messages=ask) as stream:
        streamed = await stream.get_final_message()
    assert [block.type for block in streamed.content] == ["thinking", "tool_use"]
    assert streamed.content[1].input == {"city": "Rome"} and streamed.stop_reason == "tool_use"
    hidden = await server.anthropic.messages.create(model=MODEL, max_tokens=400, tools=ANTHROPIC_TOOLS,
                                                    messages=ask, thinking={"type": "disabled"})
    assert [block.type for block in hidden.content] == ["tool_use"]

    response = await server.openai.responses.create(model=MODEL, input="Weather in Rome?", tools=RESPONSES_TOOLS)
    assert [item.type for item in response.output] == ["reasoning", "function_call"]
    assert response.output[0].content[0].text == "The user wants the weather."
    call = response.output[1]
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Rome"}
    async with server.openai.responses.stream(model=MODEL, input="Weather in Rome?", tools=RESPONSES_TOOLS) as stream:
        kinds = [event.type async for event in stream]
        final = await stream.get_final_response()
    assert "response.function_call_arguments.delta" in kinds and "response.reasoning_text.delta" in kinds
    assert [item.type for item in final.output] == ["reasoning", "function_call"]
    assert json.loads(final.output[1].arguments) == {"city": "Rome"}


async def test_a_tool_result_goes_back_into_the_prompt_as_chat_would_send_it() -> None:
    server = Server("It is sunny.")
    chat_turns = [{"role": "user", "content": "Weather in Rome?"},
                  {"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "type": "function", "function": {
                      "name": "get_weather", "arguments": '{"city": "Rome"}'}}]},
                  {"role": "tool", "tool_call_id": "c1", "content": "22 C and sunny"}]
    await server.openai.chat.completions.create(model=MODEL, max_tokens=20, tools=CHAT_TOOLS, messages=chat_turns)
    message = await server.anthropic.messages.create(model=MODEL, max_tokens=20, tools=ANTHROPIC_TOOLS, messages=[
        {"role": "user", "content": "Weather in Rome?"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "c1", "name": "get_weather",
                                           "input": {"city": "Rome"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "c1", "content": "22 C and sunny"}]}])
    response = await server.openai.responses.create(model=MODEL, tools=RESPONSES_TOOLS, input=[
        {"role": "user", "content": "Weather in Rome?"},
        {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city": "Rome"}'},
        {"type": "function_call_output", "call_id": "c1", "output": "22 C and sunny"}])
    assert message.content[0].text == response.output_text == "It is sunny."
    chat, responses, messages = (request.prompt_token_ids for request in server.engine.submitted)
    assert chat == responses == messages and "22 C and sunny" in server.prompt_text()


async def test_stop_sequences_max_tokens_and_json_schema() -> None:
    server = Server("one two three")
    stopped = await server.anthropic.messages.create(model=MODEL, max_tokens=64, stop_sequences=["two", "three"],
                                                     messages=[{"role": "user", "content": "count"}])
    assert stopped.content[0].text == "one " and stopped.stop_reason == "stop_sequence"
    assert stopped.stop_sequence == "two"
    cut = await server.anthropic.messages.create(model=MODEL, max_tokens=3,
                                                 messages=[{"role": "user", "content": "count"}])
    assert cut.stop_reason == "max_tokens" and cut.content[0].text == "one"
    short = await server.openai.responses.create(model=MODEL, input="count", max_output_tokens=3)
    assert short.status == "incomplete" and short.incomplete_details.reason == "max_output_tokens"
    await server.openai.responses.create(model=MODEL, input="count", text={"format": {
        "type": "json_schema", "name": "city", "schema": WEATHER_SCHEMA, "strict": True}})
    assert server.engine.submitted[-1].sampling_params.grammar is not None  # constrained like chat's response_format
    await server.anthropic.messages.create(model=MODEL, max_tokens=8, messages=[{"role": "user", "content": "city"}],
                                           output_config={"format": {"type": "json_schema", "schema": WEATHER_SCHEMA}})
    assert server.engine.submitted[-1].sampling_params.grammar == server.engine.submitted[-2].sampling_params.grammar


async def test_count_tokens_is_the_prompt_a_message_would_send() -> None:
    server = Server()
    ask = {"system": "Be brief.", "messages": [{"role": "user", "content": "hi"}], "tools": ANTHROPIC_TOOLS}
    counted = await server.anthropic.messages.count_tokens(model=MODEL, **ask)
    message = await server.anthropic.messages.create(model=MODEL, max_tokens=4, **ask)
    assert counted.input_tokens == message.usage.input_tokens == len(server.engine.submitted[0].prompt_token_ids)


@pytest.mark.parametrize("body, needle", [
    ({"max_tokens": 8, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
     "content block type 'image'"),
    ({"max_tokens": 8, "messages": [{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "nope", "content": "1"}]}]}, "no tool_use block"),
    ({"messages": [{"role": "user", "content": "hi"}]}, "max_tokens"),
    ({"max_tokens": 8, "messages": [{"role": "user", "content": "hi"}], "temperature": 1.5}, "temperature"),
])
async def test_bad_messages_get_a_400_in_anthropics_shape_and_reach_nothing(body, needle) -> None:
    server = Server()
    response = await server.http.post("/v1/messages", json={"model": MODEL, **body})
    assert response.status_code == 400
    error = response.json()
    assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
    assert needle in error["error"]["message"]
    assert server.engine.submitted == []


@pytest.mark.parametrize("body, needle", [
    ({"input": [{"type": "function_call_output", "call_id": "x", "output": "1"}]}, "no function_call item"),
    ({"input": "hi", "previous_response_id": "resp_1"}, "previous_response_id is not supported"),
    ({"input": "hi", "store": True}, "store is not supported"),
    ({"input": [{"type": "input_image", "image_url": "x"}]}, "input item type 'input_image'"),
    ({"input": [{"role": "user"}]}, "input.0"),
])
async def test_bad_responses_get_a_400_in_openais_shape_and_reach_nothing(body, needle) -> None:
    server = Server()
    response = await server.http.post("/v1/responses", json={"model": MODEL, **body})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and needle in error["message"]
    assert server.engine.submitted == []


async def test_anthropic_clients_authenticate_with_x_api_key() -> None:
    server = Server(api_keys=("secret",))
    message = await server.anthropic.messages.create(model=MODEL, max_tokens=32,
                                                     messages=[{"role": "user", "content": "hi"}])
    assert message.content[0].text == "Hello there"
    refused = await server.http.post("/v1/messages", json={"model": MODEL, "max_tokens": 8, "messages": []},
                                     headers={"x-api-key": "wrong"})
    assert refused.status_code == 401 and refused.json()["error"]["type"] == "authentication_error"


async def test_server_info_counts_requests_by_api() -> None:
    server = Server()
    await server.anthropic.messages.create(model=MODEL, max_tokens=4, messages=[{"role": "user", "content": "hi"}])
    await server.openai.responses.create(model=MODEL, input="hi", max_output_tokens=4)
    await server.openai.responses.create(model=MODEL, input="hi", max_output_tokens=4)
    counts = (await server.http.get("/v1/server_info")).json()["requests_by_api"]
    assert counts == {"completions": 0, "chat_completions": 0, "responses": 2, "messages": 1}
