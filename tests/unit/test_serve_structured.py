"""Structured outputs and tools at the ingress, in-process (byte tokenizer, scripted engine).

The grammar itself runs on the worker (tests/workers/test_grammar_runner.py) and end to end
on the default model (tests/integration/test_structured_outputs.py); here: what reaches
the engine, every 400, and how tool calls are parsed out of text, whole and streamed.
"""

from __future__ import annotations

import json

import httpx
import llguidance
import pytest

from serve_app.api import create_api
from serve_app.errors import OpenAIError
from serve_app.grammar import check_strict_schema, response_format_spec
from serve_app.protocol import ChatCompletionRequest, ResponseFormat
from serve_app.testing import ScriptedEngine, make_test_context, text_tokens
from serve_app.tool_calls import ToolCallStreamer, parse_tool_calls
from serve_app.tools import render_for_template, resolve_tools, tool_call_grammar
from workers.grammar_spec import grammar_text, validate

pytestmark = pytest.mark.anyio

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city.", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time"}}
CALL_TEXT = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa}ris\\""}}\n</tool_call>'
USER = [{"role": "user", "content": "hi"}]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


async def post(path: str, body: dict, engine: ScriptedEngine | None = None) -> httpx.Response:
    transport = httpx.ASGITransport(app=create_api(make_test_context(engine, max_model_len=4096)))
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        return await client.post(path, json=body)


def scripted(text: str) -> ScriptedEngine:
    return ScriptedEngine(responder=lambda request, index: text_tokens(text))


def sse_payloads(response: httpx.Response) -> list[dict]:
    events = [line[len("data: "):] for line in response.text.split("\n\n") if line]
    assert events[-1] == "[DONE]"
    return [json.loads(event) for event in events[:-1]]


def json_schema_format(schema, strict=None) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": strict}}


async def test_response_format_reaches_the_engine_as_a_grammar_on_both_endpoints() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    for path, body in (("/v1/chat/completions", {"messages": USER}), ("/v1/completions", {"prompt": "x"})):
        engine = ScriptedEngine()
        response = await post(path, {**body, "response_format": json_schema_format(schema)}, engine)
        assert response.status_code == 200, response.text
        grammar = engine.submitted[0].sampling_params.grammar
        assert grammar.kind == "json_schema" and json.loads(grammar.source) == schema
    engine = ScriptedEngine()
    await post("/v1/chat/completions", {"messages": USER, "response_format": {"type": "text"}}, engine)
    assert engine.submitted[0].sampling_params.grammar is None


@pytest.mark.parametrize("body, param, words", [
    ({"response_format": json_schema_format({"type": "strin"})}, "response_format", "Invalid type: strin"),
    ({"response_format": json_schema_format({"type": "object", "if": {}})}, "response_format", "if"),
    ({"response_format": json_schema_format({"properties": {"a": {"$ref": "#/nope"}}})}, "response_format", "/nope"),
    ({"response_format": json_schema_format({"type": "object", "properties": {"a": {"type": "string"}}}, True)},
     "response_format.json_schema.schema", "additionalProperties"),
    ({"response_format": {"type": "json_schema"}}, "response_format", "json_schema"),
    ({"response_format": {"type": "regex"}}, "response_format.type", "json_schema"),
    ({"response_format": {"type": "json_object"}, "ignore_eos": True}, "ignore_eos", "ignore_eos"),
    ({"logit_bias": {"5": 10}}, "logit_bias", "logit_bias"),
    ({"guided_json": {"type": "object"}}, "guided_json", "response_format"),
    ({"functions": [{"name": "f"}]}, "functions", "tools"),
    ({"min_tokens": 3}, "min_tokens", "min_tokens"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "nope"),
    ({"tools": [WEATHER, WEATHER]}, "tools", "get_weather"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "strin"}}}]},
     "tools.0.function.parameters", "strin"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}},
     "response_format", "tool_choice"),
])
async def test_bad_or_unsupported_fields_get_an_openai_400_naming_them(body, param, words) -> None:
    engine = ScriptedEngine()
    response = await post("/v1/chat/completions", {"messages": USER, **body}, engine)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param
    assert words in error["message"], error
    assert engine.submitted == []  # nothing reached the engine


async def test_completions_refuses_its_own_unsupported_fields() -> None:
    for field, value in (("suffix", "tail"), ("best_of", 3), ("logit_bias", {"1": 1})):
        response = await post("/v1/completions", {"prompt": "x", field: value})
        assert response.status_code == 400 and response.json()["error"]["param"] == field
    assert (await post("/v1/completions", {"prompt": "x", "best_of": 1, "logit_bias": {}})).status_code == 200


