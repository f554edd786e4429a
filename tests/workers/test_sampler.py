"""Sampler unit tests on hand-made logits, and seeded sampling through the runner."""

from __future__ import annotations

import pytest
import torch
from runner_helpers import make_runner, prompts_of_lengths, run_requests

from scheduler.sampling_params import SamplingParams
from workers.kernels.sampling import apply_penalties
from workers.sampler import Sampler, SamplingBatch, argmax_rows, seeded_uniform

VOCAB = 50


def batch_of(params: list[SamplingParams], positions: list[int] | None = None,
             histories: list[list[int]] | None = None, num_prompt: list[int] | None = None) -> SamplingBatch:
    histories = histories or [[] for _ in params]
    return SamplingBatch(
        params=params,
        output_positions=positions or [0] * len(params),
        token_ids=histories,
        num_prompt_tokens=num_prompt or [0] * len(params),
    )


def random_logits(rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def test_all_greedy_batch_is_argmax():
    logits = random_logits(6)
    out = Sampler().sample(logits, batch_of([SamplingParams(temperature=0.0)] * 6))
    assert out.token_ids == logits.argmax(-1).tolist()
    assert out.logprobs == [None] * 6


@pytest.mark.parametrize("width", [1, 7, 16, 33, 49152])
def test_argmax_rows_gives_torch_argmax_answers_on_ties_nan_and_inf(width):
    """Our C argmax (CPU fp32 rows) against torch's: the first index on ties, the first NaN of a
    row holding one, index 0 of an all -inf row; vector lanes and the scalar tail alike."""
    generator = torch.Generator().manual_seed(width)
    rows = [torch.randn(width, generator=generator),
            torch.randint(-2, 3, (width,), generator=generator).float(),  # many ties
            torch.full((width,), float("-inf")),
            torch.zeros(width)]
    with_nan = torch.randn(width, generator=generator)
    with_nan[width // 2] = float("nan")
    rows.append(with_nan)
    late_max = torch.randn(width, generator=generator)
    late_max[-1] = 100.0  # in the tail past the last full vector
    rows.append(late_max)
    logits = torch.stack(rows)
    assert argmax_rows(logits).tolist() == logits.argmax(-1).tolist()
    assert argmax_rows(logits[:1]).tolist() == logits[:1].argmax(-1).tolist()  # one row: no split


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.5, top_k=1),
    SamplingParams(temperature=1.0, top_p=1e-6),
    SamplingParams(temperature=2.0, min_p=0.999),
])
def test_filters_that_keep_only_the_top_token_act_like_greedy(params):
    logits = random_logits(8, seed=1)
    out = Sampler(seed=3).sample(logits, batch_of([params] * 8))
    assert out.token_ids == logits.argmax(-1).tolist()


def test_top_k_and_top_p_keep_sampling_inside_the_allowed_set():
    logits = random_logits(1, seed=2).repeat(400, 1)
    ranked = logits[0].argsort(descending=True).tolist()
    probs = logits[0].softmax(-1)[ranked]
    nucleus = next(i for i in range(VOCAB) if probs[: i + 1].sum() >= 0.6) + 1
    top_k = Sampler(seed=1).sample(logits, batch_of([SamplingParams(top_k=3)] * 400)).token_ids
    top_p = Sampler(seed=1).sample(logits, batch_of([SamplingParams(top_p=0.6)] * 400)).token_ids
    assert set(top_k) == set(ranked[:3])
    assert set(top_p) == set(ranked[:nucleus])


def test_unseeded_draws_follow_the_distribution():
    probs = torch.tensor([0.5, 0.3, 0.2])
    logits = probs.log().repeat(20000, 1)
    tokens = Sampler(seed=0).sample(logits, batch_of([SamplingParams()] * 20000)).token_ids
    frequencies = torch.bincount(torch.tensor(tokens), minlength=3).float() / 20000
    torch.testing.assert_close(frequencies, probs, atol=0.015, rtol=0)


def test_seeded_row_depends_only_on_seed_and_position():
    logits = random_logits(5, seed=4)
    seeded = SamplingParams(temperature=1.0, seed=1234)
    alone = Sampler(seed=0).sample(logits[2:3], batch_of([seeded], positions=[9])).token_ids[0]
    others = [SamplingParams(temperature=0.7), SamplingParams(temperature=0.0), seeded,
              SamplingParams(temperature=1.0, seed=99), SamplingParams(top_k=5)]
    batched = Sampler(seed=77).sample(logits, batch_of(others, positions=[0, 3, 9, 1, 2])).token_ids[2]
    assert alone == batched
    draws = {Sampler().sample(logits[2:3], batch_of([seeded], positions=[p])).token_ids[0] for p in range(40)}
    assert len(draws) > 1  # the position matters
    assert seeded_uniform(1, 2) != seeded_uniform(2, 1)


