"""The engine (scheduler + in-process loop) driving the real ModelRunner on the tiny model.

Greedy equality here is exact: the tiny model's weights make near-ties rare (see
tests/tiny_model.py), and our runner computes a token the same way whatever its batch.
"""

from __future__ import annotations

import pytest
import torch

from scheduler.config import SchedulerConfig
from scheduler.engine import Engine
from scheduler.sampling_params import SamplingParams
from workers.model_runner import ModelRunner, RunnerConfig

BLOCK_SIZE = 4


@pytest.fixture(scope="module")
def runner(tiny_model_dir):
    return ModelRunner(
        RunnerConfig(model=str(tiny_model_dir), dtype="float32", block_size=BLOCK_SIZE, num_blocks=400)  # default kernels
    )


def make_engine(runner, **overrides) -> Engine:
    info = runner.model_info
    settings = dict(
        max_num_batched_tokens=64, max_num_seqs=32, block_size=info.block_size,
        num_blocks=info.num_blocks, max_model_len=256,
    )
    settings.update(overrides)
    return Engine(SchedulerConfig(**settings), runner, eos_token_ids=info.eos_token_ids)


def prompts_of_lengths(lengths: list[int], vocab_size: int, seed: int = 0) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab_size, (n,), generator=generator).tolist() for n in lengths]


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)


def test_16_concurrent_greedy_requests_equal_each_alone(runner):
    lengths = [1, 2, 3, 5, 8, 11, 16, 17, 23, 30, 33, 41, 50, 64, 77, 90]
    prompts = prompts_of_lengths(lengths, runner.model_info.vocab_size, seed=1)
    params = [greedy(8 + (i % 5) * 3) for i in range(16)]
    engine = make_engine(runner)  # a 64-token budget: prefill chunks and decodes share steps
    together = engine.generate(prompts, params)
    assert engine.stats.num_steps < sum(len(p) for p in prompts)  # really batched
    alone_engine = make_engine(runner, enable_prefix_caching=False)
    for prompt, p, result in zip(prompts, params, together):
        alone = alone_engine.generate([prompt], p)[0]
        assert result.sequences[0].token_ids == alone.sequences[0].token_ids
        assert len(alone.sequences[0].token_ids) == p.max_tokens


def test_shared_long_prefix_hits_block_rounded_and_same_output(runner):
    prefix, a_tail, b_tail = prompts_of_lengths([42, 3, 5], runner.model_info.vocab_size, seed=2)
    engine = make_engine(runner)
    first = engine.generate([prefix + a_tail], greedy(10))[0]
    second = engine.generate([prefix + b_tail], greedy(10))[0]
    assert first.num_cached_tokens == 0
    assert second.num_cached_tokens == 40  # 42 shared tokens -> 10 full blocks of 4
    assert engine.stats.num_prefix_hit_tokens == 40
    cold = make_engine(runner, enable_prefix_caching=False).generate([prefix + b_tail], greedy(10))[0]
    assert second.sequences[0].token_ids == cold.sequences[0].token_ids


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_burst_with_one_long_prefix_computes_it_once_with_the_same_outputs(runner, async_scheduling):
    # 4 requests arrive together with a 60-token prefix, computed 16 tokens a step: the followers
    # wait for its blocks and, deciding ahead, take those the step in flight fills (landing hits),
    # so the real runner reads KV that another request wrote a step or two before
    prefix, *tails = prompts_of_lengths([60, 3, 5, 2, 7], runner.model_info.vocab_size, seed=6)
    prompts = [prefix + tail for tail in tails]
    engine = make_engine(runner, long_prefill_token_threshold=16, min_shared_prefix_to_wait=8,
                         async_scheduling=async_scheduling)
    results = engine.generate(prompts, greedy(10))
    assert sorted(r.num_cached_tokens for r in results) == [0, 60, 60, 60]  # 15 full blocks of 4
    assert engine.stats.num_prompt_tokens_computed == 60 + sum(len(t) for t in tails)
    alone = make_engine(runner, enable_prefix_caching=False)
    for prompt, result in zip(prompts, results):
        assert result.sequences[0].token_ids == alone.generate([prompt], greedy(10))[0].sequences[0].token_ids


def test_n4_greedy_children_identical_and_prompt_computed_once(runner):
    (prompt,) = prompts_of_lengths([37], runner.model_info.vocab_size, seed=3)
    engine = make_engine(runner)
    result = engine.generate([prompt], greedy(12, n=4))[0]
    tokens = [s.token_ids for s in result.sequences]
    assert len(tokens) == 4 and all(t == tokens[0] for t in tokens)
    # the parent computes 36 tokens once; each child computes the last prompt token itself
    assert engine.stats.num_prompt_tokens_computed == 36 + 4
    single = make_engine(runner).generate([prompt], greedy(12))[0]
    assert single.sequences[0].token_ids == tokens[0]
    separate = make_engine(runner, enable_prefix_caching=False)
    separate.generate([prompt] * 4, greedy(12))
    assert separate.stats.num_prompt_tokens_computed == 4 * 37
    cached = make_engine(runner)  # later copies hit the first one's blocks, still more than the fork
    cached.generate([prompt] * 4, greedy(12))
    assert 36 + 4 < cached.stats.num_prompt_tokens_computed < 4 * 37


def test_n4_seeded_children_reproducible(runner):
    (prompt,) = prompts_of_lengths([21], runner.model_info.vocab_size, seed=4)
    params = SamplingParams(temperature=1.0, seed=1234, n=4, max_tokens=12, ignore_eos=True)
    first = make_engine(runner).generate([prompt], params)[0]
    again = make_engine(runner, max_num_batched_tokens=8).generate([prompt], params)[0]  # other batching
    tokens = [s.token_ids for s in first.sequences]
    assert tokens == [s.token_ids for s in again.sequences]
    assert len({tuple(t) for t in tokens}) > 1  # each child has its own seed
    child2 = make_engine(runner).generate([prompt], SamplingParams(temperature=1.0, seed=1236, max_tokens=12, ignore_eos=True))[0]
    assert child2.sequences[0].token_ids == tokens[2]  # child i samples like seed + i


def test_preemption_under_a_small_pool_keeps_greedy_streams(runner):
    prompts = prompts_of_lengths([30, 25, 40, 12, 33, 20], runner.model_info.vocab_size, seed=5)
    big = make_engine(runner).generate(prompts, greedy(24))
    small = make_engine(runner, num_blocks=70, max_model_len=128)  # 69 usable blocks of 4 tokens
    tight = small.generate(prompts, greedy(24))
    assert small.stats.num_preemptions > 0
    assert [r.sequences[0].token_ids for r in tight] == [r.sequences[0].token_ids for r in big]
