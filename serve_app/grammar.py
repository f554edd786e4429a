"""Structured outputs at the ingress: request fields -> GrammarSpec, validated, cached.

What a request asks for becomes one GrammarSpec (plain data carried in SamplingParams to
the worker, which builds the matcher: workers/grammar.py):

    response_format text         -> no grammar
    response_format json_object  -> json_schema {"type": "object"} (any JSON object)
    response_format json_schema  -> json_schema of its "schema" (null: any JSON object)
    tool_choice required / named -> a Lark grammar of tool calls (serve_app/tools.py)

`strict` is honoured the way OpenAI defines it: with strict true the schema must follow
strict mode's rules (every object lists all its properties in "required" and sets
"additionalProperties": false), and a schema that does not is a 400 naming the first place
it breaks them. The output is constrained to the schema whether strict is true or not: a
guarantee no weaker than the one asked for.

Validation compiles the grammar against the model's tokenizer (llguidance's checks: unknown
types, unsupported keywords, dangling $refs, bad regexes, ...) on a private thread, never on
the event loop. Results are cached by spec (LRU), so a schema sent again costs a dict
lookup; an invalid one is a 400 whose message is llguidance's. Tests without a model
directory validate without a tokenizer (the grammar's own checks only).
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from serve_app.errors import OpenAIError
from serve_app.model_card import ModelCard
from serve_app.protocol import ResponseFormat
from scheduler.sampling_params import GrammarSpec
from workers.grammar_spec import build_tokenizer, validate

VALIDATION_CACHE_SIZE = 256  # specs whose validation result is kept
ANY_OBJECT = {"type": "object"}  # json_object: any JSON object
_SCHEMA_MAPS = ("properties", "$defs", "definitions", "patternProperties", "dependentSchemas")  # name -> schema
_SUBSCHEMAS = ("items", "prefixItems", "anyOf", "allOf", "oneOf", "not", "additionalProperties", "contains",
               "if", "then", "else")  # a schema or a list of schemas


def schema_spec(schema: dict[str, Any]) -> GrammarSpec:
    """Keys keep the client's order: properties are generated in the order the schema lists them."""
    return GrammarSpec("json_schema", json.dumps(schema))


def response_format_spec(response_format: ResponseFormat | None) -> GrammarSpec | None:
    """The grammar response_format asks for (None: free text); strict-mode rules checked here."""
    if response_format is None or response_format.type == "text":
        return None
    if response_format.type == "json_object":
        return schema_spec(ANY_OBJECT)
    fmt = response_format.json_schema
    assert fmt is not None  # the protocol model checks it
    schema = ANY_OBJECT if fmt.schema_ is None else fmt.schema_
    if fmt.strict:
        check_strict_schema(schema, "response_format.json_schema.schema")
    return schema_spec(schema)


def check_strict_schema(schema: Any, param: str, path: str = "") -> None:
    """400 unless every object schema in `schema` follows OpenAI's strict-mode rules."""
    if isinstance(schema, list):
        for index, item in enumerate(schema):
            check_strict_schema(item, param, f"{path}/{index}")
        return
    if not isinstance(schema, dict):
        return
    if schema.get("type") == "object" or "properties" in schema:
        where = path or "/"
        if schema.get("additionalProperties") is not False:
            raise OpenAIError(f"strict schema: the object at {where} must set \"additionalProperties\": false",
                              param=param, code="invalid_schema")
        missing = sorted(set(schema.get("properties", {})) - set(schema.get("required", [])))
        if missing:
            raise OpenAIError(f"strict schema: the object at {where} must list every property in \"required\"; "
                              f"missing: {', '.join(missing)}", param=param, code="invalid_schema")
    for key, value in schema.items():
        if key in _SCHEMA_MAPS and isinstance(value, dict):
            for name, subschema in value.items():
                check_strict_schema(subschema, param, f"{path}/{key}/{name}")
        elif key in _SUBSCHEMAS:
            check_strict_schema(value, param, f"{path}/{key}")


def check_combinable(spec: GrammarSpec | None, ignore_eos: bool) -> None:
    """A grammar ends its output with EOS once complete: ignoring EOS would defeat it."""
    if spec is not None and ignore_eos:
        raise OpenAIError("ignore_eos cannot be combined with response_format or a forced tool call "
                          "(a complete grammar ends the output with the end-of-sequence token)",
                          param="ignore_eos", code="invalid_value")


class GrammarValidator:
    """Validates specs against the served model's tokenizer off the event loop, with an LRU cache."""

    def __init__(self, model_dir: str | None, vocab_size: int | None, eos_token_ids: tuple[int, ...]) -> None:
        self._model_dir = model_dir if model_dir and (Path(model_dir) / "tokenizer.json").exists() else None
        self._vocab_size = vocab_size
        self._eos_token_ids = eos_token_ids
        self._tokenizer: Any = None  # llguidance.LLTokenizer, built on the first validation
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="grammar")
        self._results: OrderedDict[GrammarSpec, str | None] = OrderedDict()  # spec -> error or None
        self._lock = threading.Lock()  # the cache is read on the loop and written on the thread

    @classmethod
    def for_card(cls, card: ModelCard) -> GrammarValidator:
        return cls(card.root, card.vocab_size, card.eos_token_ids)

    async def check(self, spec: GrammarSpec | None, param: str) -> None:
        """Raises a 400 naming the problem if spec does not compile; None passes."""
        if spec is None:
            return
        with self._lock:
            cached = spec in self._results
            error = self._results.get(spec)
        if not cached:
            error = await asyncio.get_running_loop().run_in_executor(self._executor, self._validate, spec)
        if error is not None:
            raise OpenAIError(f"{param}: the schema or grammar is invalid or unsupported: {error}",
                              param=param, code="invalid_schema")

    def _validate(self, spec: GrammarSpec) -> str | None:
        if self._tokenizer is None and self._model_dir is not None:
            from serve_app.tokenizer import load_hf_tokenizer

            self._tokenizer = build_tokenizer(load_hf_tokenizer(self._model_dir), self._vocab_size,
                                              self._eos_token_ids)
        error = validate(spec, self._tokenizer)
        with self._lock:
            self._results[spec] = error
            self._results.move_to_end(spec)
            if len(self._results) > VALIDATION_CACHE_SIZE:
                self._results.popitem(last=False)
        return error

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False)


def validator(ctx: Any) -> GrammarValidator:
    """The context's validator, made on first use from its model card."""
    if ctx.grammars is None:
        ctx.grammars = GrammarValidator.for_card(ctx.card)
    return ctx.grammars