def test_penalties_match_their_definitions():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, 1.2], [2.0, -1.0, 0.5, 3.0, 1.2]])
    prompt, output = [0, 1], [3, 3, 2]
    penalized = SamplingParams(temperature=0.0, repetition_penalty=2.0, presence_penalty=0.5,
                               frequency_penalty=0.25, logprobs=2)
    plain = SamplingParams(temperature=0.0)
    batch = batch_of([plain, penalized], histories=[prompt + output] * 2, num_prompt=[2, 2])
    # repetition (prompt + output): positive / 2, negative * 2; then presence + frequency (output only)
    expected = torch.tensor([[2.0, -1.0, 0.5, 3.0, 1.2],
                             [2.0 / 2, -1.0 * 2, 0.5 / 2 - 0.5 - 0.25, 3.0 / 2 - 0.5 - 0.5, 1.2]])
    torch.testing.assert_close(apply_penalties(logits, Sampler().row_params(batch)), expected)
    out = Sampler().sample(logits, batch)
    assert out.token_ids == [3, 4]
    raw = torch.log_softmax(logits[1], -1)  # logprobs are of the raw logits
    assert out.logprobs[1].logprob == pytest.approx(float(raw[4]), abs=1e-6)
    assert [token for token, _ in out.logprobs[1].top] == [3, 0]


def test_logprobs_zero_gives_only_the_sampled_token():
    logits = random_logits(2, seed=5)
    out = Sampler().sample(logits, batch_of([SamplingParams(temperature=0.0, logprobs=0),
                                              SamplingParams(temperature=0.0)]))
    assert out.logprobs[0].top == [] and out.logprobs[1] is None
    assert out.logprobs[0].logprob == pytest.approx(float(torch.log_softmax(logits[0], -1).max()), abs=1e-6)


def test_seeded_requests_same_alone_and_batched_in_the_runner(tiny_model_dir):
    runner = make_runner(tiny_model_dir)
    prompts = prompts_of_lengths([12, 5, 31, 8], runner.model_info.vocab_size, seed=9)
    seeded = SamplingParams(temperature=1.0, top_p=0.95, seed=42, max_tokens=16, ignore_eos=True)
    alone = run_requests(runner, prompts[:1], seeded)[0]
    others = [SamplingParams(temperature=0.8, max_tokens=10, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True),
              SamplingParams(temperature=1.2, seed=5, max_tokens=16, ignore_eos=True)]
    batched = run_requests(runner, prompts, [seeded] + others, token_budget=16)[0]
    assert alone == batched
    different_seed = run_requests(runner, prompts[:1], SamplingParams(
        temperature=1.0, top_p=0.95, seed=43, max_tokens=16, ignore_eos=True))[0]
    assert different_seed != alone


def test_seeded_request_resumed_after_preemption_continues_identically(tiny_model_dir):
    from workers.simple_driver import SimpleDriver

    runner = make_runner(tiny_model_dir)
    prompt = prompts_of_lengths([10], runner.model_info.vocab_size, seed=11)[0]
    seeded = SamplingParams(temperature=1.0, seed=2024, max_tokens=14, ignore_eos=True)
    uninterrupted = run_requests(runner, [prompt], seeded)[0]
    driver = SimpleDriver(runner)
    driver.add_request("resumed", prompt, seeded, output_token_ids=uninterrupted[:5])  # recomputed, then sampled
    assert driver.run()["resumed"].output_token_ids == uninterrupted


def test_seeded_request_same_on_two_workers(tiny_model_dir):
    """Two runners (two workers) whose shared generators differ give a seeded request the same tokens."""
    first, second = make_runner(tiny_model_dir, seed=1), make_runner(tiny_model_dir, seed=2)
    prompt = prompts_of_lengths([9], first.model_info.vocab_size, seed=12)
    seeded = SamplingParams(temperature=0.9, top_k=40, top_p=0.9, seed=77, max_tokens=16, ignore_eos=True)
    assert run_requests(first, prompt, seeded) == run_requests(second, prompt, seeded)
    unseeded = SamplingParams(temperature=1.5, max_tokens=16, ignore_eos=True)
    assert run_requests(first, prompt, unseeded) != run_requests(second, prompt, unseeded)


