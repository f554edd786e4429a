"""Tool-call formats of the families' chat templates (serve_app/tool_parsers.py): the parser a
template gets, whole replies, and the same replies streamed in pieces cut anywhere (inside the
marker, the name, the arguments, between calls), which must add up to the whole parse; then
the chat route using the template's parser for "auto" replies and hermes for forced calls."""

from __future__ import annotations

import json
import random

import httpx
import pytest

from serve_app.api import create_api
from serve_app.testing import ByteTokenizer, ScriptedEngine, make_test_context, text_tokens
from serve_app.tool_parsers import (
    HARMONY,
    HERMES,
    LLAMA3_JSON,
    MISTRAL,
    choose_tool_call_parser,
    make_tool_streamer,
    parse_calls,
)

pytestmark = pytest.mark.anyio

NAMES = ("get_weather", "get_time")
ROME = '{"city": "Ro}m\\"e"}'  # a brace and an escaped quote inside a string
UTC = '{"zone": "UTC", "nested": {"a": [1, {"b": null}]}}'

CASES = [  # (parser, reply, content, [(name, arguments)])
    (LLAMA3_JSON, f'<|python_tag|>{{"name": "get_weather", "parameters": {ROME}}}', None, [("get_weather", ROME)]),
    (LLAMA3_JSON, f' {{"name": "get_weather", "parameters": {ROME}}}; {{"name": "get_time", "arguments": {UTC}}}',
     None, [("get_weather", ROME), ("get_time", UTC)]),
    (LLAMA3_JSON, f'{{"name": "get_time", "parameters": {UTC}}}\n\nLet me check.', "Let me check.",
     [("get_time", UTC)]),
    (LLAMA3_JSON, '{"answer": 4}', '{"answer": 4}', []),  # JSON, but no call
    (LLAMA3_JSON, '{"name": "rm_rf", "parameters": {}}', '{"name": "rm_rf", "parameters": {}}', []),
    (LLAMA3_JSON, 'Sure: {"name": "get_time", "parameters": {}}', 'Sure: {"name": "get_time", "parameters": {}}', []),
    (LLAMA3_JSON, "<|python", "<|python", []),
    (MISTRAL, f'[TOOL_CALLS][{{"name": "get_weather", "arguments": {ROME}}}, '
              f'{{"name": "get_time", "arguments": {UTC}}}]', None, [("get_weather", ROME), ("get_time", UTC)]),
    (MISTRAL, f'[{{"name": "get_weather", "arguments": {ROME}}}]', None, [("get_weather", ROME)]),  # marker skipped
    (MISTRAL, f'[TOOL_CALLS] [ {{ "name" : "get_time" , "arguments" : {UTC} }} ] Done.', "Done.",
     [("get_time", UTC)]),
    (MISTRAL, "[1, 2] is a list", "[1, 2] is a list", []),
    (MISTRAL, "[TOOL_CALLS]", "[TOOL_CALLS]", []),
    (MISTRAL, "Hello!", "Hello!", []),
    (HERMES, f'<tool_call>\n{{"name": "get_weather", "arguments": {ROME}}}\n</tool_call>', None,
     [("get_weather", ROME)]),
]


def calls_of(calls: list[dict]) -> list[tuple[str, str]]:
    return [(call["function"]["name"], call["function"]["arguments"]) for call in calls]


@pytest.mark.parametrize("parser, reply, content, calls", CASES)
def test_whole_replies_parse_into_content_and_calls(parser, reply, content, calls) -> None:
    parsed_content, parsed = parse_calls(parser, reply, NAMES)
    assert (parsed_content, calls_of(parsed)) == (content if calls else reply, calls)
    assert all(call["id"].startswith("call_") and call["type"] == "function" for call in parsed)


def stream(parser: str, pieces: list[str], max_calls: int | None = None) -> tuple[str, list[tuple[str, str]]]:
    streamer = make_tool_streamer(parser, NAMES, max_calls)
    deltas = [delta for piece in pieces for delta in streamer.feed(piece)] + streamer.finish()
    content, calls = "", []
    for delta in deltas:
        assert set(delta) in ({"content"}, {"tool_calls"}) and all(delta.values()), delta
        content += delta.get("content", "")
        for call in delta.get("tool_calls", []):
            if "id" in call:  # a call opens with its id, name and arguments "", as OpenAI streams it
                assert call["index"] == len(calls) and call["function"]["arguments"] == ""
                calls.append((call["function"]["name"], ""))
            else:
                name, arguments = calls[call["index"]]
                calls[call["index"]] = (name, arguments + call["function"]["arguments"])
    assert streamer.num_calls == len(calls)
    return content, calls