def test_strict_schema_rules_name_the_place_they_break() -> None:
    good = {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {"type": "string"}},
                                                   "required": ["b"], "additionalProperties": False}},
            "required": ["a"], "additionalProperties": False}
    check_strict_schema(good, "p")
    bad = json.loads(json.dumps(good))
    bad["properties"]["a"]["required"] = []
    with pytest.raises(OpenAIError, match="/properties/a .*missing: b"):
        check_strict_schema(bad, "p")
    assert response_format_spec(ResponseFormat(type="json_object")).source == '{"type": "object"}'


async def test_auto_tool_call_is_parsed_into_message_tool_calls() -> None:
    body = {"messages": USER, "tools": [WEATHER, TIME]}
    engine = scripted(CALL_TEXT)
    choice = (await post("/v1/chat/completions", body, engine)).json()["choices"][0]
    assert engine.submitted[0].sampling_params.grammar is None  # auto: free text, parsed after
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    (call,) = choice["message"]["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Pa}ris\\""}'}
    plain = (await post("/v1/chat/completions", body, scripted("no call here"))).json()["choices"][0]
    assert plain["message"] == {"role": "assistant", "content": "no call here"} and plain["finish_reason"] == "stop"
    none = (await post("/v1/chat/completions", {**body, "tool_choice": "none"}, scripted(CALL_TEXT))).json()
    assert none["choices"][0]["message"]["content"] == CALL_TEXT  # "none": nothing is parsed


async def test_streamed_tool_call_deltas_follow_openai() -> None:
    body = {"messages": USER, "tools": [WEATHER], "tool_choice": "required", "stream": True}
    engine = scripted(CALL_TEXT)
    payloads = sse_payloads(await post("/v1/chat/completions", body, engine))
    assert engine.submitted[0].sampling_params.grammar.kind == "lark"
    deltas = [p["choices"][0]["delta"] for p in payloads]
    calls = [call for delta in deltas for call in delta.get("tool_calls", [])]
    assert calls[0]["id"].startswith("call_") and calls[0]["function"] == {"name": "get_weather", "arguments": ""}
    assert all(call["index"] == 0 for call in calls) and all("id" not in call for call in calls[1:])
    assert "".join(call["function"]["arguments"] for call in calls) == '{"city": "Pa}ris\\""}'
    assert not any(delta.get("content") for delta in deltas)
    assert payloads[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_tool_grammar_is_valid_and_names_only_the_allowed_functions() -> None:
    request = ChatCompletionRequest(messages=USER, tools=[WEATHER, TIME], tool_choice="required",
                                    parallel_tool_calls=False)
    grammar = tool_call_grammar(resolve_tools(request))
    assert validate(grammar, None) is None
    assert "get_weather" in grammar.source and "get_time" in grammar.source and "call (" not in grammar.source
    named = ChatCompletionRequest(messages=USER, tools=[WEATHER, TIME],
                                  tool_choice={"type": "function", "function": {"name": "get_time"}})
    grammar = tool_call_grammar(resolve_tools(named))
    assert "get_time" in grammar.source and "get_weather" not in grammar.source
    assert tool_call_grammar(resolve_tools(ChatCompletionRequest(messages=USER, tools=[WEATHER]))) is None


def test_tools_are_rendered_into_a_system_prompt_when_the_template_cannot() -> None:
    plan = resolve_tools(ChatCompletionRequest(messages=USER, tools=[WEATHER]))
    history = [
        {"role": "system", "content": "Be brief."}, *USER,
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    messages, tools = render_for_template(history, plan, template_renders_tools=False)
    assert tools is None and messages[0]["content"].startswith("Be brief.\n\n")
    assert '"name": "get_weather"' in messages[0]["content"] and "<tool_call>" in messages[0]["content"]
    assert messages[2]["content"] == '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>'
    assert "tool_calls" not in messages[2] and messages[3]["content"] == "<tool_response>\nsunny\n</tool_response>"
    same, tools = render_for_template(history, plan, template_renders_tools=True)
    assert same is history and tools[0]["function"]["name"] == "get_weather"


@pytest.mark.parametrize("piece_size", [1, 2, 5, 11, 1000])
def test_streamer_pieces_add_up_to_the_whole_parse(piece_size: int) -> None:
    text = f"Let me check.\n{CALL_TEXT}\n{CALL_TEXT.replace('Pa}ris', 'Rome')}\n"
    content, calls = parse_tool_calls(text, ("get_weather",))
    streamer = ToolCallStreamer(("get_weather",))
    deltas = [d for i in range(0, len(text), piece_size) for d in streamer.feed(text[i:i + piece_size])]
    deltas += streamer.finish()
    streamed_args: dict[int, str] = {}
    for call in (c for d in deltas for c in d.get("tool_calls", [])):
        streamed_args[call["index"]] = streamed_args.get(call["index"], "") + call["function"]["arguments"]
    assert [streamed_args[i] for i in range(2)] == [call["function"]["arguments"] for call in calls]
    assert "".join(d.get("content", "") for d in deltas).strip() == content == "Let me check."


def test_broken_or_unknown_calls_stay_content() -> None:
    for text in ("<tool_call>\nnot json\n</tool_call>", CALL_TEXT.replace("get_weather", "rm_rf")):
        assert parse_tool_calls(text, ("get_weather",)) == (text, [])
        streamer = ToolCallStreamer(("get_weather",))
        deltas = streamer.feed(text) + streamer.finish()
        assert "".join(d.get("content", "") for d in deltas) == text and streamer.num_calls == 0


class _ByteVocabulary:
    """One token per byte plus EOS (256): what llguidance needs to run a grammar over text."""

    eos_token_id = 256
    bos_token_id = None
    tokens = [bytes([byte]) for byte in range(256)] + [b"<eos>"]
    special_token_ids = [256]

    def __call__(self, data: bytes) -> list[int]:
        return list(data)


def grammar_accepts(grammar, text: str) -> bool:
    """Whether the grammar lets the output be exactly `text` and then end."""
    tokenizer = llguidance.LLTokenizer(llguidance.TokenizerWrapper(_ByteVocabulary()))
    matcher = llguidance.LLMatcher(tokenizer, grammar_text(grammar), log_level=0)
    data = list(text.encode())
    return matcher.try_consume_tokens(data) == len(data) and matcher.is_accepting()


NAMED = {"type": "function", "function": {"name": "get_weather"}}


def test_named_tool_choice_grammar_allows_exactly_one_call() -> None:
    """The cause of three identical streamed calls: the named grammar repeated its call
    whenever parallel_tool_calls was left at its default (true)."""
    one = CALL_TEXT.replace("Pa}ris\\\"", "Rome")
    for parallel in (True, False):
        request = ChatCompletionRequest(messages=USER, tools=[WEATHER, TIME], tool_choice=NAMED,
                                        parallel_tool_calls=parallel)
        grammar = tool_call_grammar(resolve_tools(request))
        assert grammar_accepts(grammar, one)
        assert not grammar_accepts(grammar, f"{one}\n{one}")
    required = ChatCompletionRequest(messages=USER, tools=[WEATHER], tool_choice="required")
    assert grammar_accepts(tool_call_grammar(resolve_tools(required)), f"{one}\n{one}")  # parallel: several
    single = ChatCompletionRequest(messages=USER, tools=[WEATHER], tool_choice="required", parallel_tool_calls=False)
    assert not grammar_accepts(tool_call_grammar(resolve_tools(single)), f"{one}\n{one}")


THREE_CALLS = "\n".join(CALL_TEXT.replace("Pa}ris", city) for city in ("Rome", "Oslo", "Lima"))


def streamed_calls(payloads: list[dict]) -> dict[int, dict]:
    """Each streamed call by index: its name and its arguments put together."""
    calls: dict[int, dict] = {}
    for payload in payloads:
        for call in payload["choices"][0]["delta"].get("tool_calls") or []:
            whole = calls.setdefault(call["index"], {"name": None, "arguments": ""})
            whole["name"] = call["function"].get("name") or whole["name"]
            whole["arguments"] += call["function"]["arguments"]
    return calls


@pytest.mark.parametrize("extra, num_calls", [
    ({"tool_choice": NAMED}, 1),  # a named function: exactly one call, parallel_tool_calls left at true
    ({"tool_choice": NAMED, "parallel_tool_calls": True}, 1),
    ({"parallel_tool_calls": False}, 1),  # auto: the first call only
    ({"tool_choice": "required", "parallel_tool_calls": False}, 1),
    ({}, 3),  # auto, parallel: every call
])
async def test_a_choice_returns_no_more_calls_than_allowed_streamed_or_not(extra, num_calls) -> None:
    body = {"messages": USER, "tools": [WEATHER], **extra}
    whole = (await post("/v1/chat/completions", body, scripted(THREE_CALLS))).json()["choices"][0]
    assert len(whole["message"]["tool_calls"]) == num_calls and whole["finish_reason"] == "tool_calls"
    assert whole["message"]["content"] is None
    payloads = sse_payloads(await post("/v1/chat/completions", {**body, "stream": True}, scripted(THREE_CALLS)))
    calls = streamed_calls(payloads)
    assert sorted(calls) == list(range(num_calls))
    assert [call["arguments"] for call in calls.values()] == [
        call["function"]["arguments"] for call in whole["message"]["tool_calls"]]
    assert calls[0]["arguments"] == '{"city": "Rome\\""}'
    assert not any(p["choices"][0]["delta"].get("content") for p in payloads)
    assert payloads[-1]["choices"][0]["finish_reason"] == "tool_calls"
