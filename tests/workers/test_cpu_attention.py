"""Our C paged-attention kernel (workers/kernels/cpu_attention.py, csrc/paged_attention.c)
against the float64 dense oracle (tests/kernel_cases.py) and the torch reference backend.

kernel_cases builds a pool in the standard layout with each sequence's prefix in it; the
tests copy it into the kernel's own layout (from_standard_layout), write the step's keys and
values with the kernel's write_kv_cache, and attend. The pool is filled with NaN outside the
slots a sequence owns: a kernel that lets one slot it should not see (past a sequence's last
key, another sequence's block, the null block) into its output returns NaN. With a sliding
window, the blocks of a sequence wholly before its windows are NaN too (the kernel must not
read them at all). head_dim 64 and
128 run the AVX-512 path on CPUs that have it, and in fp32 the AVX2 path on CPUs with AVX2 but
no AVX-512; other head dims (and bf16 without AVX-512) run the portable C path on every CPU, so
the fast path and the portable one are both checked on either kind of CPU.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import kernel_cases as kc  # tests/kernel_cases.py (tests/ is on sys.path via tests/conftest.py)
from workers.kernels import bind_attention, cpu_attention, get_attention_backend, resolve_attention_backend_name, torch_ref
from workers.kernels.cpu_isa import cpu_plan, using_plan, without_tiles
from workers.kernels.native import NativeBuildError, native_library

try:
    native_library()
except NativeBuildError as error:  # no C compiler: the runner falls back to torch (tested below)
    pytest.skip(f"the C kernels do not build here: {error}", allow_module_level=True)

SPECS = {
    "mixed": kc.MIXED_SPECS,
    "decode": kc.DECODE_SPECS,
    "prefill": kc.PREFILL_SPECS,
    # a query tile of 7+ queries whose first rows end before the chunk's last key, a long
    # context over many blocks, and a decode whose only key is its own
    "long": [(130, 23), (257, 1), (0, 1), (64, 64)],
}


def _attend(batch: kc.PagedBatch, q: torch.Tensor | None = None, **variants) -> torch.Tensor:
    """The step on our kernel: the batch's pool in its layout, this step's k/v written, attention."""
    k_cache, v_cache = cpu_attention.from_standard_layout(batch.k_cache, batch.v_cache)
    cpu_attention.write_kv_cache(batch.k_new, batch.v_new, k_cache, v_cache, batch.slot_mapping)
    return cpu_attention.paged_attention(batch.q if q is None else q, k_cache, v_cache, batch.block_tables,
                                         batch.query_start_loc, batch.seq_lens, batch.scale, **variants)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("head_dim", [64, 128, 32], ids=["d64", "d128", "d32-portable"])
@pytest.mark.parametrize("block_size,gqa", [(16, 3), (4, 1), (32, 4)])
@pytest.mark.parametrize("case", sorted(SPECS))
def test_matches_dense_oracle_and_torch_reference(case, block_size, gqa, head_dim, dtype):
    shape = dict(block_size=block_size, num_kv_heads=3, num_queries_per_kv=gqa, head_dim=head_dim, dtype=dtype,
                 seed=block_size + gqa)
    batch = kc.make_batch(SPECS[case], **shape)
    out = _attend(batch)
    assert out.dtype == dtype and out.shape == batch.q.shape
    assert not out.isnan().any(), "read a slot outside the sequence's keys"
    assert kc.max_abs_err(out, kc.naive_attention(batch)) <= kc.ATOL[dtype]
    # the torch reference reads whole blocks (masked), so it needs finite garbage outside the
    # sequences' slots; on that pool both backends agree to within the same bound
    garbage = kc.make_batch(SPECS[case], **shape, fill="garbage")
    out = _attend(garbage)
    torch_ref.write_kv_cache(garbage.k_new, garbage.v_new, garbage.k_cache, garbage.v_cache, garbage.slot_mapping)
    reference = torch_ref.paged_attention(*garbage.attention_args())
    assert (out.double() - reference.double()).abs().max().item() <= kc.ATOL[dtype]


def _half_pool_attend(batch: kc.PagedBatch, **variants) -> torch.Tensor:
    """The step over an fp16 pool under fp32 queries: the prefix copied in as half, this step's
    fp32 keys and values rounded to half by the kernel's write. On the vector bodies: where the
    CPU has AMX tiles, prompts over a half pool run there instead, in bf16 (test_amx.py)."""
    k_cache, v_cache = cpu_attention.from_standard_layout(batch.k_cache.half(), batch.v_cache.half())
    cpu_attention.write_kv_cache(batch.k_new, batch.v_new, k_cache, v_cache, batch.slot_mapping)
    assert k_cache.dtype == torch.float16
    with using_plan(without_tiles(cpu_plan())):
        return cpu_attention.paged_attention(batch.q, k_cache, v_cache, batch.block_tables, batch.query_start_loc,
                                             batch.seq_lens, batch.scale, **variants)


def _rounded_to_half(batch: kc.PagedBatch) -> kc.PagedBatch:
    """The fp32 batch with its keys and values (pool and this step's) rounded to fp16 and back."""
    half = lambda x: x.half().float()  # noqa: E731
    return dataclasses.replace(batch, k_new=half(batch.k_new), v_new=half(batch.v_new), k_cache=half(batch.k_cache),
                               v_cache=half(batch.v_cache), dense_k=[half(k) for k in batch.dense_k],
                               dense_v=[half(v) for v in batch.dense_v])


@pytest.mark.parametrize("head_dim", [64, 128, 32], ids=["d64", "d128", "d32-portable"])
@pytest.mark.parametrize("block_size,gqa", [(16, 3), (4, 1), (32, 4)])
@pytest.mark.parametrize("case", sorted(SPECS))
def test_a_half_pool_equals_fp32_attention_over_the_rounded_keys(case, block_size, gqa, head_dim):
    """fp32 queries over an fp16 pool: the kernel widens each key and value exactly as it loads
    it, so where both pools take the same SIMD body (head dims 64 and 128, blocks of a multiple
    of 16: the AVX2 body's half loads read a chunk's 16 key slots whole) the output is the fp32
    kernel's, bit for bit, on keys and values rounded to half; elsewhere (the portable body,
    which the compiler may vectorise differently for each dtype) within fp32's rounding. It is
    within fp16's rounding of the oracle on the unrounded ones. The NaN outside each
    sequence's slots checks that no slot it must not see reaches the output."""
    batch = kc.make_batch(SPECS[case], block_size=block_size, num_kv_heads=3, num_queries_per_kv=gqa,
                          head_dim=head_dim, dtype=torch.float32, seed=block_size + gqa)
    out = _half_pool_attend(batch)
    assert out.dtype == torch.float32 and not out.isnan().any(), "read a slot outside the sequence's keys"
    rounded = _rounded_to_half(batch)
    if head_dim in (64, 128) and block_size % 16 == 0:
        assert torch.equal(out, _attend(rounded))
    assert kc.max_abs_err(out, _attend(rounded)) <= kc.ATOL[torch.float32]
    assert kc.max_abs_err(out, kc.naive_attention(rounded)) <= kc.ATOL[torch.float32]
    assert kc.max_abs_err(out, kc.naive_attention(batch)) <= kc.ATOL[torch.float16]


@pytest.mark.parametrize("variant", ["window7", "softcap", "sinks", "window-sinks"])
def test_a_half_pool_takes_the_variants(variant):
    batch = kc.make_batch(kc.MIXED_SPECS, block_size=16, num_kv_heads=3, num_queries_per_kv=3, head_dim=64,
                          dtype=torch.float32, seed=7)
    kwargs = kc.variant_kwargs(variant, batch.q.shape[1])
    out = _half_pool_attend(batch, **kwargs)
    assert torch.equal(out, _attend(_rounded_to_half(batch), **kwargs))


def test_a_half_pool_is_refused_under_bf16_queries_and_write_rounds_to_nearest_even():
    assert cpu_attention.supports(9, 3, 64, 16, torch.float32, torch.float16)
    assert not cpu_attention.supports(9, 3, 64, 16, torch.bfloat16, torch.float16)
    assert not cpu_attention.supports(9, 3, 64, 16, torch.float32, torch.bfloat16)
    k_cache, v_cache = cpu_attention.allocate_kv_cache(3, 16, 2, 64, torch.float16)
    k = torch.randn(5, 2, 64) * torch.logspace(-9, 5, 64)  # from half's subnormals to past its largest, 65504
    v = -k
    slots = torch.tensor([16, 17, 40, 3, 47])
    cpu_attention.write_kv_cache(k, v, k_cache, v_cache, slots)
    k_std = torch.zeros(3, 16, 2, 64, dtype=torch.float16)
    v_std = torch.zeros_like(k_std)
    torch_ref.write_kv_cache(k.half(), v.half(), k_std, v_std, slots)  # torch's rounding: nearest even, inf past
    expected_k, expected_v = cpu_attention.from_standard_layout(k_std, v_std)
    assert torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v)
    assert k_cache.isinf().any()  # the largest inputs overflowed half, as torch's .half() makes them


