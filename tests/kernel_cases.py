"""Shared by tests/workers/test_triton_kernels.py (Triton interpreter, CPU) and
tests/gpu/test_gpu.py (compiled Triton, CUDA): builds paged varlen batches and computes a
naive dense attention oracle that never reads the paged pool.

Not a test module (pytest collects only test_*.py). The tests/ folders are not packages, so
both test modules load it by file path under the module name `kernel_cases`.

A batch is a list of (context_len, query_len) per sequence:

    seq s:  [ cached prefix: context_len | new queries: query_len ]   seq_len = sum
            (already in the pool)          (written by write_kv_cache this step)

(0, n) is a prefill without prefix, (c, n) with c > 0 a prefill chunk after a prefix hit or
an earlier chunk, (c, 1) a decode.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Mixed batch used across the grid: prefills without prefix (one spans pages and q tiles),
# chunks after a prefix (one prefix ends exactly on a 16-token page boundary, one query chunk
# spans several q tiles), and decodes (one with a 0-token prefix: a 1-token prompt).
MIXED_SPECS: list[tuple[int, int]] = [(0, 19), (21, 7), (37, 1), (0, 1), (3, 1), (16, 16), (45, 40)]
DECODE_SPECS: list[tuple[int, int]] = [(1, 1), (15, 1), (16, 1), (33, 1), (70, 1)]
PREFILL_SPECS: list[tuple[int, int]] = [(0, 33), (0, 5), (0, 64)]

# For the attention variants (window, softcap, sinks, chunk), with block_size 16: prompts longer than
# the windows and chunks below, chunks after cached keys (one window starting mid-block, one chunk starting
# on a block boundary), decodes far past their window, at position 0 and on a block's last slot.
WINDOW_SPECS: list[tuple[int, int]] = [(0, 45), (37, 20), (70, 1), (15, 1), (16, 1), (0, 1), (31, 17), (100, 33),
                                       (48, 16)]

# name -> a layer's variants (naive_attention's keywords); sinks=True: make_sinks per case
VARIANTS: dict[str, dict] = {
    "window1": dict(window=1),  # a query sees only its own key
    "window7": dict(window=7),  # not a multiple of any block size
    "window16": dict(window=16),  # exactly a block
    "window40": dict(window=40),  # several blocks
    "softcap": dict(softcap=1.5),  # tanh well away from linear for scores ~ N(0, 1)
    "sinks": dict(sinks=True),
    "window-softcap": dict(window=20, softcap=1.5),  # Gemma 2's sliding layers
    "window-sinks": dict(window=20, sinks=True),  # gpt-oss's sliding layers
    "all": dict(window=9, softcap=2.0, sinks=True),
    "chunk7": dict(attention_chunk=7),  # Llama 4's chunked layers: chunks not a multiple of any block size
    "chunk32": dict(attention_chunk=32),  # chunks of whole blocks (16), every boundary a block's
}


def variant_kwargs(name: str, num_heads: int, *, device: str | torch.device = "cpu", seed: int = 0) -> dict:
    """VARIANTS[name] with its sinks made: ~N(1, 2) per head, so some heads' sinks outweigh
    every key (and some weigh little)."""
    kwargs = dict(VARIANTS[name])
    if kwargs.get("sinks"):
        gen = torch.Generator().manual_seed(1000 + seed)
        kwargs["sinks"] = (1 + 2 * torch.randn(num_heads, generator=gen)).to(device)
    return kwargs


def first_visible_key(position: int, window: int | None = None, attention_chunk: int | None = None) -> int:
    """The first key a query at `position` sees: 0, its window's first, or its chunk's first."""
    first = 0 if window is None else max(position - window + 1, 0)
    return first if attention_chunk is None else max(first, position // attention_chunk * attention_chunk)


def hides_keys(variants: dict) -> bool:
    """Whether the variants hide keys before a query's own (a window or a chunk)."""
    return "window" in variants or "attention_chunk" in variants


