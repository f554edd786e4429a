"""Benchmark workloads: lists of `SampleRequest`, built from a local tokenizer and a seed.

Every prompt is built from random token ids of the model's own vocabulary and cut to its
target length with that tokenizer (decode -> re-encode -> trim or pad, a few rounds), the
way vLLM's random dataset does it. The server's `usage.prompt_tokens` stays the count we
report; `SampleRequest.prompt_len` is only what we aimed for (the server may add a BOS token
or a chat template around it).

Workloads (all seeded, all interleaved so that a router sees mixed traffic):

- random:        input/output lengths drawn uniformly from
                 [len * (1 - range_ratio), len * (1 + range_ratio)], an optional random
                 prefix shared by every prompt (`prefix_len`, like vLLM's random_prefix_len).
- shared-prefix: `num_prefixes` families, each a long system prompt of `shared_prefix_len`
                 tokens, followed by a different short question of `input_len` tokens.
                 Requests go round-robin over families (family 0, 1, .., 0, 1, ..). The first
                 request of a family is in group "cold", the others in group "warm".
- long-prompt:   `num_prompts` short streams (group "short") with `num_long` very long
                 prompts (group "long", `long_input_len` tokens) spread evenly among them.
                 The fairness number is the short group's ITL p99 / max.

n > 1 is a request option (`SampleRequest.n`), valid with any workload.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

MAX_FIT_ROUNDS = 10  # decode/re-encode rounds before accepting an off-by-a-few prompt length


@dataclass(slots=True)
class SampleRequest:
    prompt: str  # the user text (completions: the whole prompt)
    prompt_len: int  # tokens we aimed for, with the client's tokenizer, no special tokens
    output_len: int  # max_tokens sent
    system: str | None = None  # chat only: system message (shared-prefix families)
    group: str = "all"  # label for per-group metrics ("short"/"long", "cold"/"warm")
    n: int = 1  # completions per prompt
    family: int | None = None  # shared-prefix: which system prompt
    extra: dict = field(default_factory=dict)  # merged into the request body


class PromptTokenizer:
    """A thin wrapper over a local `tokenizer.json` (the `tokenizers` package, no transformers).

    Falls back to transformers' AutoTokenizer for directories without a tokenizer.json.
    """

    def __init__(self, path: str | Path):
        path = Path(path)
        file = path / "tokenizer.json" if path.is_dir() else path
        if file.name == "tokenizer.json" and file.exists():
            from tokenizers import Tokenizer

            self._tok = Tokenizer.from_file(str(file))
            self._hf = None
            special = {
                int(i) for i, t in self._tok.get_added_tokens_decoder().items() if t.special
            }
            vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        else:
            from transformers import AutoTokenizer

            self._hf = AutoTokenizer.from_pretrained(str(path))
            self._tok = None
            special = set(self._hf.all_special_ids)
            vocab_size = len(self._hf)
        self.vocab_size = vocab_size
        # ids we draw random prompts from: not special, and decoding alone to whole characters
        # (byte fragments decode to U+FFFD and re-encode to other ids: lengths would drift)
        candidates = [i for i in range(vocab_size) if i not in special]
        pieces = self._batch_decode([[i] for i in candidates])
        self.normal_ids = np.array([i for i, t in zip(candidates, pieces) if t and "\ufffd" not in t])
        assert len(self.normal_ids) > 0, f"tokenizer at {path} has no usable tokens"

    def _batch_decode(self, seqs: list[list[int]]) -> list[str]:
        if self._tok is not None:
            return self._tok.decode_batch(seqs, skip_special_tokens=True)
        return self._hf.batch_decode(seqs, skip_special_tokens=True)

    def encode(self, text: str) -> list[int]:
        if self._tok is not None:
            return self._tok.encode(text, add_special_tokens=False).ids
        return self._hf.encode(text, add_special_tokens=False)

    def decode(self, ids: list[int]) -> str:
        if self._tok is not None:
            return self._tok.decode(list(ids), skip_special_tokens=True)
        return self._hf.decode(list(ids), skip_special_tokens=True)


def make_prompt(tok: PromptTokenizer, rng: np.random.Generator, target_len: int) -> tuple[str, int]:
    """Random text that re-encodes to `target_len` tokens (or close: the count is returned)."""
    assert target_len >= 1, target_len
    ids = [int(i) for i in rng.choice(tok.normal_ids, size=target_len)]
    text = tok.decode(ids)
    for _ in range(MAX_FIT_ROUNDS):
        ids = tok.encode(text)
        if len(ids) == target_len:
            return text, target_len
        if len(ids) > target_len:
            ids = ids[:target_len]
        else:
            ids = ids + [int(i) for i in rng.choice(tok.normal_ids, size=target_len - len(ids))]
        text = tok.decode(ids)
    return text, len(tok.encode(text))


def sample_lens(rng: np.random.Generator, mean: int, range_ratio: float, num: int) -> list[int]:
    """Uniform integers in [mean * (1 - r), mean * (1 + r)], at least 1 (vLLM's random range)."""
    assert 0.0 <= range_ratio < 1.0, f"range_ratio must be in [0, 1): {range_ratio}"
    low = max(1, math.floor(mean * (1 - range_ratio)))
    high = max(low, math.ceil(mean * (1 + range_ratio)))
    return [int(x) for x in rng.integers(low, high + 1, size=num)]


def random_requests(
    tok: PromptTokenizer,
    *,
    num_prompts: int,
    input_len: int,
    output_len: int,
    range_ratio: float = 0.0,
    prefix_len: int = 0,
    seed: int = 0,
    n: int = 1,
    group: str = "all",
) -> list[SampleRequest]:
    rng = np.random.default_rng(seed)
    prefix = make_prompt(tok, rng, prefix_len)[0] if prefix_len > 0 else ""
    in_lens = sample_lens(rng, input_len, range_ratio, num_prompts)
    out_lens = sample_lens(rng, output_len, range_ratio, num_prompts)
    requests = []
    for in_len, out_len in zip(in_lens, out_lens):
        text, _ = make_prompt(tok, rng, in_len)
        prompt = prefix + text
        requests.append(
            SampleRequest(prompt, len(tok.encode(prompt)), out_len, group=group, n=n)
        )
    return requests


def shared_prefix_requests(
    tok: PromptTokenizer,
    *,
    num_prompts: int,
    num_prefixes: int,
    shared_prefix_len: int,
    input_len: int,
    output_len: int,
    seed: int = 0,
    n: int = 1,
) -> list[SampleRequest]:
    assert num_prefixes >= 1 and shared_prefix_len >= 1, (num_prefixes, shared_prefix_len)
    rng = np.random.default_rng(seed)
    systems = [make_prompt(tok, rng, shared_prefix_len)[0] for _ in range(num_prefixes)]
    requests = []
    for i in range(num_prompts):  # round-robin: family i % F, question i // F
        family, question = i % num_prefixes, i // num_prefixes
        text, _ = make_prompt(tok, rng, input_len)
        prompt_len = len(tok.encode(systems[family] + text))
        requests.append(
            SampleRequest(
                text,
                prompt_len,
                output_len,
                system=systems[family],
                group="cold" if question == 0 else "warm",
                n=n,
                family=family,
            )
        )
    return requests


def long_prompt_requests(
    tok: PromptTokenizer,
    *,
    num_prompts: int,
    num_long: int,
    long_input_len: int,
    long_output_len: int,
    input_len: int,
    output_len: int,
    range_ratio: float = 0.0,
    seed: int = 0,
    n: int = 1,
) -> list[SampleRequest]:
    """`num_prompts` short requests with `num_long` long ones spread evenly among them."""
    short = random_requests(
        tok,
        num_prompts=num_prompts,
        input_len=input_len,
        output_len=output_len,
        range_ratio=range_ratio,
        seed=seed,
        n=n,
        group="short",
    )
    rng = np.random.default_rng(seed + 1)
    requests = list(short)
    # long k goes after short request round((k + 1) * S / (L + 1)): spread, never first
    for k in reversed(range(num_long)):
        text, real_len = make_prompt(tok, rng, long_input_len)
        at = round((k + 1) * num_prompts / (num_long + 1))
        requests.insert(at, SampleRequest(text, real_len, long_output_len, group="long", n=n))
    return requests


def request_body(req: SampleRequest, *, model: str, chat: bool, ignore_eos: bool, temperature: float,
                 top_p: float = 1.0) -> dict:
    """The JSON body vLLM's benchmark sends, plus n, temperature, top_p (when below 1) and our extras."""
    body: dict = {
        "model": model,
        "stream": True,
        "stream_options": {"include_usage": True},
        "temperature": temperature,
    }
    if top_p < 1.0:
        body["top_p"] = top_p
    if chat:
        messages = [{"role": "user", "content": req.prompt}]
        if req.system is not None:
            messages.insert(0, {"role": "system", "content": req.system})
        body["messages"] = messages
        body["max_completion_tokens"] = req.output_len
        body["max_tokens"] = req.output_len  # older servers read only this one
    else:
        body["prompt"] = req.prompt if req.system is None else req.system + req.prompt
        body["max_tokens"] = req.output_len
    if req.n != 1:
        body["n"] = req.n
    if ignore_eos:
        body["ignore_eos"] = True
    body.update(req.extra)
    return body