def test_strided_queries_and_two_threads():
    """q as the runner passes it (a view into the fused q/k projection, rows strided) and
    tasks spread over two OpenMP threads give the same result as one thread on a copy."""
    batch = kc.make_batch(kc.MIXED_SPECS, block_size=16, num_kv_heads=3, num_queries_per_kv=3, head_dim=64,
                          dtype=torch.float32, fill="garbage")
    num_tokens, num_heads, head_dim = batch.q.shape
    fused = torch.randn(num_tokens, num_heads + 3, head_dim)
    fused[:, :num_heads] = batch.q
    strided_q = fused[:, :num_heads]
    assert not strided_q.is_contiguous()
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = _attend(batch, batch.q.contiguous())
        torch.set_num_threads(2)
        two = _attend(batch, strided_q)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("head_dim", [64, 32], ids=["d64", "d32-portable"])
@pytest.mark.parametrize("spec", [(150, 1), (0, 5)], ids=["decode", "prefill"])
def test_a_lone_sequence_split_by_kv_head_equals_one_task(spec, head_dim, dtype):
    """With two threads and one (sequence, query tile) task, the kernel makes a task per kv
    head; every row is computed as in the one task of one thread, so the outputs are equal bit
    for bit (a sequence's attention is the same alone and in a batch), and match the oracle."""
    batch = kc.make_batch([spec], block_size=16, num_kv_heads=3, num_queries_per_kv=3, head_dim=head_dim,
                          dtype=dtype)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = _attend(batch)
        torch.set_num_threads(2)
        split = _attend(batch)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, split)
    assert kc.max_abs_err(split, kc.naive_attention(batch)) <= kc.ATOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_layout_round_trip_and_write(dtype):
    """write_kv_cache puts each token's k and v where from_standard_layout puts the same slot."""
    num_blocks, block_size, num_kv_heads, head_dim = 5, 8, 3, 64
    k_std = torch.zeros(num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype)
    v_std = torch.zeros_like(k_std)
    slots = torch.tensor([8, 9, 17, 39, 20])
    k_new = torch.randn(len(slots), num_kv_heads, head_dim).to(dtype)
    v_new = torch.randn(len(slots), num_kv_heads, head_dim).to(dtype)
    torch_ref.write_kv_cache(k_new, v_new, k_std, v_std, slots)
    expected_k, expected_v = cpu_attention.from_standard_layout(k_std, v_std)
    k_cache, v_cache = cpu_attention.allocate_kv_cache(num_blocks, block_size, num_kv_heads, head_dim, dtype)
    cpu_attention.write_kv_cache(k_new, v_new, k_cache, v_cache, slots)
    assert torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v)
    assert k_cache.untyped_storage().data_ptr() == v_cache.untyped_storage().data_ptr()  # one pool: K, V adjacent