def poison_outside_windows(batch: PagedBatch, window: int | None = None, attention_chunk: int | None = None) -> int:
    """Fills with NaN each pool block of a sequence that lies wholly before the window (or the
    chunk) of the step's first query of that sequence (so of every query): a kernel that reads
    any of them returns NaN. dense_k/dense_v keep the real keys for the oracle. Returns how many
    blocks."""
    block_size = batch.k_cache.shape[1]
    qsl, seq_lens = batch.query_start_loc.tolist(), batch.seq_lens.tolist()
    poisoned = 0
    for s, seq_len in enumerate(seq_lens):
        first_visible = first_visible_key(seq_len - (qsl[s + 1] - qsl[s]), window, attention_chunk)  # first query's
        for index in range(first_visible // block_size):  # blocks ending at or before it
            block = int(batch.block_tables[s, index])
            batch.k_cache[block] = float("nan")
            batch.v_cache[block] = float("nan")
            poisoned += 1
    return poisoned


# Max abs error of the kernel against the float64 oracle, per dtype. fp32 uses IEEE dots, so
# only summation order differs (measured ~1e-6). For 16-bit inputs the output itself is
# rounded to the dtype (half an ulp at |o| ~ 1 is 5e-4 for fp16, 4e-3 for bf16) and the
# softmax weights are rounded to the dtype before the P @ V dot, as in flash attention.
ATOL: dict[torch.dtype, float] = {torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}


@dataclass
class PagedBatch:
    q: torch.Tensor  # [num_tokens, num_heads, head_dim]
    k_new: torch.Tensor  # [num_tokens, num_kv_heads, head_dim]: this step's keys
    v_new: torch.Tensor  # [num_tokens, num_kv_heads, head_dim]
    k_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim]: prefix written, rest NaN
    v_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor  # [num_tokens] int64: where k_new/v_new go
    block_tables: torch.Tensor  # [num_seqs, max_blocks_per_seq] int32, padded with block 0
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32
    seq_lens: torch.Tensor  # [num_seqs] int32
    dense_k: list[torch.Tensor]  # per seq [seq_len, num_kv_heads, head_dim]: the whole sequence's keys
    dense_v: list[torch.Tensor]  # per seq [seq_len, num_kv_heads, head_dim]
    scale: float  # softmax scale, head_dim ** -0.5

    def attention_args(self) -> tuple:
        return (self.q, self.k_cache, self.v_cache, self.block_tables, self.query_start_loc, self.seq_lens, self.scale)

    def pool_after_write(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The pool as it must look after write_kv_cache(k_new, v_new, ..., slot_mapping)."""
        k_cache, v_cache = self.k_cache.clone(), self.v_cache.clone()
        num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
        k_cache.view(num_blocks * block_size, num_kv_heads, head_dim)[self.slot_mapping] = self.k_new
        v_cache.view(num_blocks * block_size, num_kv_heads, head_dim)[self.slot_mapping] = self.v_new
        return k_cache, v_cache


def make_batch(
    specs: list[tuple[int, int]],
    *,
    block_size: int,
    num_kv_heads: int,
    num_queries_per_kv: int,
    head_dim: int,
    dtype: torch.dtype,
    device: str | torch.device = "cpu",
    seed: int = 0,
    extra_blocks: int = 3,
    fill: str = "nan",
) -> PagedBatch:
    """Random q/k/v for `specs`, each sequence on shuffled (non-contiguous) physical blocks,
    block 0 reserved as the null block; only the prefixes are in the pool. Every other slot
    holds `fill`: "nan" (any read of a slot the kernel should not see poisons the output) or
    "garbage" (finite random values, for backends that read masked slots and rely on masking)."""
    gen = torch.Generator().manual_seed(seed)
    num_heads = num_kv_heads * num_queries_per_kv
    blocks_per_seq = [-(-(c + n) // block_size) for c, n in specs]
    num_blocks = 1 + sum(blocks_per_seq) + extra_blocks
    physical = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    pool_shape = (num_blocks, block_size, num_kv_heads, head_dim)
    if fill == "nan":
        k_cache = torch.full(pool_shape, float("nan"), dtype=dtype)
        v_cache = torch.full(pool_shape, float("nan"), dtype=dtype)
    else:
        assert fill == "garbage", fill
        k_cache = (100 * torch.randn(pool_shape, generator=gen)).to(dtype)
        v_cache = (100 * torch.randn(pool_shape, generator=gen)).to(dtype)
    flat_k = k_cache.view(-1, num_kv_heads, head_dim)
    flat_v = v_cache.view(-1, num_kv_heads, head_dim)
    block_tables = torch.zeros(len(specs), max(blocks_per_seq + [1]), dtype=torch.int32)

    qs, k_news, v_news, slots, dense_k, dense_v = [], [], [], [], [], []
    for s, ((context_len, query_len), num_seq_blocks) in enumerate(zip(specs, blocks_per_seq)):
        seq_len = context_len + query_len
        blocks = torch.tensor(physical[:num_seq_blocks], dtype=torch.int64)
        physical = physical[num_seq_blocks:]
        block_tables[s, :num_seq_blocks] = blocks.to(torch.int32)
        pos = torch.arange(seq_len)
        seq_slots = blocks[pos // block_size] * block_size + pos % block_size
        k = torch.randn(seq_len, num_kv_heads, head_dim, generator=gen).to(dtype)
        v = torch.randn(seq_len, num_kv_heads, head_dim, generator=gen).to(dtype)
        flat_k[seq_slots[:context_len]] = k[:context_len]
        flat_v[seq_slots[:context_len]] = v[:context_len]
        qs.append(torch.randn(query_len, num_heads, head_dim, generator=gen).to(dtype))
        k_news.append(k[context_len:])
        v_news.append(v[context_len:])
        slots.append(seq_slots[context_len:])
        dense_k.append(k)
        dense_v.append(v)

    query_lens = torch.tensor([n for _, n in specs], dtype=torch.int32)
    query_start_loc = torch.zeros(len(specs) + 1, dtype=torch.int32)
    query_start_loc[1:] = torch.cumsum(query_lens, 0)
    to = lambda t: t.to(device)  # noqa: E731
    return PagedBatch(
        q=to(torch.cat(qs)),
        k_new=to(torch.cat(k_news)),
        v_new=to(torch.cat(v_news)),
        k_cache=to(k_cache),
        v_cache=to(v_cache),
        slot_mapping=to(torch.cat(slots)),
        block_tables=to(block_tables),
        query_start_loc=to(query_start_loc),
        seq_lens=to(torch.tensor([c + n for c, n in specs], dtype=torch.int32)),
        dense_k=[to(k) for k in dense_k],
        dense_v=[to(v) for v in dense_v],
        scale=head_dim**-0.5,
    )


def naive_attention(batch: PagedBatch, *, window: int | None = None, softcap: float | None = None,
                    sinks: torch.Tensor | None = None, attention_chunk: int | None = None) -> torch.Tensor:
    """[num_tokens, num_heads, head_dim] float64: per-sequence dense causal GQA softmax
    attention over the whole sequence's keys, read from dense_k/dense_v, never the pool.
    The variants as transformers computes them: window W, the query at p sees keys (p - W, p]
    (Gemma 2's sliding_window_causal_mask_function); softcap c, scores = c tanh(scores / c)
    after the scale (Gemma 2's eager attention); sinks [num_heads], one more logit per head in
    the softmax, with no value (gpt-oss's eager attention); attention_chunk C, the query at p sees
    keys [floor(p / C) * C, p], its own chunk's (Llama 4's chunked_causal_mask_function)."""
    num_heads = batch.q.shape[1]
    outs = []
    qsl = batch.query_start_loc.tolist()
    for s, (k, v) in enumerate(zip(batch.dense_k, batch.dense_v)):
        q = batch.q[qsl[s] : qsl[s + 1]].double()  # [n, H, D]
        query_len, seq_len = q.shape[0], k.shape[0]
        group = num_heads // k.shape[1]
        k = k.double().repeat_interleave(group, dim=1)  # [L, H, D]: query head h -> kv head h // group
        v = v.double().repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, k) * batch.scale
        if softcap is not None:
            scores = softcap * torch.tanh(scores / softcap)
        q_pos = seq_len - query_len + torch.arange(query_len, device=q.device)
        k_pos = torch.arange(seq_len, device=q.device)
        visible = k_pos[None, :] <= q_pos[:, None]  # [n, L]
        if window is not None:
            visible &= k_pos[None, :] > q_pos[:, None] - window
        if attention_chunk is not None:
            visible &= k_pos[None, :] // attention_chunk == q_pos[:, None] // attention_chunk
        scores = scores.masked_fill(~visible, float("-inf"))
        if sinks is not None:
            sink = sinks.double().to(q.device).view(num_heads, 1, 1).expand(num_heads, query_len, 1)
            probs = torch.cat([scores, sink], dim=-1).softmax(-1)[..., :-1]
        else:
            probs = scores.softmax(-1)
        outs.append(torch.einsum("hqk,khd->qhd", probs, v))
    return torch.cat(outs)


def max_abs_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert out.shape == ref.shape, f"{tuple(out.shape)} != {tuple(ref.shape)}"
    return (out.double() - ref.double()).abs().max().item()



# ----------------------------------------------------------------------------- end to end


def write_tiny_llama(model_dir, *, num_layers: int = 2, num_heads: int = 6, num_kv_heads: int = 2,
                     head_dim: int = 32, vocab_size: int = 256, seed: int = 0) -> None:
    """A random Llama checkpoint (config.json + model.safetensors, HF tensor names) small
    enough for the interpreter. Weights are scaled so logits are well spread: greedy ties
    between two backends that differ by float rounding are then vanishingly unlikely."""
    import json
    from pathlib import Path

    from safetensors.torch import save_file

    hidden, intermediate = num_heads * head_dim, 2 * num_heads * head_dim
    gen = torch.Generator().manual_seed(seed)

    def linear(out_features: int, in_features: int) -> torch.Tensor:
        return torch.randn(out_features, in_features, generator=gen) / in_features**0.5

    tensors = {"model.embed_tokens.weight": torch.randn(vocab_size, hidden, generator=gen),
               "lm_head.weight": linear(vocab_size, hidden),  # untied: a tied head just echoes the input token
               "model.norm.weight": 1 + 0.1 * torch.randn(hidden, generator=gen)}
    for i in range(num_layers):
        p = f"model.layers.{i}."
        tensors |= {
            p + "input_layernorm.weight": 1 + 0.1 * torch.randn(hidden, generator=gen),
            p + "post_attention_layernorm.weight": 1 + 0.1 * torch.randn(hidden, generator=gen),
            p + "self_attn.q_proj.weight": 2 * linear(num_heads * head_dim, hidden),  # sharper attention
            p + "self_attn.k_proj.weight": 2 * linear(num_kv_heads * head_dim, hidden),
            p + "self_attn.v_proj.weight": linear(num_kv_heads * head_dim, hidden),
            p + "self_attn.o_proj.weight": 3 * linear(hidden, num_heads * head_dim),  # attention moves the stream
            p + "mlp.gate_proj.weight": linear(intermediate, hidden),
            p + "mlp.up_proj.weight": linear(intermediate, hidden),
            p + "mlp.down_proj.weight": linear(hidden, intermediate),
        }
    model_dir = Path(model_dir)
    model_dir.mkdir(parents=True, exist_ok=True)
    save_file({name: t.contiguous() for name, t in tensors.items()}, str(model_dir / "model.safetensors"))
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": vocab_size,
        "hidden_size": hidden, "intermediate_size": intermediate, "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads, "num_key_value_heads": num_kv_heads, "head_dim": head_dim,
        "hidden_act": "silu", "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "max_position_embeddings": 512,
        "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "float32",
    }
    (model_dir / "config.json").write_text(json.dumps(config, indent=1))


def greedy_generate(runner, prompts: list[list[int]], *, max_tokens: int, chunk_size: int) -> list[list[int]]:
    """Drive a workers.model_runner.ModelRunner the way the scheduler does, without it: every
    step each unfinished request catches up by at most chunk_size tokens, so long prompts are
    prefilled in chunks (after a prefix) while short ones already decode in the same batch.
    Blocks are handed out up front, disjoint, block 0 unused (null)."""
    from scheduler.outputs import CachedRequestData, NewRequestData, SchedulerOutput
    from scheduler.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    block_size = runner.block_size
    next_block = 1
    block_ids, num_computed, outputs = {}, {}, {}
    for i, prompt in enumerate(prompts):
        num_blocks = -(-(len(prompt) + max_tokens) // block_size)
        block_ids[f"r{i}"] = list(range(next_block, next_block + num_blocks))
        next_block += num_blocks
        num_computed[f"r{i}"], outputs[f"r{i}"] = 0, []
    assert next_block <= runner.num_blocks, f"need {next_block} blocks, the runner has {runner.num_blocks}"
    sent, finished = set(), set()
    while len(finished) < len(prompts):
        new, cached, scheduled = [], [], {}
        for i, prompt in enumerate(prompts):
            rid = f"r{i}"
            if rid in finished:
                continue
            scheduled[rid] = min(chunk_size, len(prompt) + len(outputs[rid]) - num_computed[rid])
            if rid in sent:
                cached.append(CachedRequestData(rid, new_block_ids=[], num_computed_tokens=num_computed[rid]))
            else:
                new.append(NewRequestData(rid, list(prompt), [], params, list(block_ids[rid]), 0))
                sent.add(rid)
        out = runner.execute(SchedulerOutput(new, cached, scheduled, sum(scheduled.values())))
        for rid, num_scheduled in scheduled.items():
            num_computed[rid] += num_scheduled
            if rid in out.sampled_token_ids:
                outputs[rid].append(out.sampled_token_ids[rid])
                if len(outputs[rid]) == max_tokens:
                    finished.add(rid)
    return [outputs[f"r{i}"] for i in range(len(prompts))]


# Prompt lengths chosen so that with chunk_size 16 and block_size 16, steps mix first chunks,
# chunks after a prefix (one prefix ending mid-block), and decodes.
E2E_PROMPT_LENS = (3, 11, 16, 29, 45)


def e2e_prompts(vocab_size: int = 256, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab_size, (n,), generator=gen).tolist() for n in E2E_PROMPT_LENS]


def give_layers_variants(model) -> None:
    """Gemma 2 / gpt-oss-like attention on write_tiny_llama's two layers (LayerWeights' fields):
    a window of 5 with a soft-cap on the first, sinks (in the model's dtype and device) and a
    window of 9 on the second."""
    gen = torch.Generator().manual_seed(7)
    sinks = (1 + 2 * torch.randn(model.config.num_heads, generator=gen)).to(model.device, model.dtype)
    first, second = model.layers[:2]
    first.window, first.softcap = 5, 2.0
    second.window, second.sinks = 9, sinks


def load_models_with_variants(monkeypatch) -> None:
    """Every model the loader builds from here on gets give_layers_variants, before the runner
    captures anything (CUDA graphs) around it."""
    from workers.model import PagedLlamaModel

    build = PagedLlamaModel.from_hf_weights

    def with_variants(*args, **kwargs):
        model = build(*args, **kwargs)
        give_layers_variants(model)
        return model

    monkeypatch.setattr(PagedLlamaModel, "from_hf_weights", with_variants)
