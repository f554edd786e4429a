"""The decoder layers in one C call (workers/native_forward.py) against the Python loop they
replace: the same hidden states bit for bit, every step of a run that mixes prefill chunks,
decodes and sequences joining and leaving."""

from __future__ import annotations

import pytest
import torch
from runner_helpers import greedy, make_runner, prompts_of_lengths, run_requests

from workers.kernels.native import native_available
from workers.linear import GEMV_MAX_ROWS, NativeLinear

pytestmark = pytest.mark.skipif(not native_available(), reason="the C kernels do not build here")


def compare_every_step(runner) -> list[int]:
    """Wraps the model's forward: each step runs the C loop and the Python loop, asserts equal
    hidden states, and records the step's row count where the C loop took it."""
    model = runner.model
    native, python_forward = model.native_forward, model.forward
    compared: list[int] = []

    def both(input_ids, positions, metadata, kv_caches, lora=None):
        assert lora is None  # LoRA steps run the Python loop alone
        states = [[tensor.clone() for tensor in pool] for layer, pool in zip(model.layers, kv_caches)
                  if layer.mixer is not None]  # a recurrent layer's state before the step (workers/recurrent.py)
        model.native_forward = None
        try:
            expected = python_forward(input_ids, positions, metadata, kv_caches)
        finally:
            model.native_forward = native
        if native.takes(input_ids.shape[0]):  # the KV it writes is what the Python loop just wrote
            after = [[tensor.clone() for tensor in pool] for layer, pool in zip(model.layers, kv_caches)
                     if layer.mixer is not None]
            recurrent_pools = [pool for layer, pool in zip(model.layers, kv_caches) if layer.mixer is not None]
            for pool, before in zip(recurrent_pools, states):  # the C loop folds the same tokens into them again
                for tensor, saved in zip(pool, before):
                    tensor.copy_(saved)
            with model.products_plan(metadata):  # the kernels the step's products take, as forward picks them
                assert torch.equal(native(input_ids, positions, metadata, kv_caches), expected)
            for pool, expected_states in zip(recurrent_pools, after):
                assert all(torch.equal(tensor, state) for tensor, state in zip(pool, expected_states))
            compared.append(input_ids.shape[0])
        return expected

    model.forward = both
    return compared


@pytest.mark.parametrize("threads", [1, 2])
def test_c_loop_equals_the_python_loop(tiny_model_dir, threads):
    runner = make_runner(tiny_model_dir, attention_backend="cpu", num_threads=threads)
    assert runner.model.native_forward is not None  # CPU, fp32, our attention, ops and products
    compared = compare_every_step(runner)
    prompts = prompts_of_lengths([1, 3, 8, 17, 29, 45], runner.model_info.vocab_size)
    run_requests(runner, prompts, greedy(12), token_budget=16)  # chunked prompts beside decodes
    max_rows = runner.model.native_forward.max_rows
    if max_rows is None or max_rows >= 16:  # fp32 panels (AVX2: up to 1024 rows, AVX-512: all): every step
        assert len(compared) >= 12 and min(compared) < max(compared), compared
    else:  # the GEMV path (CPUs without panels): the steps of a few rows, as the sequences finish
        assert len(compared) >= 6 and max(compared) <= GEMV_MAX_ROWS, compared


@pytest.mark.parametrize("threads", [1, 2])
def test_c_loop_equals_the_python_loop_over_a_half_pool(tiny_model_dir, threads):
    """fp32 activations over an fp16 KV pool (kv_cache_dtype float16; blocks of 16, which the
    AVX2 body reads with its half loads): both loops round the step's keys and values to half
    on writing them, and read them back the same way."""
    runner = make_runner(tiny_model_dir, attention_backend="cpu", kv_cache_dtype="float16", block_size=16,
                         num_threads=threads)
    assert runner.model_info.kv_cache_dtype == "float16" and runner.kv_caches[0][0].dtype == torch.float16
    compared = compare_every_step(runner)
    prompts = prompts_of_lengths([1, 3, 8, 17, 29, 45], runner.model_info.vocab_size)
    run_requests(runner, prompts, greedy(12), token_budget=16)
    assert len(compared) >= 6, compared


