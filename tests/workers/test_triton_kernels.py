"""Triton kernels (workers/kernels/triton_attention.py, triton_cache.py) run in Triton's
interpreter on CPU tensors, checked against a float64 dense oracle (tests/kernel_cases.py)
and, where it exists, the torch reference backend (workers/kernels/torch_ref.py).

How the interpreter is switched on. Triton picks interpreted vs compiled when `@triton.jit`
decorates a function, reading TRITON_INTERPRET at that moment, and triton.language's own
helpers (tl.zeros, tl.cdiv, tl.max, ...) are decorated when triton.language is first imported.
So the variable must be set before anything in the process imports triton:
- On a machine without CUDA, this module sets TRITON_INTERPRET=1 before importing triton
  (if nothing imported triton yet). Compiled Triton cannot run there anyway, so this changes
  nothing that could have worked for later test modules.
- If triton was already imported compiled (another module got there first, or a GPU is
  present and flipping the process-wide switch would turn tests/gpu into interpreter runs),
  the tests here skip and one test, test_kernels_in_interpreter_subprocess, reruns this file
  in a child pytest with TRITON_INTERPRET=1 and fails if the child fails.
- The kernel modules are imported privately under TRITON_INTERPRET=1 (and sys.modules
  restored), so a compiled copy imported earlier by the runner is never used here.
`TRITON_INTERPRET=1 pytest tests/workers/test_triton_kernels.py` always runs in process.

bf16 in the interpreter: triton's interpreter stores bf16 as raw uint16 and its tl.dot
multiplies those bit patterns as integers (numpy has no bf16), so bf16 attention is garbage
there. The bf16 tests patch the interpreter's dot (for that test only) to widen bf16 operands
to fp32 exactly first; everything else in the kernel (loads, casts, exp2, stores) runs
unpatched. fp16 and fp32 need no patch.

Tolerances: kernel_cases.ATOL (max abs error vs the float64 oracle, per dtype).
CI runs a small grid; `-m big` runs the larger one.
"""

from __future__ import annotations

import importlib
import os
import random
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

if "triton" not in sys.modules and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before triton's first import: see the module docstring
triton = pytest.importorskip("triton", reason="triton is not installed (pip install -e '.[gpu]'): kernel tests skipped")

from triton.runtime.interpreter import InterpretedFunction  # noqa: E402
import triton.language.standard  # noqa: E402

# True when triton.language itself was set up for the interpreter (see the module docstring).
IN_PROCESS = isinstance(triton.language.standard.zeros, InterpretedFunction)
NOT_IN_PROCESS_REASON = (
    "triton was imported compiled before this module (or a GPU is present), so the interpreter "
    "cannot run in this process: test_kernels_in_interpreter_subprocess runs these tests instead"
)

_KERNEL_MODULES = ("workers.kernels.triton_cache", "workers.kernels.triton_attention")


import kernel_cases as kc  # noqa: E402  (tests/kernel_cases.py; tests/ is on sys.path via tests/conftest.py)
from families_catalog import SERVED_FAMILIES  # noqa: E402
from tiny_model import build_tiny_model_dir  # noqa: E402


def _import_interpreted_kernels() -> SimpleNamespace:
    saved_modules = {name: sys.modules.pop(name) for name in _KERNEL_MODULES if name in sys.modules}
    saved_env = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        attention = importlib.import_module("workers.kernels.triton_attention")
        cache = sys.modules["workers.kernels.triton_cache"]
    finally:
        if saved_env is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = saved_env
        for name in _KERNEL_MODULES:
            sys.modules.pop(name, None)
        sys.modules.update(saved_modules)
    assert isinstance(attention._paged_attention_kernel, InterpretedFunction)
    assert isinstance(cache._write_kv_cache_kernel, InterpretedFunction)
    return SimpleNamespace(
        paged_attention=attention.paged_attention, write_kv_cache=cache.write_kv_cache, attention_module=attention
    )


@pytest.fixture(scope="module")
def kernels() -> SimpleNamespace:
    if not IN_PROCESS:
        pytest.skip(NOT_IN_PROCESS_REASON)
    return _import_interpreted_kernels()