def test_backend_resolution_on_cpu():
    assert resolve_attention_backend_name(None, "cpu") == "cpu"
    assert resolve_attention_backend_name(None, "cpu", torch.bfloat16, (9, 3, 64)) == "cpu"
    assert resolve_attention_backend_name(None, "cpu", torch.float16) == "torch"  # no fp16 C path
    assert resolve_attention_backend_name(None, "cpu", torch.float32, (9, 3, 512)) == "torch"  # head_dim too big
    assert resolve_attention_backend_name("torch", "cpu") == "torch"
    assert get_attention_backend("cpu") is cpu_attention
    with pytest.raises(ValueError, match="head_dim <= 256"):
        resolve_attention_backend_name("cpu", "cpu", torch.float32, (9, 3, 512))


# ----------------------------------------------------------------------------- variants: window, softcap, sinks


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("head_dim", [64, 128, 32], ids=["d64", "d128", "d32-portable"])
@pytest.mark.parametrize("block_size,gqa", [(16, 3), (4, 1), (32, 4)])
@pytest.mark.parametrize("variant", list(kc.VARIANTS))
def test_variants_match_dense_oracle_and_torch_reference(variant, block_size, gqa, head_dim, dtype):
    """Each body (the SIMD one where this CPU has it, the portable one) with a window, a
    soft-cap, sinks and their mixes: prompts longer than the window, chunks after cached keys,
    decodes, GQA, windows opening mid-block and on block boundaries. Blocks wholly outside a
    sequence's windows hold NaN: a kernel that reads them returns NaN."""
    shape = dict(block_size=block_size, num_kv_heads=3, num_queries_per_kv=gqa, head_dim=head_dim, dtype=dtype,
                 seed=block_size + gqa)
    variants = kc.variant_kwargs(variant, 3 * gqa, seed=gqa)
    batch = kc.make_batch(kc.WINDOW_SPECS, **shape)
    if kc.hides_keys(variants):
        assert kc.poison_outside_windows(batch, variants.get("window"), variants.get("attention_chunk")) > 0
    out = _attend(batch, **variants)
    assert not out.isnan().any(), "read a slot outside the sequence's keys or windows"
    assert kc.max_abs_err(out, kc.naive_attention(batch, **variants)) <= kc.ATOL[dtype]
    garbage = kc.make_batch(kc.WINDOW_SPECS, **shape, fill="garbage")
    out = _attend(garbage, **variants)
    torch_ref.write_kv_cache(garbage.k_new, garbage.v_new, garbage.k_cache, garbage.v_cache, garbage.slot_mapping)
    reference = torch_ref.paged_attention(*garbage.attention_args(), **variants)
    assert (out.double() - reference.double()).abs().max().item() <= kc.ATOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("head_dim", [64, 32], ids=["d64", "d32-portable"])
