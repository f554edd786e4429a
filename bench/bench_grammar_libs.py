"""Per-token mask cost of the grammar libraries on the default model's tokenizer (49,152 tokens).

    .venv/bin/python -m bench.bench_grammar_libs
    # xgrammar is not a dependency; to compare it, put it on the path without its deps
    # (its declared triton dependency is ~290 MB, see the report):
    #   .venv/bin/python -m pip install --no-deps --target /tmp/gramlibs xgrammar apache-tvm-ffi
    #   PYTHONPATH=/tmp/gramlibs .venv/bin/python -m bench.bench_grammar_libs

For each library and schema, one matcher is driven through the tokens of valid documents
(json.dumps with the default ", " / ": " separators, tokenized by the model's own tokenizer),
and at every position the next-token bitmask is computed, then the document's next token is
accepted. Reported per library and schema (one thread, the mask of one row):

- tokenizer setup (once per worker), grammar compile (first time; a cache serves repeats),
- mask time per token: mean, p50, p99, max; accept time per token: mean.

The documents replay the same token sequence for both libraries, so the numbers are side by
side. The load average is printed: the machine is shared.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from workers.loader import resolve_model_path

PERSON_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "email": {"type": "string"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
            "required": ["city", "zip"], "additionalProperties": False,
        },
        "score": {"type": "number"},
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "email", "tags", "address", "score", "active"],
    "additionalProperties": False,
}
TOOL_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"const": "get_weather"},
        "arguments": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"], "additionalProperties": False,
        },
    },
    "required": ["name", "arguments"], "additionalProperties": False,
}
ANY_OBJECT_SCHEMA = {"type": "object"}


def person(index: int) -> dict:
    return {"name": f"Person number {index} with a longer name", "age": 20 + index, "email": f"p{index}@example.com",
            "tags": ["alpha", "beta", f"tag {index}"], "address": {"city": "Paris", "zip": f"750{index:02d}"},
            "score": 3.25 + index, "active": index % 2 == 0}


CASES = {  # name -> (schema, documents)
    "person": (PERSON_SCHEMA, [person(i) for i in range(4)]),
    "tool_call": (TOOL_SCHEMA, [{"name": "get_weather", "arguments": {"city": c, "unit": "celsius"}}
                                for c in ("Paris", "New York City", "Tokyo", "Buenos Aires")]),
    "json_object": (ANY_OBJECT_SCHEMA, [{"answer": "yes", "items": [1, 2, {"x": None}], "ok": True},
                                        person(7)]),
}


@dataclass
class CaseResult:
    library: str
    case: str
    compile_s: float  # first compile of the schema
    mask_s: list[float]  # per token
    accept_s: list[float]  # per token

    def row(self) -> str:
        masks = sorted(self.mask_s)
        p99 = masks[min(len(masks) - 1, int(0.99 * len(masks)))]
        return (f"{self.library:11s} {self.case:12s} compile {self.compile_s * 1e3:8.2f} ms | mask/token "
                f"mean {statistics.mean(masks) * 1e6:7.1f} us p50 {statistics.median(masks) * 1e6:7.1f} "
                f"p99 {p99 * 1e6:7.1f} max {masks[-1] * 1e6:8.1f} us | accept mean "
                f"{statistics.mean(self.accept_s) * 1e6:6.1f} us | {len(masks)} tokens")


def _timed(call: Callable[[], object]) -> tuple[object, float]:
    started = time.perf_counter()
    result = call()
    return result, time.perf_counter() - started


def run_llguidance(tokenizer, vocab_size: int, documents: dict[str, list[list[int]]]) -> tuple[float, list[CaseResult]]:
    import llguidance
    import llguidance.hf
    import llguidance.torch

    ll_tokenizer, setup_s = _timed(lambda: llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size))
    results = []
    options = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
    for case, (schema, _) in CASES.items():
        grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=options)
        matcher, compile_s = _timed(lambda: llguidance.LLMatcher(ll_tokenizer, grammar))
        assert not matcher.is_error(), matcher.get_error()
        bitmask = llguidance.torch.allocate_token_bitmask(1, vocab_size)
        result = CaseResult("llguidance", case, compile_s, [], [])
        for token_ids in documents[case]:
            fresh = matcher.deep_copy()
            for token_id in token_ids:
                _, mask_s = _timed(lambda: llguidance.torch.fill_next_token_bitmask(fresh, bitmask, 0))
                assert bitmask[0, token_id // 32] >> (token_id % 32) & 1, (case, token_id)
                ok, accept_s = _timed(lambda: fresh.consume_token(token_id))
                assert ok, fresh.get_error()
                result.mask_s.append(mask_s)
                result.accept_s.append(accept_s)
        results.append(result)
    return setup_s, results


def run_xgrammar(tokenizer, vocab_size: int, documents: dict[str, list[list[int]]]) -> tuple[float, list[CaseResult]]:
    import xgrammar

    info, setup_s = _timed(lambda: xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size))
    compiler = xgrammar.GrammarCompiler(info, max_threads=1)
    results = []
    for case, (schema, _) in CASES.items():
        compiled, compile_s = _timed(lambda: compiler.compile_json_schema(json.dumps(schema), any_whitespace=False))
        bitmask = xgrammar.allocate_token_bitmask(1, vocab_size)
        result = CaseResult("xgrammar", case, compile_s, [], [])
        for token_ids in documents[case]:
            matcher = xgrammar.GrammarMatcher(compiled)
            for token_id in token_ids:
                _, mask_s = _timed(lambda: matcher.fill_next_token_bitmask(bitmask, 0))
                assert bitmask[0, token_id // 32] >> (token_id % 32) & 1, (case, token_id)
                ok, accept_s = _timed(lambda: matcher.accept_token(token_id))
                assert ok, (case, token_id)
                result.mask_s.append(mask_s)
                result.accept_s.append(accept_s)
        results.append(result)
    return setup_s, results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="local HF model dir (default: SmolLM2-135M-Instruct)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    from transformers import AutoTokenizer

    model_dir = resolve_model_path(args.model)
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    vocab_size = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    documents = {case: [tokenizer.encode(json.dumps(doc), add_special_tokens=False) for doc in docs]
                 for case, (_, docs) in CASES.items()}
    print(f"vocab {vocab_size}; load average before: {os.getloadavg()}")
    for name, run in (("llguidance", run_llguidance), ("xgrammar", run_xgrammar)):
        try:
            setup_s, results = run(tokenizer, vocab_size, documents)
        except ImportError as error:
            print(f"{name}: not importable ({error}); see the module docstring")
            continue
        print(f"{name}: tokenizer setup {setup_s * 1e3:.0f} ms")
        for result in results:
            print("  " + result.row())
    print(f"load average after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