@pytest.mark.parametrize("parser, reply, content, calls", [case for case in CASES if case[0] != HERMES])
def test_streamed_pieces_add_up_to_the_whole_parse_at_every_cut(parser, reply, content, calls) -> None:
    expected_content = (content or "") if calls else reply
    for size in (1, 2, 3, 5, 13):
        got_content, got_calls = stream(parser, [reply[i:i + size] for i in range(0, len(reply), size)])
        assert (got_content.strip() if calls else got_content, got_calls) == (expected_content, calls), size
    for cut in range(len(reply) + 1):
        got_content, got_calls = stream(parser, [reply[:cut], reply[cut:]])
        assert (got_content.strip() if calls else got_content, got_calls) == (expected_content, calls), cut


def random_reply(rng: random.Random, parser: str) -> tuple[str, list[tuple[str, str]]]:
    """A well-formed reply of 1-3 calls in random layout, and its calls."""
    key = "parameters" if parser == LLAMA3_JSON else "arguments"
    calls = [(rng.choice(NAMES), rng.choice([ROME, UTC, "{}"])) for _ in range(rng.randint(1, 3))]
    space = lambda: rng.choice(["", " ", "\n", "  \n"])  # noqa: E731
    objects = [f'{{{space()}"name":{space()}"{name}",{space()}"{key}":{space()}{arguments}{space()}}}'
               for name, arguments in calls]
    marker = rng.choice(["", "<|python_tag|>" if parser == LLAMA3_JSON else "[TOOL_CALLS]"])
    if parser == LLAMA3_JSON:
        body = f"{space()};{space()}".join(objects)
    else:
        body = f"[{space()}" + f"{space()},{space()}".join(objects) + f"{space()}]"
    return space() + marker + space() + body + rng.choice(["", "\n\nDone.", " ok"]), calls


def test_random_cuts_of_random_replies_agree_with_the_whole() -> None:
    rng = random.Random(11)
    noise = ['{"name": "get_time", "parameters": ', '{"name": "get_weather", "arguments": ', '{"a": "}"}', "}",
             "; ", ", ", "]", "[", "[TOOL_CALLS]", "<|python_tag|>", " ", "\n", "x", '"', "{"]
    num_with_calls = 0
    for trial in range(600):
        parser = rng.choice([LLAMA3_JSON, MISTRAL])
        expected = None
        if trial % 2:
            reply, expected = random_reply(rng, parser)
        else:
            reply = "".join(rng.choice(noise) for _ in range(rng.randint(0, 10)))
        cuts = sorted(rng.sample(range(len(reply) + 1), min(len(reply) + 1, rng.randint(0, 6))))
        pieces = [reply[a:b] for a, b in zip([0, *cuts], [*cuts, len(reply)])]
        content, calls = parse_calls(parser, reply, NAMES)
        got_content, got_calls = stream(parser, pieces)
        if expected is not None:
            assert calls_of(calls) == expected, (parser, reply)
        if calls or not got_calls:  # well-formed, or no call at all: the stream adds up to the whole
            num_with_calls += bool(calls)
            assert got_calls == calls_of(calls), (parser, reply, pieces)
            assert (got_content.strip() or None if calls else got_content) == content, (parser, reply, pieces)
        else:  # broken calls were streamed as they came; the whole reply is content
            assert content == reply
    assert num_with_calls > 250


def test_a_call_cut_short_is_content_whole_and_what_was_sent_streamed() -> None:
    reply = '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Ro'  # max_tokens hit
    assert parse_calls(MISTRAL, reply, NAMES) == (reply, [])
    assert stream(MISTRAL, [reply[:30], reply[30:]]) == ("", [("get_weather", '{"city": "Ro')])
    unclosed = '[{"name": "get_weather", "arguments": {}}'  # the list never closed
    assert parse_calls(MISTRAL, unclosed, NAMES) == (unclosed, [])
    not_object = '{"name": "get_weather", "parameters": {"a": 1, }}'
    assert parse_calls(LLAMA3_JSON, not_object, NAMES) == (not_object, [])
    open_list = '[{"name": "get_weather", "arguments": {}}, '  # a comma, then the end
    assert parse_calls(MISTRAL, open_list, NAMES) == (open_list, [])
    trailing = '{"name": "get_weather", "parameters": {}}; '  # a trailing separator is harmless
    assert calls_of(parse_calls(LLAMA3_JSON, trailing, NAMES)[1]) == [("get_weather", "{}")]


