"""Structured outputs and tool calls end to end: the official openai SDK against a live server
on the DEFAULT model (SmolLM2-135M-Instruct), served beside the tiny app in the session's Ray.

The acceptance list of the structured-outputs issue: parse() returns an object for each of
20+ varied prompts, json_object always parses, n=4 gives 4 valid documents, streamed text
concatenates to a valid document, tool_choice required returns arguments that validate
against the function's schema (streamed too), and a bad schema or an unsupported field is a
400 in OpenAI's shape while other requests go on.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Annotated, Literal

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, ConfigDict, Field

pytestmark = pytest.mark.slow

APP_NAME = "structured"
ROUTE = "/smollm2"
MAX_TOKENS = 256
WEATHER_PARAMETERS = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 40},
                   "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city.", "parameters": WEATHER_PARAMETERS}}
TIME_TOOL = {"type": "function", "function": {"name": "get_time", "description": "The time in a time zone.",
                                              "parameters": {"type": "object", "properties": {
                                                  "zone": {"type": "string", "maxLength": 32}},
                                                  "required": ["zone"], "additionalProperties": False}}}


# A 135M model given an unbounded string or a float can write digits or words until max_tokens;
# the schemas bound them, as a schema for a small model should (the grammar enforces the bounds).
ShortText = Annotated[str, Field(max_length=24)]


class City(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: ShortText
    country: ShortText
    population_thousands: int = Field(ge=0, le=50_000)


class Person(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: ShortText
    age: int = Field(ge=0, le=120)
    hobbies: list[ShortText] = Field(max_length=3)


class Sentiment(BaseModel):
    model_config = ConfigDict(extra="forbid")
    label: Literal["positive", "negative", "neutral"]
    confidence: int = Field(ge=0, le=100)


class Recipe(BaseModel):
    model_config = ConfigDict(extra="forbid")
    title: ShortText
    ingredients: list[ShortText] = Field(max_length=4)
    minutes: int = Field(ge=1, le=300)
    vegetarian: bool


PARSE_CASES = [  # (model, prompt): 5 prompts for each of 4 schemas
    *[(City, f"Describe the city of {city} as JSON.") for city in ("Paris", "Tokyo", "Lagos", "Lima", "Oslo")],
    *[(Person, prompt) for prompt in (
        "Invent a person who likes chess.", "Describe a retired teacher.", "Make up a young painter.",
        "Who is a typical astronaut? Answer as a person record.", "Create a character for a detective story.")],
    *[(Sentiment, f"Classify the sentiment of: {text!r}") for text in (
        "I love this phone!", "The service was terrible.", "It is a chair.", "Best holiday ever", "Meh, fine.")],
    *[(Recipe, f"Give me a recipe for {dish}.") for dish in (
        "pancakes", "tomato soup", "fried rice", "a green salad", "chocolate cake")],
]


@pytest.fixture(scope="module")
def smollm2_url(server) -> Iterator[str]:
    """The default model as a second Serve app in the session's Ray, at its ingress replica's own
    port (the shipped data plane), under its route prefix."""
    from ray import serve

    from serve_app.app import build_app

    app = build_app({"name": "rayllm-structured", "served_model_name": "smollm2", "num_kv_blocks": 1024,
                     "block_size": 16, "max_num_batched_tokens": 512, "max_num_seqs": 32, "num_workers": 1,
                     "worker_num_cpus": 1})
    serve.run(app, name=APP_NAME, route_prefix=ROUTE)
    try:
        yield f"{server.direct_url_of(APP_NAME)}{ROUTE}"
    finally:
        serve.delete(APP_NAME)


@pytest.fixture(scope="module")
def client(smollm2_url) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{smollm2_url}/v1", api_key="unused", max_retries=0, timeout=300)


def chat(client: openai.OpenAI, prompt: str, **kwargs):
    kwargs.setdefault("max_tokens", MAX_TOKENS)
    return client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": prompt}], **kwargs)


def test_parse_returns_an_object_for_each_of_20_varied_prompts(client) -> None:
    def parse(case):
        model, prompt = case
        completion = client.beta.chat.completions.parse(
            model="smollm2", messages=[{"role": "user", "content": prompt}], response_format=model,
            max_tokens=MAX_TOKENS, temperature=0.0)
        return model, completion.choices[0]

    with ThreadPoolExecutor(len(PARSE_CASES)) as pool:
        results = list(pool.map(parse, PARSE_CASES))
    assert len(results) >= 20
    for model, choice in results:
        assert choice.finish_reason == "stop"
        assert isinstance(choice.message.parsed, model), choice.message.content
    assert len({choice.message.content for _, choice in results}) > 12  # really different answers


def test_json_object_always_parses(client) -> None:
    # any JSON object is unbounded: a 135M model can ramble inside one until max_tokens (then the
    # text is a cut document with finish_reason "length", as with OpenAI). Which prompts it
    # finishes moves with the kernels' rounding (a bf16 kernel change turned one greedy answer
    # into "A JSON is a JSON is ..." until the limit) and with the CPU the kernels run on (5 of
    # these 7 finished on an AMX Xeon, 4 on another CI machine), so: at least 3 finish (a grammar
    # that never lets an object close finishes none), every finished one parses as an object, and
    # a cut one is still an object's beginning
    cases = [("List three fruits as JSON.", 0.7, 0), ("Give me a JSON object about a dog.", 0.7, 1),
             ("Describe the weather as JSON.", 0.7, 2), ("Return your name and age in JSON.", 0.7, 3),
             ("Tell a joke as JSON.", 0.7, 5), ("Return your name and age in JSON.", 0.0, None),
             ("Tell a joke as JSON.", 0.0, None)]

    def ask(case):
        prompt, temperature, seed = case
        return chat(client, prompt, response_format={"type": "json_object"}, temperature=temperature, seed=seed,
                    max_tokens=2 * MAX_TOKENS)

    with ThreadPoolExecutor(len(cases)) as pool:
        replies = list(pool.map(ask, cases))
    finished = [reply.choices[0] for reply in replies if reply.choices[0].finish_reason == "stop"]
    assert len(finished) >= 3, [reply.choices[0].message.content for reply in replies]
    for choice in finished:
        assert isinstance(json.loads(choice.message.content), dict)
    for reply in replies:
        assert reply.choices[0].finish_reason in ("stop", "length")
        assert reply.choices[0].message.content.lstrip().startswith("{"), reply.choices[0].message.content


def test_n4_gives_four_valid_documents_and_completions_too(client) -> None:
    schema = Person.model_json_schema()
    response_format = {"type": "json_schema", "json_schema": {"name": "person", "schema": schema}}
    reply = chat(client, "Invent a person.", response_format=response_format, n=4, temperature=1.0, seed=3)
    documents = [json.loads(choice.message.content) for choice in reply.choices]
    assert len(documents) == 4 and all(choice.finish_reason == "stop" for choice in reply.choices)
    for document in documents:
        jsonschema.validate(document, schema)
    assert len({json.dumps(d, sort_keys=True) for d in documents}) > 1
    completion = client.completions.create(model="smollm2", prompt="A person record: ", max_tokens=MAX_TOKENS,
                                           temperature=0.0, extra_body={"response_format": response_format})
    jsonschema.validate(json.loads(completion.choices[0].text), schema)


def test_streamed_text_concatenates_to_a_valid_document(client) -> None:
    schema = Recipe.model_json_schema()
    stream = chat(client, "A recipe for soup, please.", stream=True, temperature=0.0,
                  response_format={"type": "json_schema", "json_schema": {"name": "recipe", "schema": schema}})
    chunks = list(stream)
    text = "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices)
    assert len(chunks) > 5 and chunks[-1].choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(text), schema)


def test_tool_choice_required_returns_arguments_valid_against_the_schema(client) -> None:
    prompts = ["What's the weather in Paris?", "Is it raining in Seattle?", "How hot is Cairo today?"]
    for index, prompt in enumerate(prompts):
        reply = chat(client, prompt, tools=[WEATHER_TOOL, TIME_TOOL], tool_choice="required", temperature=0.5,
                     seed=index, parallel_tool_calls=index == 0, max_tokens=2 * MAX_TOKENS)
        choice = reply.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.tool_calls, choice.message
        assert choice.message.content is None and (index == 0 or len(choice.message.tool_calls) == 1)
        for call in choice.message.tool_calls:
            tool = {"get_weather": WEATHER_TOOL, "get_time": TIME_TOOL}[call.function.name]
            jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])
    named = chat(client, "Hello!", tools=[WEATHER_TOOL, TIME_TOOL], parallel_tool_calls=False,
                 tool_choice={"type": "function", "function": {"name": "get_time"}}, temperature=0.0)
    (call,) = named.choices[0].message.tool_calls
    assert call.function.name == "get_time" and named.choices[0].finish_reason == "tool_calls"
    jsonschema.validate(json.loads(call.function.arguments), TIME_TOOL["function"]["parameters"])


def test_streamed_tool_call_arguments_concatenate_to_valid_json(client) -> None:
    stream = chat(client, "Weather in Rome?", tools=[WEATHER_TOOL], tool_choice="required", stream=True,
                  parallel_tool_calls=False, temperature=0.0)
    calls = [call for chunk in stream if chunk.choices for call in (chunk.choices[0].delta.tool_calls or [])]
    assert calls[0].id and calls[0].function.name == "get_weather" and calls[0].function.arguments == ""
    arguments = "".join(call.function.arguments or "" for call in calls)
    jsonschema.validate(json.loads(arguments), WEATHER_PARAMETERS)


def test_streamed_named_tool_choice_gives_exactly_one_call(client) -> None:
    """parallel_tool_calls left at its default (true): a named function is still called once."""
    stream = chat(client, "Weather in Rome, then in Oslo?", tools=[WEATHER_TOOL, TIME_TOOL], stream=True,
                  tool_choice={"type": "function", "function": {"name": "get_weather"}}, temperature=0.0)
    chunks = [chunk for chunk in stream if chunk.choices]
    calls = [call for chunk in chunks for call in (chunk.choices[0].delta.tool_calls or [])]
    assert {call.index for call in calls} == {0} and [call.id for call in calls if call.id] == [calls[0].id]
    assert calls[0].function.name == "get_weather" and chunks[-1].choices[0].finish_reason == "tool_calls"
    jsonschema.validate(json.loads("".join(call.function.arguments or "" for call in calls)), WEATHER_PARAMETERS)
    whole = chat(client, "Weather in Rome, then in Oslo?", tools=[WEATHER_TOOL, TIME_TOOL], temperature=0.0,
                 tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert len(whole.choices[0].message.tool_calls) == 1


def test_bad_schema_and_unsupported_fields_get_openai_400s_and_others_go_on(client, smollm2_url) -> None:
    bad_format = {"type": "json_schema", "json_schema": {"name": "bad", "schema": {"type": "strin"}}}
    with pytest.raises(openai.BadRequestError) as raised:
        chat(client, "hi", response_format=bad_format)
    error = raised.value.response.json()["error"]
    assert error["param"] == "response_format" and "Invalid type: strin" in error["message"]
    assert error["type"] == "invalid_request_error"
    bad_tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "if": {}}}}
    with pytest.raises(openai.BadRequestError, match="tools.0.function.parameters"):
        chat(client, "hi", tools=[bad_tool])
    with pytest.raises(openai.BadRequestError, match="logit_bias"):
        chat(client, "hi", logit_bias={"42": 5})
    raw = httpx.post(f"{smollm2_url}/v1/chat/completions", timeout=60, json={
        "messages": [{"role": "user", "content": "hi"}], "guided_regex": "[a-z]+"})
    assert raw.status_code == 400 and raw.json()["error"]["param"] == "guided_regex"
    ok = chat(client, "Say hi.", max_tokens=4)  # the server goes on
    assert ok.choices[0].message.content