# ---------------------------------------------------------------- the C kernel against its oracle

KERNEL_PARAMS = [  # temperature, top_k (0: off), top_p, min_p
    (1.0, 0, 1.0, 0.0), (1.0, 0, 0.95, 0.0), (0.7, 5, 1.0, 0.0), (1.0, 3, 0.5, 0.0), (2.0, 0, 1.0, 0.2),
    (1e-3, 0, 0.9, 0.0), (1.0, 0, 1e-6, 0.0), (0.5, 2, 0.9, 0.1), (1.0, 10**6, 0.99, 0.0), (0.0, 0, 1.0, 0.0),
]


def kernel_cases(vocab: int, rows: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits with masked (-inf) tokens, rows of many ties (rounded logits, one all equal), and uniforms."""
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=generator) * 2
    if vocab > 3:
        logits[:, ::3] = float("-inf")
    logits[rows // 2:, : vocab // 2] = logits[rows // 2:, : vocab // 2].round()
    logits[0] = 1.0
    return logits, torch.rand(rows, dtype=torch.float64, generator=generator)


@pytest.mark.parametrize("vocab", [1, 7, 8, 9, 63, 64, 65, 1000, 49152])
def test_native_kernel_draws_the_torch_reference_tokens(vocab):
    """Same logits and uniform numbers: the kernel and sample_rows_torch pick the same tokens,
    over vector widths, block edges, ties, masked tokens and every filter."""
    from workers.kernels.sampling import RowParams, native_sampler_available, sample_rows_native, sample_rows_torch

    if not native_sampler_available():
        pytest.skip("the C kernels do not build here")
    rows = 48 if vocab > 1000 else 192
    for index, (temperature, top_k, top_p, min_p) in enumerate(KERNEL_PARAMS):
        logits, uniforms = kernel_cases(vocab, rows, seed=vocab + index)
        params = RowParams.of([temperature] * rows, [top_k] * rows, [top_p] * rows, [min_p] * rows, uniforms)
        assert sample_rows_native(logits, params).tolist() == sample_rows_torch(logits, params).tolist()


def test_native_kernel_rows_without_a_finite_maximum_take_argmax():
    from workers.kernels.sampling import RowParams, native_sampler_available, sample_rows_native, sample_rows_torch

    if not native_sampler_available():
        pytest.skip("the C kernels do not build here")
    logits = torch.randn(4, 100, generator=torch.Generator().manual_seed(3))
    logits[0, 5] = float("nan")
    logits[1] = float("-inf")
    logits[2, 7] = float("inf")
    params = RowParams.of([1.0] * 4, [0] * 4, [0.9] * 4, [0.0] * 4, [0.5] * 4)
    native = sample_rows_native(logits, params).tolist()
    assert native[:3] == [5, 0, 7] == sample_rows_torch(logits, params).tolist()[:3]


def test_scalar_build_of_the_kernel_draws_the_same_tokens(tmp_path):
    """The plain C path (CPUs without AVX2) built here with -march=x86-64: the torch reference's tokens."""
    import ctypes
    import shutil
    import subprocess

    from workers.kernels import native
    from workers.kernels.sampling import RowParams, sample_rows_torch

    cc = native.compiler()
    if cc is None or shutil.which(cc) is None:
        pytest.skip("no C compiler")
    library_path = tmp_path / "scalar_sampler.so"
    flags = [flag for flag in native.CFLAGS if flag != "-march=native"] + ["-march=x86-64"]
    sources = [str(native.SOURCE_DIR / name) for name in ("sampler.c", "layer_ops.c", "thread_pool.c")]
    subprocess.run([cc, *flags, "-o", str(library_path), *sources, "-lm"], check=True, capture_output=True)
    kernel = ctypes.CDLL(str(library_path)).rayllm_sample
    kernel.argtypes, kernel.restype = [ctypes.POINTER(native.SampleArgs)], ctypes.c_int
    for vocab, (temperature, top_k, top_p, min_p) in zip([9, 65, 1000, 49152, 200], KERNEL_PARAMS):
        rows = 32
        logits, uniforms = kernel_cases(vocab, rows, seed=vocab)
        params = RowParams.of([temperature] * rows, [top_k] * rows, [top_p] * rows, [min_p] * rows, uniforms)
        out, workspace = torch.empty(rows, dtype=torch.long), torch.empty(rows * vocab)
        args = native.SampleArgs(logits=logits.data_ptr(), workspace=workspace.data_ptr(),
                                 params=params.table.data_ptr(), out=out.data_ptr(), num_rows=rows, vocab=vocab,
                                 logits_stride=vocab, num_threads=2)
        assert kernel(ctypes.byref(args)) == 0
        assert out.tolist() == sample_rows_torch(logits, params).tolist()


@pytest.mark.parametrize("vocab", [5, 31, 32, 33, 200, 49152])
def test_native_kernel_reads_grammar_bitmasks_as_the_torch_path_masks(vocab):
    """Rows under a grammar (some greedy, some sampled, with filters) and free rows in one
    batch: the kernel, reading the bitmask, takes the tokens the torch path takes from masked
    logits, and never a forbidden one."""
    from workers.kernels.sampling import (AllowedTokens, RowParams, apply_allowed_tokens, native_sampler_available,
                                          sample_rows_native, sample_rows_torch)

    if not native_sampler_available():
        pytest.skip("the C kernels do not build here")
    rows = 64
    logits, uniforms = kernel_cases(vocab, rows, seed=vocab)
    generator = torch.Generator().manual_seed(vocab)
    words = (vocab + 31) // 32
    constrained = torch.arange(0, rows, 2)
    bitmask = torch.randint(-2**31, 2**31 - 1, (len(constrained), words), generator=generator, dtype=torch.int32)
    bitmask[:, 0] |= 1 << 3 if vocab > 3 else 1  # every row allows at least one token
    allowed = AllowedTokens(constrained, bitmask)
    params = [KERNEL_PARAMS[row % len(KERNEL_PARAMS)] for row in range(rows)]
    row_params = RowParams.of(*zip(*params), uniforms)
    native = sample_rows_native(logits, row_params, allowed=allowed)
    masked = apply_allowed_tokens(logits, allowed)
    assert native.tolist() == sample_rows_torch(masked, row_params).tolist()
    for index, row in enumerate(constrained.tolist()):
        token = int(native[row])
        if torch.isfinite(masked[row]).any():
            assert (int(bitmask[index, token // 32]) >> (token % 32)) & 1, (row, token)


@pytest.mark.parametrize("vocab", [40, 1000, 49152])
def test_native_kernel_applies_penalties_as_the_torch_path(vocab):
    """Rows with repetition, presence and frequency penalties (histories with repeats, greedy and
    sampled rows, some under a grammar) beside rows without: the kernel's tokens are the torch
    path's (penalize, mask, then draw)."""
    from workers.kernels.sampling import (AllowedTokens, apply_allowed_tokens, native_sampler_available,
                                          sample_rows_native, sample_rows_torch)

    if not native_sampler_available():
        pytest.skip("the C kernels do not build here")
    rows = 48
    logits, _ = kernel_cases(vocab, rows, seed=vocab + 1)
    logits[:, ::3] = torch.randn(rows, len(range(0, vocab, 3)), generator=torch.Generator().manual_seed(1))
    generator = torch.Generator().manual_seed(vocab)
    penalties = [(1.0, 0.0, 0.0), (1.3, 0.0, 0.0), (0.8, 0.0, 0.0), (1.0, 0.6, 0.3), (1.2, -0.5, 1.5)]
    params, histories = [], []
    for row in range(rows):
        repetition, presence, frequency = penalties[row % len(penalties)]
        params.append(SamplingParams(temperature=0.0 if row % 4 == 0 else 0.9, top_p=0.9 if row % 3 else 1.0,
                                     repetition_penalty=repetition, presence_penalty=presence,
                                     frequency_penalty=frequency))
        histories.append(torch.randint(0, min(vocab, 60), (30,), generator=generator).tolist())  # many repeats
    batch = SamplingBatch(params, list(range(rows)), histories, [12] * rows)
    words = (vocab + 31) // 32
    bitmask = torch.randint(-2**31, 2**31 - 1, (rows // 4, words), generator=generator, dtype=torch.int32)
    allowed = AllowedTokens(torch.arange(0, rows, 4), bitmask)
    row_params = Sampler(seed=4).row_params(batch)
    native = sample_rows_native(logits, row_params, allowed=allowed)
    expected = sample_rows_torch(apply_allowed_tokens(apply_penalties(logits, row_params), allowed), row_params)
    assert native.tolist() == expected.tolist()