@pytest.mark.parametrize("spec", [(150, 1), (40, 30)], ids=["decode", "chunk"])
def test_variants_are_the_same_on_one_thread_and_two(spec, head_dim, dtype):
    """A lone sequence on two threads (a task per kv head for its decode) computes each row as
    one thread does: the same bits, with a window, a soft-cap and sinks."""
    batch = kc.make_batch([spec], block_size=16, num_kv_heads=3, num_queries_per_kv=3, head_dim=head_dim,
                          dtype=dtype)
    variants = kc.variant_kwargs("all", 9)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = _attend(batch, **variants)
        torch.set_num_threads(2)
        two = _attend(batch, **variants)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)
    assert kc.max_abs_err(two, kc.naive_attention(batch, **variants)) <= kc.ATOL[dtype]


def test_a_bound_step_takes_each_layers_variants():
    """One bound step serves layers with different variants in turn (Gemma 2 alternates sliding
    and global layers): each call uses its own and leaves nothing to the next; sinks kept in
    bf16 by a layer are converted for the kernel."""
    batch = kc.make_batch(kc.WINDOW_SPECS, block_size=16, num_kv_heads=2, num_queries_per_kv=3, head_dim=64,
                          dtype=torch.float32)
    k_cache, v_cache = cpu_attention.from_standard_layout(batch.k_cache, batch.v_cache)
    metadata = SimpleNamespace(slot_mapping=batch.slot_mapping, block_tables=batch.block_tables,
                               query_start_loc=batch.query_start_loc, seq_lens=batch.seq_lens)
    step = bind_attention(cpu_attention, metadata, batch.scale)
    step.write(batch.k_new, batch.v_new, k_cache, v_cache)
    sinks = kc.variant_kwargs("sinks", 6)["sinks"].to(torch.bfloat16)
    layers = [dict(window=7, softcap=2.0), dict(), dict(sinks=sinks), dict(window=20, sinks=sinks), dict()]
    for variants in layers:
        out = step.attend(batch.q, k_cache, v_cache, **variants)
        exact = {**variants, "sinks": sinks.float()} if "sinks" in variants else variants
        expected = kc.naive_attention(batch, **exact)
        assert kc.max_abs_err(out, expected) <= kc.ATOL[torch.float32], variants
    with pytest.raises(ValueError, match="sinks"):
        step.attend(batch.q, k_cache, v_cache, sinks=torch.zeros(5))
    with pytest.raises(ValueError, match="window"):
        step.attend(batch.q, k_cache, v_cache, window=0)


