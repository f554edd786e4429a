"""Sampling parameters: what a request asks of the sampler and of stopping.

Frozen and stdlib-only. The ingress converts the validated OpenAI body into this once;
the scheduler reads the stopping fields, the worker's sampler reads the rest.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class GrammarSpec:
    """A constraint on a request's output, as plain data (the worker compiles it).

    The ingress validates it before it is submitted; equal specs share one compiled grammar.
    """

    kind: str  # "json_schema": source is a JSON Schema as JSON text; "lark": a Lark grammar (may embed %json)
    source: str  # the schema or grammar text

    def __post_init__(self) -> None:
        assert self.kind in ("json_schema", "lark"), self.kind


@dataclass(frozen=True, slots=True)
class SamplingParams:
    max_tokens: int = 16  # generated tokens at most (the scheduler also caps by max_model_len)
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0  # nucleus mass kept, (0, 1]
    top_k: int | None = None  # keep the k most likely tokens; None keeps all
    min_p: float = 0.0  # drop tokens below min_p * p(most likely)
    seed: int | None = None  # per-request reproducible sampling; None uses the batch generator
    n: int = 1  # sequences forked from one prompt (prompt computed once)
    stop_token_ids: tuple[int, ...] = ()  # extra token ids that finish with "stop"
    ignore_eos: bool = False  # keep going past EOS
    presence_penalty: float = 0.0  # OpenAI semantics, over generated tokens
    frequency_penalty: float = 0.0  # OpenAI semantics, over generated tokens
    repetition_penalty: float = 1.0  # HF/vLLM semantics, over prompt and generated tokens
    logprobs: int | None = None  # None: no logprobs; k >= 0: sampled token's logprob + top k
    grammar: GrammarSpec | None = None  # structured output: only tokens the grammar allows are sampled

    def __post_init__(self) -> None:
        assert self.max_tokens >= 1, self.max_tokens
        assert self.temperature >= 0.0, self.temperature
        assert 0.0 < self.top_p <= 1.0, self.top_p
        assert self.top_k is None or self.top_k >= 1, self.top_k
        assert 0.0 <= self.min_p <= 1.0, self.min_p
        assert self.n >= 1, self.n
        assert self.repetition_penalty > 0.0, self.repetition_penalty
        assert self.logprobs is None or self.logprobs >= 0, self.logprobs

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )

    def for_child(self, index: int) -> SamplingParams:
        """Params of the index-th forked sequence: n=1, and its own seed (seed + index)."""
        seed = None if self.seed is None else self.seed + index
        return dataclasses.replace(self, n=1, seed=seed)
