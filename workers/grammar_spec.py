"""GrammarSpec -> llguidance grammar text, and validation. No torch: the ingress uses it too.

One function turns a spec into the text llguidance compiles, so the ingress validates
exactly what the worker will run:

- "json_schema": the schema, compiled with fixed JSON formatting (see JSON_FORMAT): no free
  whitespace, ", " between items and ": " after keys. A small model given free whitespace
  can spend its whole budget on newlines; one fixed layout also makes tool-call text
  predictable for the parser at the ingress. The options are llguidance overrides, so a
  schema's own "x-guidance" cannot loosen them.
- "lark": a Lark grammar as llguidance reads it (rules may embed "%json {schema}").

Validation builds the grammar against the model's tokenizer (llguidance's own checks:
unknown types, unsupported keywords, bad $refs, bad regexes, empty oneOf ...) and returns
the error message, or None when the grammar is usable.
"""

from __future__ import annotations

import json
from typing import Any

import llguidance

from scheduler.sampling_params import GrammarSpec

JSON_FORMAT: dict[str, Any] = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class GrammarSpecError(ValueError):
    """The spec cannot become a grammar (the message names the problem)."""


def json_format_for_lark(schema: dict[str, Any]) -> dict[str, Any]:
    """A schema to embed with %json in a Lark grammar, with JSON_FORMAT as its options."""
    return {**schema, "x-guidance": JSON_FORMAT}


def grammar_text(spec: GrammarSpec) -> str:
    """The llguidance grammar for spec; raises GrammarSpecError if it is not even well-formed."""
    if spec.kind == "json_schema":
        try:
            schema = json.loads(spec.source)
        except json.JSONDecodeError as error:
            raise GrammarSpecError(f"the schema is not valid JSON: {error}") from None
        if not isinstance(schema, dict):
            raise GrammarSpecError("the schema must be a JSON object")
        try:
            return llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=JSON_FORMAT)
        except ValueError as error:
            raise GrammarSpecError(str(error)) from None
    return llguidance.LLMatcher.grammar_from_lark(spec.source)


def validate(spec: GrammarSpec, tokenizer: llguidance.LLTokenizer | None) -> str | None:
    """None if spec compiles for this tokenizer, else llguidance's error message."""
    try:
        text = grammar_text(spec)
    except GrammarSpecError as error:
        return str(error)
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(text, tokenizer)
    if is_error:
        return messages[0] if messages else "the grammar is invalid"
    return None


def build_tokenizer(hf_tokenizer: Any, vocab_size: int | None, eos_token_ids: tuple[int, ...]) -> llguidance.LLTokenizer:
    """llguidance's view of a Hugging Face fast tokenizer (about 0.5 s for 49k tokens: cache it).

    vocab_size: the model's logits width (may exceed the tokenizer's); eos_token_ids: the
    tokens a finished grammar allows (the model's end-of-sequence ids).
    """
    import llguidance.hf

    eos = list(eos_token_ids) if eos_token_ids else None
    return llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=vocab_size, eos_token=eos)