def test_c_loop_in_bf16_on_panels(tiny_model_dir):
    """On AVX512_BF16 CPUs a bf16 model's products are the bf16 panel GEMM, and the C loop
    takes every step of up to its row limit, the same bit for bit as the Python loop."""
    runner = make_runner(tiny_model_dir, attention_backend="cpu", dtype="bfloat16", num_threads=2)
    linear = runner.model.linear_backend
    if not (isinstance(linear, NativeLinear) and linear.has_bf16_panels):
        pytest.skip("this CPU has no bf16 panel GEMM")
    assert runner.model.native_forward.max_rows == linear.panel_max_rows[torch.bfloat16]
    compared = compare_every_step(runner)
    prompts = prompts_of_lengths([1, 3, 8, 17, 29, 45], runner.model_info.vocab_size)
    run_requests(runner, prompts, greedy(12), token_budget=16)
    assert len(compared) >= 12 and min(compared) < max(compared), compared


def test_c_loop_on_the_gemv_path_takes_only_a_few_rows(tiny_model_dir, monkeypatch):
    """Where the products are our GEMV and oneDNN (AVX-512 CPUs; forced here), the C loop takes
    the steps of at most GEMV_MAX_ROWS rows, and the Python loop the rest (oneDNN's)."""
    monkeypatch.setattr(NativeLinear, "__init__", _without_panels(NativeLinear.__init__))
    runner = make_runner(tiny_model_dir, attention_backend="cpu")
    native = runner.model.native_forward
    assert native is not None and native.max_rows == GEMV_MAX_ROWS
    compared = compare_every_step(runner)
    prompts = prompts_of_lengths([5, 9], runner.model_info.vocab_size)
    outputs = run_requests(runner, prompts, greedy(8))
    assert compared and max(compared) <= GEMV_MAX_ROWS and all(len(out) == 8 for out in outputs)


def test_no_c_loop_where_a_part_is_torch(tiny_model_dir):
    assert make_runner(tiny_model_dir, attention_backend="torch").model.native_forward is None
    assert make_runner(tiny_model_dir, attention_backend="cpu", layer_ops="torch").model.native_forward is None
    assert make_runner(tiny_model_dir, attention_backend="cpu", linear_backend="onednn").model.native_forward is None


def _without_panels(init):
    def patched(self) -> None:
        init(self)
        self.has_panels = self.has_bf16_panels = False

    return patched


def _give_layers_variants(model) -> None:
    """Gemma 2 / gpt-oss-like layers on the tiny Llama: a window with a soft-cap, sinks (kept
    in bf16, as a checkpoint may ship them), and a window with sinks."""
    num_heads = model.config.num_heads
    sinks = (1 + 2 * torch.randn(num_heads, generator=torch.Generator().manual_seed(0))).to(torch.bfloat16)
    first, second, third = model.layers[:3]
    first.window, first.softcap = 5, 2.0
    second.sinks = sinks
    third.window, third.sinks = 3, sinks


@pytest.mark.parametrize("threads", [1, 2])
def test_c_loop_equals_the_python_loop_with_attention_variants(tiny_model_dir, threads):
    """Layers with a sliding window, a soft-cap and sinks (LayerWeights' fields): the C loop
    hands each layer's variants to the attention as the Python loop does, bit for bit, over
    prompts longer than the windows, chunked and beside decodes."""
    runner = make_runner(tiny_model_dir, attention_backend="cpu", num_threads=threads)
    _give_layers_variants(runner.model)
    compared = compare_every_step(runner)
    prompts = prompts_of_lengths([1, 3, 8, 17, 29, 45], runner.model_info.vocab_size)
    run_requests(runner, prompts, greedy(12), token_budget=16)
    assert len(compared) >= 6, compared


def test_attention_variants_reach_every_backend(tiny_model_dir):
    """The model passes a layer's variants to its attention: the C kernel (the C loop and the
    Python loop) and the torch reference give the same greedy tokens, and not those of the
    same model without the variants."""
    prompts = prompts_of_lengths([3, 17, 29, 45], 256)
    tokens = {}
    for name, backend, variants in (("cpu", "cpu", True), ("torch", "torch", True), ("plain", "cpu", False)):
        runner = make_runner(tiny_model_dir, attention_backend=backend)
        if variants:
            _give_layers_variants(runner.model)
        tokens[name] = run_requests(runner, prompts, greedy(12), token_budget=16)
    assert tokens["cpu"] == tokens["torch"]
    assert tokens["cpu"] != tokens["plain"], "the variants changed no token: the check is vacuous"