def test_calls_past_max_calls_are_dropped() -> None:
    reply = CASES[7][1]  # mistral, two calls
    assert calls_of(parse_calls(MISTRAL, reply, NAMES, max_calls=1)[1]) == [("get_weather", ROME)]
    assert stream(MISTRAL, list(reply), max_calls=1) == ("", [("get_weather", ROME)])
    reply = CASES[1][1]  # llama3_json, two calls
    assert stream(LLAMA3_JSON, [reply], max_calls=1) == ("", [("get_weather", ROME)])


def test_the_parser_is_chosen_from_the_template() -> None:
    llama31 = ('{%- if tools is not none %}Respond in the format {"name": function name, "parameters": dictionary '
               'of argument name and its value}.{%- endif %}{{- "<|start_header_id|>ipython<|end_header_id|>" }}')
    mistral = "{%- if tools %}[AVAILABLE_TOOLS]{{ tools }}[/AVAILABLE_TOOLS]{%- endif %}[TOOL_CALLS]"
    qwen = "{%- if tools %}<tools>{{ tools }}</tools> <tool_call>{%- endif %}"
    assert choose_tool_call_parser(llama31) == LLAMA3_JSON
    assert choose_tool_call_parser("{{ '<|python_tag|>' + call }}") == LLAMA3_JSON
    assert choose_tool_call_parser(mistral) == MISTRAL
    assert choose_tool_call_parser(qwen) == HERMES and choose_tool_call_parser(None) == HERMES
    assert choose_tool_call_parser(qwen, "mistral") == MISTRAL
    gpt_oss = "{%- if tools %}namespace functions {%- endif %}<|start|>assistant<|channel|>final<|message|>"
    assert choose_tool_call_parser(gpt_oss) == HARMONY


WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
MISTRAL_REPLY = '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Rome"}}]'
HERMES_REPLY = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>'


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


async def chat(body: dict, reply: str, template: str) -> tuple[dict, list[dict]]:
    """The whole choice and the streamed deltas of one scripted reply, on a model whose card
    says mistral."""
    results = []
    for stream_it in (False, True):
        engine = ScriptedEngine(responder=lambda request, index: text_tokens(reply))
        ctx = make_test_context(engine, max_model_len=4096, tokenizer=ByteTokenizer(template),
                                tool_call_parser=MISTRAL)
        transport = httpx.ASGITransport(app=create_api(ctx))
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            response = await client.post("/v1/chat/completions", json={
                "messages": [{"role": "user", "content": "hi"}], "tools": [WEATHER], "stream": stream_it, **body})
        assert response.status_code == 200, response.text
        results.append(response)
    events = [line[len("data: "):] for line in results[1].text.split("\n\n") if line][:-1]
    deltas = [json.loads(event)["choices"][0] for event in events]
    return results[0].json()["choices"][0], deltas


def streamed_arguments(deltas: list[dict]) -> str:
    return "".join(call["function"]["arguments"] for d in deltas for call in d["delta"].get("tool_calls") or [])


async def test_auto_replies_are_read_in_the_templates_format() -> None:
    template = "[AVAILABLE_TOOLS]{{ tools }}[/AVAILABLE_TOOLS] [TOOL_CALLS]"  # renders tools itself
    choice, deltas = await chat({}, MISTRAL_REPLY, template)
    (call,) = choice["message"]["tool_calls"]
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Rome"}'}
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    assert streamed_arguments(deltas) == '{"city": "Rome"}' and deltas[-1]["finish_reason"] == "tool_calls"
    assert not any(d["delta"].get("content") for d in deltas)


async def test_forced_calls_and_our_own_tools_prompt_stay_hermes() -> None:
    template = "[AVAILABLE_TOOLS]{{ tools }}[/AVAILABLE_TOOLS] [TOOL_CALLS]"
    choice, deltas = await chat({"tool_choice": "required"}, HERMES_REPLY, template)  # the grammar's format
    assert choice["message"]["tool_calls"][0]["function"]["arguments"] == '{"city": "Rome"}'
    assert streamed_arguments(deltas) == '{"city": "Rome"}'
    choice, _ = await chat({}, HERMES_REPLY, "chatml")  # no tools in the template: we wrote hermes
    assert choice["message"]["tool_calls"][0]["function"]["name"] == "get_weather"
    choice, _ = await chat({}, MISTRAL_REPLY, "chatml")
    assert choice["message"] == {"role": "assistant", "content": MISTRAL_REPLY}


async def test_models_name_the_tool_call_parser() -> None:
    transport = httpx.ASGITransport(app=create_api(make_test_context(tool_call_parser=LLAMA3_JSON)))
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        backend = (await client.get("/v1/models")).json()["data"][0]["backend"]
    assert backend["tool_call_parser"] == LLAMA3_JSON and backend["reasoning_parser"] is None
