"""The torch reference paged attention vs a naive dense attention, on one mixed varlen batch:
a prefill with no prefix, a prefill whose prefix is already in the pool, a prefill chunk,
and decodes, with scattered (non-contiguous) block tables and GQA.

The attention variants (sliding window, soft-cap, sinks) against the float64 dense oracle of
tests/kernel_cases.py, which is itself checked against transformers' Gemma 2 and gpt-oss
attention here."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

import kernel_cases as kc  # tests/kernel_cases.py (tests/ is on sys.path via tests/conftest.py)
from workers.kernels import bind_attention, get_attention_backend, resolve_attention_backend_name, torch_ref


def naive_attention(q, keys, values, scale):
    """q: [query_len, heads, dim]; keys/values: [seq_len, kv_heads, dim] for one sequence,
    the queries being its last query_len positions. Dense, one query at a time."""
    query_len, num_heads, _ = q.shape
    seq_len, num_kv_heads, _ = keys.shape
    group = num_heads // num_kv_heads
    out = torch.empty_like(q)
    for i in range(query_len):
        position = seq_len - query_len + i
        for head in range(num_heads):
            k = keys[: position + 1, head // group]
            v = values[: position + 1, head // group]
            weights = torch.softmax((k @ q[i, head]) * scale, dim=0)
            out[i, head] = weights @ v
    return out


DECODES_LAST = [(9, 9), (5, 13), (4, 12), (1, 1), (1, 7), (1, 16), (1, 21)]
INTERLEAVED = [(1, 7), (9, 9), (1, 21), (5, 13), (1, 1), (4, 12), (1, 16)]
SIMILAR_PREFILLS = [(6, 10), (1, 30), (5, 11), (6, 12), (1, 29), (6, 11)]  # padded into shared SDPA calls
SHAPES = {"decodes-last": DECODES_LAST, "interleaved": INTERLEAVED, "similar-prefills": SIMILAR_PREFILLS}


def build_mixed_batch(num_heads, num_kv_heads, head_dim=16, block_size=4, num_blocks=64, seed=0,
                      shapes=DECODES_LAST):
    """(query_len, seq_len) per sequence: prefill, prefix-hit prefill, chunk, decodes."""
    generator = torch.Generator().manual_seed(seed)
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=generator)
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=generator)
    free_blocks = torch.randperm(num_blocks - 1, generator=generator) + 1  # scattered, block 0 unused
    tables, dense_keys, dense_values, cursor = [], [], [], 0
    max_blocks = max(math.ceil(seq_len / block_size) for _, seq_len in shapes)
    for _, seq_len in shapes:
        count = math.ceil(seq_len / block_size)
        blocks = free_blocks[cursor : cursor + count].tolist()
        cursor += count
        tables.append(blocks + [0] * (max_blocks - count))
        dense_keys.append(k_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:seq_len])
        dense_values.append(v_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:seq_len])
    query_lens = [query_len for query_len, _ in shapes]
    q = torch.randn(sum(query_lens), num_heads, head_dim, generator=generator)
    return dict(
        q=q, k_cache=k_cache, v_cache=v_cache,
        block_tables=torch.tensor(tables, dtype=torch.int32),
        query_start_loc=torch.tensor([0] + list(torch.tensor(query_lens).cumsum(0)), dtype=torch.int32),
        seq_lens=torch.tensor([seq_len for _, seq_len in shapes], dtype=torch.int32),
    ), dense_keys, dense_values


def assert_matches_naive(shapes, num_heads, num_kv_heads):
    inputs, dense_keys, dense_values = build_mixed_batch(num_heads, num_kv_heads, shapes=shapes)
    scale = 16**-0.5
    out = torch_ref.paged_attention(scale=scale, **inputs)
    starts = inputs["query_start_loc"].tolist()
    for s, (keys, values) in enumerate(zip(dense_keys, dense_values)):
        q = inputs["q"][starts[s] : starts[s + 1]]
        expected = naive_attention(q, keys, values, scale)
        torch.testing.assert_close(out[starts[s] : starts[s + 1]], expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("shapes", list(SHAPES.values()), ids=list(SHAPES))
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (4, 2), (6, 2), (3, 1)])
def test_paged_attention_matches_naive_on_mixed_batch(num_heads, num_kv_heads, shapes):
    assert_matches_naive(shapes, num_heads, num_kv_heads)


def test_grouping_pads_similar_pieces_and_splits_long_queries(monkeypatch):
    inputs, _, _ = build_mixed_batch(4, 2, shapes=SIMILAR_PREFILLS)
    plan = torch_ref.build_plan(inputs["block_tables"], inputs["query_start_loc"], inputs["seq_lens"], 4)
    assert len(plan.groups) < len(SIMILAR_PREFILLS)  # fewer SDPA calls than sequences
    assert any(group.real_queries is not None for group in plan.groups)  # some padding was used
    # long queries cut into pieces, and groups capped in area: same results
    monkeypatch.setattr(torch_ref, "MAX_PIECE_QUERIES", 3)
    monkeypatch.setattr(torch_ref, "MAX_GROUP_AREA", 40)
    plan = torch_ref.build_plan(inputs["block_tables"], inputs["query_start_loc"], inputs["seq_lens"], 4)
    assert max(group.query_len for group in plan.groups) == 3
    for shapes in SHAPES.values():
        assert_matches_naive(shapes, 4, 2)


def test_plan_is_rebuilt_when_metadata_changes_in_place():
    inputs, dense_keys, dense_values = build_mixed_batch(4, 2)
    scale = 0.25
    torch_ref.paged_attention(scale=scale, **inputs)
    # same tensor objects, new contents: the cached plan must not be reused
    inputs["seq_lens"][-1] -= 1
    out = torch_ref.paged_attention(scale=scale, **inputs)
    last = inputs["q"][-1:]
    expected = naive_attention(last, dense_keys[-1][:-1], dense_values[-1][:-1], scale)
    torch.testing.assert_close(out[-1:], expected, atol=1e-5, rtol=1e-5)


def test_inference_mode_metadata_works_without_plan_cache():
    with torch.inference_mode():
        inputs, dense_keys, dense_values = build_mixed_batch(4, 2, seed=1)
        out = torch_ref.paged_attention(scale=0.25, **inputs)
        inputs["seq_lens"][-1] -= 1  # in-place change of an inference tensor: no version counter to see it
        again = torch_ref.paged_attention(scale=0.25, **inputs)
    expected = naive_attention(inputs["q"][-1:], dense_keys[-1][:-1], dense_values[-1][:-1], 0.25)
    torch.testing.assert_close(again[-1:], expected, atol=1e-5, rtol=1e-5)
    assert not torch.equal(out[-1:], again[-1:])


def test_write_kv_cache_writes_each_token_to_its_slot():
    block_size, num_kv_heads, head_dim = 4, 2, 8
    k_cache = torch.zeros(8, block_size, num_kv_heads, head_dim)
    v_cache = torch.zeros_like(k_cache)
    k = torch.randn(5, num_kv_heads, head_dim)
    v = torch.randn(5, num_kv_heads, head_dim)
    slots = torch.tensor([3 * 4 + 2, 3 * 4 + 3, 6 * 4 + 0, 1 * 4 + 1, 7 * 4 + 3])
    torch_ref.write_kv_cache(k, v, k_cache, v_cache, slots)
    for token, slot in enumerate(slots.tolist()):
        assert torch.equal(k_cache[slot // block_size, slot % block_size], k[token])
        assert torch.equal(v_cache[slot // block_size, slot % block_size], v[token])
    assert int((k_cache != 0).any(dim=(2, 3)).sum()) == 5  # nothing else written
    assert not k_cache[0].any()  # the null block stays untouched


def test_backend_selector(monkeypatch):
    assert get_attention_backend("torch") is torch_ref
    with pytest.raises(ValueError, match="unknown attention backend"):
        get_attention_backend("flash")
    # without a C compiler the CPU default is the torch reference
    monkeypatch.setattr("workers.kernels.native.native_available", lambda: False)
    assert resolve_attention_backend_name(None, "cpu") == "torch"
    assert resolve_attention_backend_name(None, "cuda") == "triton"
    assert resolve_attention_backend_name("torch", "cuda") == "torch"


# ----------------------------------------------------------------------------- variants: window, softcap, sinks


def test_dense_oracle_is_transformers_attention():
    """kernel_cases.naive_attention, the oracle of every backend's variants, is transformers'
    own maths: Gemma 2's eager attention (soft-cap) and gpt-oss's (sinks), each over the mask
    transformers builds with sliding_window_causal_mask_function (or the causal one), and Llama 4's
    over chunked_causal_mask_function's, for a chunk of queries after cached keys (positions
    37..56), in float64."""
    from transformers.masking_utils import (causal_mask_function, chunked_causal_mask_function, eager_mask,
                                            sliding_window_causal_mask_function)
    from transformers.models.gemma2.modeling_gemma2 import eager_attention_forward as gemma2_attention
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward as gpt_oss_attention
    from transformers.models.llama4.modeling_llama4 import eager_attention_forward as llama4_attention

    context_len, query_len, window, softcap = 37, 20, 9, 1.5
    batch = kc.make_batch([(context_len, query_len)], block_size=16, num_kv_heads=2, num_queries_per_kv=3,
                          head_dim=32, dtype=torch.float64)
    sinks = kc.variant_kwargs("sinks", 6)["sinks"].double()
    q = batch.q.transpose(0, 1).unsqueeze(0)  # [1, heads, queries, dim]
    k, v = (x.transpose(0, 1).unsqueeze(0) for x in (batch.dense_k[0], batch.dense_v[0]))  # [1, kv_heads, keys, dim]
    module = SimpleNamespace(num_key_value_groups=3, head_dim=32, training=False, sinks=sinks)

    def mask(function):
        return eager_mask(batch_size=1, q_length=query_len, kv_length=context_len + query_len, q_offset=context_len,
                          mask_function=function, dtype=torch.float64)

    sliding = mask(sliding_window_causal_mask_function(window))
    assert int((sliding[0, 0, -1] == 0).sum()) == window  # the last query sees exactly `window` keys
    chunked = mask(chunked_causal_mask_function(8, torch.zeros(1, dtype=torch.long)))
    assert int((chunked[0, 0, -1] == 0).sum()) == 56 % 8 + 1  # position 56 sees its chunk's 48..56
    cases = [
        (gemma2_attention(module, q, k, v, sliding, scaling=batch.scale, softcap=softcap)[0],
         dict(window=window, softcap=softcap), 1e-6),  # Gemma 2 takes its softmax in fp32
        (gpt_oss_attention(module, q, k, v, sliding, scaling=batch.scale)[0], dict(window=window, sinks=sinks), 1e-12),
        (gpt_oss_attention(module, q, k, v, mask(causal_mask_function), scaling=batch.scale)[0], dict(sinks=sinks),
         1e-12),
        (llama4_attention(module, q, k, v, chunked, scaling=batch.scale)[0], dict(attention_chunk=8), 1e-12),
    ]
    for expected, kwargs, atol in cases:
        ours = kc.naive_attention(batch, **kwargs)
        torch.testing.assert_close(ours, expected[0], atol=atol, rtol=0)
        assert kc.max_abs_err(ours, kc.naive_attention(batch)) > 0.05, f"{sorted(kwargs)} changed nothing"


@pytest.mark.parametrize("variant", list(kc.VARIANTS))
def test_each_variant_changes_the_oracle(variant):
    """Every variant the backends are tested with moves the output well past the tolerances
    (so no backend passes those tests by ignoring it)."""
    batch = kc.make_batch(kc.WINDOW_SPECS, block_size=16, num_kv_heads=2, num_queries_per_kv=3, head_dim=32,
                          dtype=torch.float32)
    changed = kc.max_abs_err(kc.naive_attention(batch, **kc.variant_kwargs(variant, 6)), kc.naive_attention(batch))
    assert changed > 10 * kc.ATOL[torch.bfloat16], changed


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (6, 2), (3, 1)])
@pytest.mark.parametrize("variant", list(kc.VARIANTS))
def test_variants_match_dense_oracle(variant, num_heads, num_kv_heads, block_size, dtype):
    """Prompts longer than the window, chunks after cached keys, decodes, GQA, windows starting
    mid-block and on block boundaries; finite garbage in every slot no sequence owns."""
    batch = kc.make_batch(kc.WINDOW_SPECS, block_size=block_size, num_kv_heads=num_kv_heads,
                          num_queries_per_kv=num_heads // num_kv_heads, head_dim=32, dtype=dtype, fill="garbage")
    kwargs = kc.variant_kwargs(variant, num_heads)
    torch_ref.write_kv_cache(batch.k_new, batch.v_new, batch.k_cache, batch.v_cache, batch.slot_mapping)
    out = torch_ref.paged_attention(*batch.attention_args(), **kwargs)
    assert out.dtype == dtype
    assert kc.max_abs_err(out, kc.naive_attention(batch, **kwargs)) <= kc.ATOL[dtype]


def test_one_plan_serves_layers_with_and_without_variants(monkeypatch):
    """Layers of a step share a plan: alternating sliding and global layers (Gemma 2), each
    right, with queries cut into pieces that start mid-sequence; a mask per window, kept."""
    monkeypatch.setattr(torch_ref, "MAX_PIECE_QUERIES", 7)
    batch = kc.make_batch(kc.WINDOW_SPECS, block_size=16, num_kv_heads=2, num_queries_per_kv=2, head_dim=32,
                          dtype=torch.float32, fill="garbage")
    torch_ref.write_kv_cache(batch.k_new, batch.v_new, batch.k_cache, batch.v_cache, batch.slot_mapping)
    sinks = kc.variant_kwargs("sinks", 4)["sinks"]
    layers = [dict(window=7), dict(), dict(window=7, softcap=2.0), dict(sinks=sinks), dict(window=40, sinks=sinks),
              dict(attention_chunk=7), dict(window=7)]
    for kwargs in layers:
        out = torch_ref.paged_attention(*batch.attention_args(), **kwargs)
        assert kc.max_abs_err(out, kc.naive_attention(batch, **kwargs)) <= kc.ATOL[torch.float32], kwargs
    plan = torch_ref._last_plan[1]
    assert {key[:2] for group in plan.groups for key in group.masks} == {(None, None), (7, None), (40, None), (None, 7)}


@pytest.mark.parametrize("kwargs", [dict(window=0), dict(window=-3), dict(window=2.5), dict(window=True),
                                    dict(attention_chunk=0), dict(attention_chunk=8.0),
                                    dict(softcap=0.0), dict(softcap=-1.0), dict(sinks=torch.zeros(3)),
                                    dict(sinks=torch.zeros(4, 1))], ids=str)
def test_bad_variants_are_refused(kwargs):
    batch = kc.make_batch([(3, 2)], block_size=16, num_kv_heads=2, num_queries_per_kv=2, head_dim=32,
                          dtype=torch.float32, fill="garbage")
    with pytest.raises(ValueError):
        torch_ref.paged_attention(*batch.attention_args(), **kwargs)


def test_bound_step_passes_only_the_variants_a_layer_has():
    """bind_attention's default step calls a backend exactly as before for a plain layer (a
    backend without the keywords keeps working) and passes a layer's variants through."""
    calls = []
    backend = SimpleNamespace(paged_attention=lambda *args, **kwargs: calls.append(kwargs) or args[0],
                              write_kv_cache=lambda *args: None)
    metadata = SimpleNamespace(slot_mapping=None, block_tables=None, query_start_loc=None, seq_lens=None)
    step = bind_attention(backend, metadata, 0.5)
    sinks = torch.zeros(4)
    step.attend(torch.zeros(1), None, None)
    step.attend(torch.zeros(1), None, None, window=8, softcap=None, sinks=sinks)
    step.attend(torch.zeros(1), None, None, softcap=30.0)
    assert calls == [{}, dict(window=8, sinks=sinks), dict(softcap=30.0)]
