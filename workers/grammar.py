"""Grammar matchers on the worker: one per constrained request, and the batched token bitmask.

Life of a matcher (llguidance's LLMatcher), driven by the model runner:

    new request (NewRequestData, spec in its SamplingParams)
        -> template matcher for the spec (compiled once, cached by spec, LRU)
        -> deep copy; replay output_token_ids (a preempted or migrated request resumes)
    every step the request samples:
        allowed_tokens(): one bitmask row per constrained request, all filled in one call
        -> the sampler masks those rows only -> accept(): the matcher consumes the sampled token
    finished / aborted / preempted: the runner drops its state, and the matcher with it

An n>1 request's children each arrive as a new request and copy the same template, which
is the prompt's state (the prompt never advances a grammar): each has its own matcher.
When the grammar is complete, llguidance allows only the end-of-sequence tokens, so the
scheduler ends the choice with "stop" as for any EOS. A matcher that enters an error state
(a token it rejects: only possible if the mask was bypassed) also allows only EOS.

Cost on SmolLM2's 49,152-token vocabulary: a mask row takes about 15-30 us on object schemas
(p99 about 0.1 ms; docs/structured-outputs.md) and about 0.28 ms on bench_structured's
array-of-64-strings schema; a template compile about 1-2 ms, a copy 13 us.
The tokenizer view takes about 0.5 s; it is built on the first constrained request, so
workers that never see one never pay it.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import llguidance
import torch

from scheduler.sampling_params import GrammarSpec
from workers.grammar_spec import build_tokenizer, grammar_text
from workers.kernels.sampling import AllowedTokens

logger = logging.getLogger(__name__)

TEMPLATE_CACHE_SIZE = 64  # compiled specs kept per worker


@dataclass(slots=True)
class GrammarTiming:
    """Cumulative seconds and counts since the runner started (read by benchmarks)."""

    compile_s: float = 0.0  # template compiles (cache misses)
    mask_s: float = 0.0  # bitmask fills
    accept_s: float = 0.0  # token accepts
    num_compiles: int = 0
    num_mask_steps: int = 0  # steps with at least one constrained row
    num_mask_rows: int = 0  # constrained rows over all those steps


class GrammarMatchers:
    """Compiled-grammar cache and the per-step bitmask for one worker's model."""

    def __init__(self, model_path: str | Path, vocab_size: int, eos_token_ids: Sequence[int],
                 num_threads: int = 1, cache_size: int = TEMPLATE_CACHE_SIZE) -> None:
        self.model_path = str(model_path)
        self.vocab_size = vocab_size  # logits width; one bit per token id
        self.eos_token_ids = tuple(eos_token_ids)
        self.num_threads = max(1, num_threads)
        self.cache_size = cache_size
        self._tokenizer: llguidance.LLTokenizer | None = None  # built on first use
        self._executor: llguidance.LLExecutor | None = None
        self._templates: OrderedDict[GrammarSpec, llguidance.LLMatcher] = OrderedDict()
        self.timing = GrammarTiming()

    @property
    def tokenizer(self) -> llguidance.LLTokenizer:
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            hf_tokenizer = AutoTokenizer.from_pretrained(self.model_path, local_files_only=True)
            self._tokenizer = build_tokenizer(hf_tokenizer, self.vocab_size, self.eos_token_ids)
            self._executor = llguidance.LLExecutor(self.num_threads)
        return self._tokenizer

    def new_matcher(self, spec: GrammarSpec, output_token_ids: Sequence[int] = ()) -> llguidance.LLMatcher:
        """A matcher at the start of the output, advanced over output_token_ids (resumed requests)."""
        matcher = self._template(spec).deep_copy()
        if output_token_ids and not matcher.consume_tokens(list(output_token_ids)):
            logger.warning("a resumed request's output does not fit its grammar: %s", matcher.get_error())
        return matcher

    def _template(self, spec: GrammarSpec) -> llguidance.LLMatcher:
        template = self._templates.get(spec)
        if template is not None:
            self._templates.move_to_end(spec)
            return template
        started = time.perf_counter()
        template = llguidance.LLMatcher(self.tokenizer, grammar_text(spec), log_level=0)
        if template.is_error():  # the ingress validates specs, so this is a direct engine user's
            logger.warning("grammar failed to compile; its requests may only end: %s", template.get_error())
        self.timing.compile_s += time.perf_counter() - started
        self.timing.num_compiles += 1
        self._templates[spec] = template
        if len(self._templates) > self.cache_size:
            self._templates.popitem(last=False)
        return template

    def allowed_tokens(self, rows: list[int], matchers: list[llguidance.LLMatcher],
                       device: torch.device) -> AllowedTokens:
        """One bitmask row per matcher (all filled in one call), for the logits rows given."""
        # imported on first use: llguidance.torch loads torch.compile's machinery, seconds of every
        # worker's start that only grammar requests need
        import llguidance.torch

        assert rows and len(rows) == len(matchers)
        started = time.perf_counter()
        self.tokenizer  # noqa: B018 (builds the executor with the tokenizer)
        bitmask = torch.empty((len(rows), (self.vocab_size + 31) // 32), dtype=torch.int32)
        llguidance.torch.fill_next_token_bitmask_par(
            self._executor, [(matcher, index) for index, matcher in enumerate(matchers)], bitmask)
        allowed = AllowedTokens(torch.tensor(rows, dtype=torch.long, device=device), bitmask.to(device))
        self.timing.mask_s += time.perf_counter() - started
        self.timing.num_mask_steps += 1
        self.timing.num_mask_rows += len(rows)
        return allowed

    def accept(self, matcher: llguidance.LLMatcher, token_id: int) -> None:
        started = time.perf_counter()
        if not matcher.consume_token(token_id):
            logger.warning("sampled token %d was rejected by its grammar: %s", token_id, matcher.get_error())
        self.timing.accept_s += time.perf_counter() - started