_UNREAD_BLOCKS_CHILD = r"""
import ctypes, mmap, sys
import torch
import kernel_cases as kc
from workers.kernels import cpu_attention

hides = {sys.argv[1]: int(sys.argv[2])}  # window=W or attention_chunk=C
head_dim, dtype = int(sys.argv[3]), getattr(torch, sys.argv[4])
batch = kc.make_batch(kc.WINDOW_SPECS, block_size=16, num_kv_heads=2, num_queries_per_kv=3, head_dim=head_dim,
                      dtype=dtype)
num_blocks, block_size, num_kv_heads, _ = batch.k_cache.shape
part = num_kv_heads * head_dim * block_size  # elements of a block's K (or V) part
block_bytes = 2 * part * batch.k_cache.element_size()
assert block_bytes % mmap.PAGESIZE == 0, block_bytes
memory = mmap.mmap(-1, num_blocks * block_bytes)  # page-aligned, so every block is whole pages
pool = torch.frombuffer(memory, dtype=dtype).view(num_blocks, 2, part)
pack = 2 if dtype == torch.bfloat16 else 1
k_cache = pool[:, 0].view(num_blocks, num_kv_heads, head_dim // pack, block_size, pack)
v_cache = pool[:, 1].view(num_blocks, num_kv_heads, block_size // pack, head_dim, pack)
k_std, v_std = cpu_attention.from_standard_layout(batch.k_cache, batch.v_cache)
k_cache.copy_(k_std)
v_cache.copy_(v_std)
cpu_attention.write_kv_cache(batch.k_new, batch.v_new, k_cache, v_cache, batch.slot_mapping)
libc = ctypes.CDLL(None, use_errno=True)
libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
qsl, seq_lens, protected = batch.query_start_loc.tolist(), batch.seq_lens.tolist(), 0
for s, seq_len in enumerate(seq_lens):  # blocks wholly before the first query's window or chunk: no access at all
    first_visible = kc.first_visible_key(seq_len - (qsl[s + 1] - qsl[s]), **hides)
    for index in range(first_visible // block_size):
        address = pool.data_ptr() + int(batch.block_tables[s, index]) * block_bytes
        assert libc.mprotect(address, block_bytes, 0) == 0, ctypes.get_errno()  # PROT_NONE
        protected += 1
assert protected > 0
expected = kc.naive_attention(batch, **hides, softcap=1.5)
for threads in (1, 2):
    torch.set_num_threads(threads)
    out = cpu_attention.paged_attention(*batch.attention_args()[:1], k_cache, v_cache, *batch.attention_args()[3:],
                                        **hides, softcap=1.5)
    assert kc.max_abs_err(out, expected) <= kc.ATOL[dtype], kc.max_abs_err(out, expected)
print("ok", protected)
"""


@pytest.mark.parametrize("hides", [("window", 7), ("window", 16), ("window", 40), ("attention_chunk", 7),
                                   ("attention_chunk", 32)], ids=lambda hides: f"{hides[0]}{hides[1]}")
@pytest.mark.parametrize("head_dim,dtype", [(64, "float32"), (32, "float32"), (64, "bfloat16")],
                         ids=["d64-fp32", "d32-portable", "d64-bf16"])
def test_windowed_attention_does_not_touch_blocks_outside_the_window(hides, head_dim, dtype):
    """The blocks of each sequence wholly before its windows (or its chunks) are made unreadable
    (mprotect PROT_NONE, in a child process): the kernel neither computes with them nor streams or
    prefetches them (a read would kill the child), and its results are still right."""
    tests_dir = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tests_dir.parent), str(tests_dir)])}
    kind, size = hides
    child = subprocess.run([sys.executable, "-c", _UNREAD_BLOCKS_CHILD, kind, str(size), str(head_dim), dtype],
                           env=env, capture_output=True, text=True, timeout=300)
    assert child.returncode == 0, f"rc {child.returncode} (-11: read a protected block)\n{child.stderr[-2000:]}"
    assert child.stdout.startswith("ok")