def test_kernels_in_interpreter_subprocess(request):
    if IN_PROCESS:
        pytest.skip("the interpreter runs in this process: the tests below ran here")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    markexpr = request.config.getoption("markexpr") or "not big"
    cmd = [sys.executable, "-m", "pytest", __file__, "-q", "-p", "no:cacheprovider", "-m", markexpr]
    child = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    tail = "\n".join(child.stdout.splitlines()[-25:])
    assert child.returncode == 0, f"interpreter run failed (rc {child.returncode}):\n{tail}\n{child.stderr[-2000:]}"
    print(tail)


@pytest.fixture
def bf16_dot(monkeypatch):
    """Widen bf16 tl.dot operands to fp32 in the interpreter (exact), for one test."""
    import triton.language as tl
    from triton.runtime import interpreter

    original = interpreter.InterpreterBuilder.create_dot

    def widen(handle):
        if handle.dtype.scalar != tl.bfloat16:
            return handle
        data = (handle.data.astype(np.uint32) << np.uint32(16)).view(np.float32)
        return interpreter.TensorHandle(data, tl.float32)

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        return original(self, widen(a), widen(b), d, input_precision, max_num_imprecise_acc)

    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_dot", create_dot)


def _torch_ref():
    try:
        return importlib.import_module("workers.kernels.torch_ref")
    except ImportError as exc:
        pytest.skip(f"workers.kernels.torch_ref is not importable yet ({exc}); checked against the dense oracle only")


def _run(kernels, batch: "kc.PagedBatch", **variants) -> torch.Tensor:
    """write_kv_cache for this step's tokens, then paged_attention: the runner's order."""
    kernels.write_kv_cache(batch.k_new, batch.v_new, batch.k_cache, batch.v_cache, batch.slot_mapping)
    return kernels.paged_attention(*batch.attention_args(), **variants)


def _check_attention(kernels, specs, *, block_size, head_dim, gqa, dtype, num_kv_heads=2, seed=0) -> float:
    batch = kc.make_batch(
        specs, block_size=block_size, num_kv_heads=num_kv_heads, num_queries_per_kv=gqa,
        head_dim=head_dim, dtype=dtype, seed=seed,
    )
    out = _run(kernels, batch)
    assert out.dtype == dtype and out.shape == batch.q.shape
    err = kc.max_abs_err(out, kc.naive_attention(batch))
    assert err <= kc.ATOL[dtype], f"max abs error {err:.3g} > {kc.ATOL[dtype]} ({dtype}, specs {specs})"
    return err


