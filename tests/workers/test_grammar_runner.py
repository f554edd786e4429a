"""Structured outputs on the worker: the real scheduler driving the real runner (tiny model).

The tiny model's weights are random, so whatever it emits is the grammar's doing: every
constrained output must parse and validate against its schema, end with EOS once the
grammar is complete, and leave unconstrained rows of the same batch untouched.
"""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch

from scheduler.config import SchedulerConfig
from scheduler.engine import Engine
from scheduler.outputs import FinishReason
from scheduler.sampling_params import GrammarSpec, SamplingParams
from tests.tiny_model import EOS_TOKEN_ID, build_tokenizer
from workers.grammar import GrammarMatchers
from workers.model_runner import ModelRunner, RunnerConfig
from workers.kernels.sampling import AllowedTokens, apply_allowed_tokens

SCHEMA = {
    "type": "object",
    "properties": {
        "answer": {"enum": ["yes", "no", "maybe"]},
        "count": {"type": "integer", "minimum": 0, "maximum": 99},
        "word": {"type": "string", "maxLength": 6},
        "flags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3},
    },
    "required": ["answer", "count", "word", "flags"],
    "additionalProperties": False,
}
SPEC = GrammarSpec("json_schema", json.dumps(SCHEMA))
MAX_TOKENS = 96  # the longest document the schema allows is well under this


@pytest.fixture(scope="module")
def runner(tiny_model_dir):
    return ModelRunner(
        # fp32: the tests compare tokens across batch shapes (bf16 rounding depends on the shape)
        RunnerConfig(model=str(tiny_model_dir), dtype="float32", block_size=4, num_blocks=400,
                     attention_backend="torch"))


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


def make_engine(runner, **overrides) -> Engine:
    info = runner.model_info
    settings = dict(max_num_batched_tokens=64, max_num_seqs=32, block_size=info.block_size,
                    num_blocks=info.num_blocks, max_model_len=256)
    settings.update(overrides)
    return Engine(SchedulerConfig(**settings), runner, eos_token_ids=info.eos_token_ids)


def prompts(count: int, vocab_size: int, seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab_size, (5 + 7 * i % 23,), generator=generator).tolist() for i in range(count)]


def assert_valid_document(tokenizer, token_ids: list[int], finish_reason) -> dict:
    assert finish_reason is FinishReason.STOP and token_ids[-1] == EOS_TOKEN_ID, (finish_reason, token_ids)
    document = json.loads(tokenizer.decode(token_ids[:-1]))
    jsonschema.validate(document, SCHEMA)
    return document


def test_greedy_and_sampled_outputs_follow_the_schema(runner, tokenizer):
    batch = prompts(6, runner.model_info.vocab_size, seed=1)
    params = [SamplingParams(temperature=0.0 if i % 2 else 1.0, seed=i, max_tokens=MAX_TOKENS, grammar=SPEC)
              for i in range(len(batch))]
    engine = make_engine(runner)
    results = engine.generate(batch, params)
    for result in results:
        sequence = result.sequences[0]
        assert_valid_document(tokenizer, sequence.token_ids, sequence.finish_reason)
    engine.generate(batch[:1], SamplingParams(max_tokens=2))  # its first step drops the finished states
    assert all(state.matcher is None for state in runner.requests.values())


def test_unconstrained_rows_in_a_constrained_batch_are_untouched(runner):
    free, constrained = prompts(2, runner.model_info.vocab_size, seed=2)
    free_params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    alone = make_engine(runner).generate([free], free_params)[0].sequences[0].token_ids
    grammar_params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, grammar=SPEC)
    together = make_engine(runner).generate([free, constrained], [free_params, grammar_params])
    assert together[0].sequences[0].token_ids == alone
    unmasked = make_engine(runner).generate([constrained], SamplingParams(temperature=0.0, max_tokens=8))[0]
    assert together[1].sequences[0].token_ids[:8] != unmasked.sequences[0].token_ids  # the mask did act


def test_n4_children_each_follow_the_schema_with_their_own_state(runner, tokenizer):
    (prompt,) = prompts(1, runner.model_info.vocab_size, seed=3)
    params = SamplingParams(temperature=1.0, seed=7, n=4, max_tokens=MAX_TOKENS, grammar=SPEC)
    result = make_engine(runner).generate([prompt], params)[0]
    documents = [assert_valid_document(tokenizer, s.token_ids, s.finish_reason) for s in result.sequences]
    assert len({json.dumps(d) for d in documents}) > 1  # each child sampled its own document


def test_preempted_requests_rebuild_their_matchers_and_keep_their_outputs(runner, tokenizer):
    batch = prompts(6, runner.model_info.vocab_size, seed=4)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, grammar=SPEC)
    roomy = make_engine(runner).generate(batch, params)
    small = make_engine(runner, num_blocks=60, max_model_len=128)  # forces recompute preemption
    tight = small.generate(batch, params)
    assert small.stats.num_preemptions > 0
    for a, b in zip(roomy, tight):
        assert a.sequences[0].token_ids == b.sequences[0].token_ids
        assert_valid_document(tokenizer, b.sequences[0].token_ids, b.sequences[0].finish_reason)


def test_resumed_matcher_masks_like_one_advanced_token_by_token(runner, tokenizer):
    grammars: GrammarMatchers = runner.grammars
    text = '{"answer": "no", "count": 12, "word": "ab'
    token_ids = tokenizer.encode(text)
    stepped = grammars.new_matcher(SPEC)
    for token_id in token_ids:
        grammars.accept(stepped, token_id)
    resumed = grammars.new_matcher(SPEC, token_ids)
    masks = grammars.allowed_tokens([0, 1], [stepped, resumed], torch.device("cpu")).bitmask
    assert torch.equal(masks[0], masks[1])
    assert not torch.equal(masks[0], grammars.allowed_tokens([0], [grammars.new_matcher(SPEC)],
                                                             torch.device("cpu")).bitmask[0])


def test_apply_allowed_tokens_masks_only_the_constrained_rows():
    vocab = 70  # not a multiple of 32: the last word is partly padding
    logits = torch.randn(3, vocab)
    bitmask = torch.zeros(1, 3, dtype=torch.int32)
    bitmask[0, 0] = (1 << 5) - (1 << 31)  # tokens 5 and 31 (bit 31 is the int32 sign bit)
    bitmask[0, 2] = 1 << 4  # token 68
    masked = apply_allowed_tokens(logits, AllowedTokens(torch.tensor([1]), bitmask))
    assert torch.equal(masked[0], logits[0]) and torch.equal(masked[2], logits[2])
    assert torch.isfinite(masked[1]).nonzero().view(-1).tolist() == [5, 31, 68]
    assert torch.equal(masked[1, [5, 31, 68]], logits[1, [5, 31, 68]])