# ----------------------------------------------------------------------------- write_kv_cache


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("block_size", [16, 32])
def test_write_kv_cache_matches_index_put(kernels, block_size, dtype):
    batch = kc.make_batch(kc.MIXED_SPECS, block_size=block_size, num_kv_heads=3, num_queries_per_kv=1, head_dim=64, dtype=dtype)
    expected_k, expected_v = batch.pool_after_write()
    kernels.write_kv_cache(batch.k_new, batch.v_new, batch.k_cache, batch.v_cache, batch.slot_mapping)
    # Bit-exact, and every slot not in slot_mapping (NaN) untouched.
    torch.testing.assert_close(batch.k_cache, expected_k, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(batch.v_cache, expected_v, rtol=0, atol=0, equal_nan=True)


def test_write_kv_cache_strided_views_and_negative_slots(kernels):
    num_tokens, num_heads, num_kv_heads, head_dim = 6, 4, 2, 80  # non power-of-two head_dim
    qkv = torch.randn(num_tokens, num_heads + 2 * num_kv_heads, head_dim)  # the runner splits one projection
    k = qkv[:, num_heads : num_heads + num_kv_heads]
    v = qkv[:, num_heads + num_kv_heads :]
    assert not k.is_contiguous()
    k_cache = torch.zeros(4, 16, num_kv_heads, head_dim)
    v_cache = torch.zeros(4, 16, num_kv_heads, head_dim)
    slots = torch.tensor([17, -1, 3, 63, -1, 40], dtype=torch.int64)  # -1: padding, skipped
    kernels.write_kv_cache(k, v, k_cache, v_cache, slots)
    flat_k, flat_v = k_cache.view(-1, num_kv_heads, head_dim), v_cache.view(-1, num_kv_heads, head_dim)
    keep = slots >= 0
    assert torch.equal(flat_k[slots[keep]], k[keep]) and torch.equal(flat_v[slots[keep]], v[keep])
    untouched = torch.ones(64, dtype=torch.bool)
    untouched[slots[keep]] = False
    assert flat_k[untouched].eq(0).all() and flat_v[untouched].eq(0).all()


# ----------------------------------------------------------------------------- paged_attention


@pytest.mark.parametrize("gqa", [1, 3, 4])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("block_size", [16, 32])
def test_paged_attention_mixed_batch_fp32(kernels, block_size, head_dim, gqa):
    _check_attention(kernels, kc.MIXED_SPECS, block_size=block_size, head_dim=head_dim, gqa=gqa, dtype=torch.float32)


@pytest.mark.parametrize(("block_size", "head_dim", "gqa"), [(16, 64, 3), (32, 128, 4)])
def test_paged_attention_mixed_batch_fp16(kernels, block_size, head_dim, gqa):
    _check_attention(kernels, kc.MIXED_SPECS, block_size=block_size, head_dim=head_dim, gqa=gqa, dtype=torch.float16)


@pytest.mark.parametrize(("block_size", "head_dim", "gqa"), [(16, 64, 3), (32, 128, 4)])
def test_paged_attention_mixed_batch_bf16(kernels, bf16_dot, block_size, head_dim, gqa):
    _check_attention(kernels, kc.MIXED_SPECS, block_size=block_size, head_dim=head_dim, gqa=gqa, dtype=torch.bfloat16)


@pytest.mark.parametrize(
    ("specs", "head_dim", "gqa", "num_kv_heads"),
    [
        pytest.param(kc.DECODE_SPECS, 64, 3, 3, id="decode-only"),  # 16-row tiles, one padded row
        pytest.param(kc.DECODE_SPECS, 64, 8, 1, id="decode-only-gqa8"),  # 2 tokens per tile
        pytest.param(kc.PREFILL_SPECS, 64, 1, 2, id="prefill-only"),
        pytest.param(kc.MIXED_SPECS, 80, 3, 1, id="head-dim-80"),  # padded head_dim, masked lanes
        pytest.param([(10, 0), (5, 3), (0, 0), (7, 1)], 64, 4, 1, id="zero-query-seqs"),
        pytest.param([(200, 1), (150, 30)], 64, 3, 1, id="long-prefix"),  # many pages per program
    ],
)
def test_paged_attention_batch_shapes(kernels, specs, head_dim, gqa, num_kv_heads):
    _check_attention(kernels, specs, block_size=16, head_dim=head_dim, gqa=gqa, dtype=torch.float32, num_kv_heads=num_kv_heads)


def test_paged_attention_strided_q_and_empty_batch(kernels):
    batch = kc.make_batch(kc.MIXED_SPECS, block_size=16, num_kv_heads=2, num_queries_per_kv=2, head_dim=64, dtype=torch.float32)
    qkv = torch.cat([batch.q, batch.k_new, batch.v_new], dim=1)  # q as a view into one projection
    batch.q = qkv[:, : batch.q.shape[1]]
    assert not batch.q.is_contiguous()
    out = _run(kernels, batch)
    assert kc.max_abs_err(out, kc.naive_attention(batch)) <= kc.ATOL[torch.float32]

    empty = kernels.paged_attention(
        batch.q[:0], batch.k_cache, batch.v_cache, batch.block_tables[:0],
        torch.zeros(1, dtype=torch.int32), torch.zeros(0, dtype=torch.int32), batch.scale,
    )
    assert empty.shape == (0, 4, 64)


def test_launcher_rejects_bad_inputs(kernels):
    batch = kc.make_batch([(3, 2)], block_size=16, num_kv_heads=2, num_queries_per_kv=2, head_dim=64, dtype=torch.float32)
    q, k_cache, v_cache, tables, qsl, seq_lens, scale = batch.attention_args()
    bad_calls = {
        "int64 block table": (q, k_cache, v_cache, tables.long(), qsl, seq_lens, scale),
        "int64 seq_lens": (q, k_cache, v_cache, tables, qsl, seq_lens.long(), scale),
        "short query_start_loc": (q, k_cache, v_cache, tables, qsl[:1], seq_lens, scale),
        "dtype mismatch": (q.half(), k_cache, v_cache, tables, qsl, seq_lens, scale),
        "head_dim mismatch": (q[..., :32], k_cache, v_cache, tables, qsl, seq_lens, scale),
        "heads not a multiple": (q[:, :3], k_cache, v_cache, tables, qsl, seq_lens, scale),
        "block_size 8": (q, k_cache[:, :8], v_cache[:, :8], tables, qsl, seq_lens, scale),
        "head_dim not contiguous": (q.transpose(1, 2).contiguous().transpose(1, 2), k_cache, v_cache, tables, qsl, seq_lens, scale),
    }
    for name, args in bad_calls.items():
        with pytest.raises(AssertionError):
            kernels.paged_attention(*args)
            pytest.fail(f"accepted: {name}")
    with pytest.raises(AssertionError):  # int32 slots
        kernels.write_kv_cache(batch.k_new, batch.v_new, k_cache, v_cache, batch.slot_mapping.int())


# ----------------------------------------------------------------------------- vs torch reference


@pytest.mark.parametrize(("block_size", "head_dim", "gqa"), [(16, 64, 3), (32, 128, 1)])
def test_matches_torch_ref(kernels, block_size, head_dim, gqa):
    torch_ref = _torch_ref()
    # Finite garbage, not NaN, in unwritten slots: torch_ref gathers padded key slots for
    # batched decodes and masks them in SDPA, and a masked NaN value still yields 0 * NaN.
    batch = kc.make_batch(
        kc.MIXED_SPECS, block_size=block_size, num_kv_heads=2, num_queries_per_kv=gqa,
        head_dim=head_dim, dtype=torch.float32, fill="garbage",
    )
    ref_k, ref_v = batch.k_cache.clone(), batch.v_cache.clone()
    torch_ref.write_kv_cache(batch.k_new, batch.v_new, ref_k, ref_v, batch.slot_mapping)
    out = _run(kernels, batch)
    torch.testing.assert_close(batch.k_cache, ref_k, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(batch.v_cache, ref_v, rtol=0, atol=0, equal_nan=True)
    ref_out = torch_ref.paged_attention(batch.q, ref_k, ref_v, batch.block_tables, batch.query_start_loc, batch.seq_lens, batch.scale)
    err = kc.max_abs_err(out, ref_out)
    assert err <= kc.ATOL[torch.float32], f"triton vs torch_ref: max abs error {err:.3g}"


# ----------------------------------------------------------------------------- variants: window, softcap, sinks


def _check_variants(kernels, variant, *, block_size, head_dim, gqa, dtype, specs=kc.WINDOW_SPECS, num_kv_heads=2):
    """The variant against the float64 oracle, with NaN in every slot no sequence owns and in
    every block wholly before a sequence's windows (a page read there poisons the output)."""
    batch = kc.make_batch(specs, block_size=block_size, num_kv_heads=num_kv_heads, num_queries_per_kv=gqa,
                          head_dim=head_dim, dtype=dtype, seed=gqa)
    variants = kc.variant_kwargs(variant, num_kv_heads * gqa, seed=gqa)
    if kc.hides_keys(variants):
        assert kc.poison_outside_windows(batch, variants.get("window"), variants.get("attention_chunk")) > 0
    out = _run(kernels, batch, **variants)
    assert not out.isnan().any(), "read a page outside the sequence's keys or windows"
    err = kc.max_abs_err(out, kc.naive_attention(batch, **variants))
    assert err <= kc.ATOL[dtype], f"max abs error {err:.3g} > {kc.ATOL[dtype]} ({dtype}, {variant})"


@pytest.mark.parametrize(("block_size", "head_dim", "gqa"), [(16, 64, 3), (32, 32, 1)])
@pytest.mark.parametrize("variant", list(kc.VARIANTS))
def test_paged_attention_variants_fp32(kernels, variant, block_size, head_dim, gqa):
    """Prompts longer than the window, chunks after cached keys, decodes, GQA; windows opening
    mid-page and on page boundaries."""
    _check_variants(kernels, variant, block_size=block_size, head_dim=head_dim, gqa=gqa, dtype=torch.float32)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("variant", ["window7", "all", "chunk7"])
def test_paged_attention_variants_16_bit(kernels, bf16_dot, variant, dtype):
    _check_variants(kernels, variant, block_size=16, head_dim=64, gqa=4, dtype=dtype)


@pytest.mark.parametrize("variant", ["window-sinks", "window-softcap", "chunk7"])
def test_paged_attention_variants_decode_tiles(kernels, variant):
    """Decode-only batches (16-row tiles of 2 tokens x 8 heads) far past their windows (or chunk starts)."""
    _check_variants(kernels, variant, block_size=16, head_dim=64, gqa=8, dtype=torch.float32, num_kv_heads=1,
                    specs=[(70, 1), (15, 1), (16, 1), (0, 1), (130, 1)])


def test_variants_match_torch_ref(kernels):
    torch_ref = _torch_ref()
    batch = kc.make_batch(kc.WINDOW_SPECS, block_size=16, num_kv_heads=2, num_queries_per_kv=3, head_dim=64,
                          dtype=torch.float32, fill="garbage")
    variants = kc.variant_kwargs("all", 6)
    ref_k, ref_v = batch.k_cache.clone(), batch.v_cache.clone()
    torch_ref.write_kv_cache(batch.k_new, batch.v_new, ref_k, ref_v, batch.slot_mapping)
    out = _run(kernels, batch, **variants)
    ref_out = torch_ref.paged_attention(batch.q, ref_k, ref_v, batch.block_tables, batch.query_start_loc,
                                        batch.seq_lens, batch.scale, **variants)
    assert kc.max_abs_err(out, ref_out) <= kc.ATOL[torch.float32]
    with pytest.raises(ValueError, match="window"):
        kernels.paged_attention(*batch.attention_args(), window=0)


# ----------------------------------------------------------------------------- end to end


def test_runner_greedy_triton_equals_torch(kernels, tmp_path, monkeypatch):
    """The model runner with the (interpreted) Triton backend generates the same greedy tokens
    as with the torch backend: tiny random Llama (GQA 3, head_dim 32), fp32, steps mixing
    prefill chunks with and without a prefix and decodes."""
    model_runner = pytest.importorskip("workers.model_runner", reason="workers.model_runner is not importable")
    model_dir = tmp_path / "tiny-llama"
    kc.write_tiny_llama(model_dir)
    # The runner imports its backend by module name: hand it the interpreted copy.
    monkeypatch.setitem(sys.modules, "workers.kernels.triton_attention", kernels.attention_module)
    prompts = kc.e2e_prompts()
    tokens = {}
    for backend in ("torch", "triton", "perturbed"):
        name = "torch" if backend == "perturbed" else backend
        config = model_runner.RunnerConfig(model=str(model_dir), dtype="float32", attention_backend=name, layer_ops="torch",
                                           block_size=16, num_blocks=64)
        runner = model_runner.ModelRunner(config)
        if backend == "triton":
            assert runner.model.attention is kernels.attention_module
        if backend == "perturbed":  # control: a 10% softmax-scale error must change the tokens
            torch_ref = runner.model.attention
            runner.model.attention = SimpleNamespace(
                write_kv_cache=torch_ref.write_kv_cache,
                paged_attention=lambda *args: torch_ref.paged_attention(*args[:-1], 0.9 * args[-1]),
            )
        tokens[backend] = kc.greedy_generate(runner, prompts, max_tokens=8, chunk_size=16)
    assert tokens["triton"] == tokens["torch"]
    assert tokens["perturbed"] != tokens["torch"], "greedy tokens do not depend on attention: the check is vacuous"


def test_runner_greedy_triton_equals_torch_with_attention_variants(kernels, tmp_path, monkeypatch):
    """The same with a window and a soft-cap on one layer and a window and sinks on the other
    (LayerWeights' fields, set as the loader builds the model): the model hands them to the
    interpreted Triton kernel and to the torch reference alike, and they change the tokens."""
    model_runner = pytest.importorskip("workers.model_runner", reason="workers.model_runner is not importable")
    model_dir = tmp_path / "tiny-llama"
    kc.write_tiny_llama(model_dir)
    monkeypatch.setitem(sys.modules, "workers.kernels.triton_attention", kernels.attention_module)
    prompts = kc.e2e_prompts()
    tokens = {}
    for name in ("plain", "torch", "triton"):
        if name == "torch":
            kc.load_models_with_variants(monkeypatch)
        config = model_runner.RunnerConfig(model=str(model_dir), dtype="float32", layer_ops="torch", block_size=16,
                                           num_blocks=64, attention_backend="torch" if name == "plain" else name)
        runner = model_runner.ModelRunner(config)
        assert (runner.model.layers[1].sinks is not None) == (name != "plain")
        tokens[name] = kc.greedy_generate(runner, prompts, max_tokens=8, chunk_size=16)
    assert tokens["triton"] == tokens["torch"]
    assert tokens["torch"] != tokens["plain"], "the variants changed no token: the check is vacuous"


@pytest.mark.parametrize("family", sorted(SERVED_FAMILIES))
def test_every_family_greedy_through_triton_equals_torch(kernels, tmp_path, monkeypatch, family):
    """Each family's tiny checkpoint (tests/families_catalog.py) generates the same greedy tokens
    with the interpreted Triton attention as with the torch reference (torch ops and products
    both times, as on a GPU), prompts running past the families' windows in chunks."""
    model_runner = pytest.importorskip("workers.model_runner", reason="workers.model_runner is not importable")
    model_dir = build_tiny_model_dir(tmp_path / family, **SERVED_FAMILIES[family])
    monkeypatch.setitem(sys.modules, "workers.kernels.triton_attention", kernels.attention_module)
    vocab_size = model_runner.ModelConfig.from_model_dir(model_dir).vocab_size
    prompts = kc.e2e_prompts(vocab_size=vocab_size)
    assert max(map(len, prompts)) > max(traits.get("sliding_window", 0) for traits in SERVED_FAMILIES.values())
    tokens = {}
    for name in ("torch", "triton"):
        config = model_runner.RunnerConfig(model=str(model_dir), dtype="float32", attention_backend=name,
                                           layer_ops="torch", linear_backend="torch", block_size=16, num_blocks=64)
        runner = model_runner.ModelRunner(config)
        # latent attention (deepseek_v3) runs on the torch reference whatever backend is asked (workers/mla.py)
        triton = name == "triton" and runner.model_config.traits.mla is None
        assert (runner.model.attention is kernels.attention_module) == triton
        tokens[name] = kc.greedy_generate(runner, prompts, max_tokens=6, chunk_size=16)
    assert tokens["triton"] == tokens["torch"]


# ----------------------------------------------------------------------------- CUDA compilation


def test_kernels_compile_for_cuda_targets():
    """The real launchers' arguments, specialized as on a CUDA launch, compile down to cubins for
    sm_80 and sm_90 (tests/gpu/cuda_compile.py, in a child process without TRITON_INTERPRET,
    with the ptxas in the triton wheel). Nothing runs: this proves the kernels compile, not
    that they are right on a GPU."""
    if not IN_PROCESS:
        pytest.skip(NOT_IN_PROCESS_REASON)
    repo = Path(__file__).resolve().parents[2]
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(repo), env.get("PYTHONPATH")]))
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # triton 3.9 warns when unset; 1 is its current default
    child = subprocess.run(
        [sys.executable, str(repo / "tests" / "gpu" / "cuda_compile.py")],
        env=env, cwd=repo, capture_output=True, text=True, timeout=600,
    )
    if child.returncode == 2:
        pytest.skip(child.stdout.strip())
    assert child.returncode == 0, f"{child.stdout}\n{child.stderr[-3000:]}"
    print(child.stdout)


# ----------------------------------------------------------------------------- big grid (-m big)


def _random_specs(rng: random.Random) -> list[tuple[int, int]]:
    specs = []
    for _ in range(rng.randint(1, 8)):
        kind = rng.choice(["prefill", "chunk", "decode"])
        context_len = 0 if kind == "prefill" else rng.randint(1, 130)
        specs.append((context_len, 1 if kind == "decode" else rng.randint(1, 70)))
    return specs


@pytest.mark.big
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("gqa", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("head_dim", [64, 80, 128])
@pytest.mark.parametrize("block_size", [16, 32, 64])
def test_paged_attention_big_grid(kernels, bf16_dot, block_size, head_dim, gqa, dtype):
    rng = random.Random(f"{block_size}-{head_dim}-{gqa}-{dtype}")
    for seed in range(3):
        specs = _random_specs(rng)
        _check_attention(kernels, specs, block_size=block_size, head_dim=head_dim, gqa=gqa, dtype=dtype, seed=seed)
