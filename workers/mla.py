"""Multi-head latent attention (MLA, DeepSeek V2/V3) over a paged latent cache, in torch.

Per layer, with x the normed hidden states [num_tokens, hidden] (MlaTraits: workers/families.py):

    q          = q_b_proj(rms_norm(q_a_proj(x), q_a_layernorm))     or q_proj(x)   [T, heads, nope + rope]
    latent, kr = split(kv_a_proj_with_mqa(x))                          [T, rank], [T, rope]
    latent     = rms_norm(latent, kv_a_layernorm)
    q_rope, kr = rope(q_rope), rope(kr)                                kr: one key part shared by every head
    pool[slot] = latent ++ kr                                          one vector per token and layer
    out        = o_proj(attention(q, K, V))                            K, V from the pool's latents:
    k_nope, v  = split(kv_b_proj(latent))  per head;   K = k_nope ++ kr

The pool of an MLA layer is [num_blocks, block_size, 1, rank + rope]: per token its normed
latent and its rotated RoPE key, not per-head keys and values (DeepSeek V3: 576 values per
token and layer against 128 heads x (192 + 128) = 40960). Blocks are blocks: prefix caching,
preemption and forking copy or share them as any pool's.

Two forms read the pool (the same maths, reordered):

- expanded: the latents of every block the step's sequences use are expanded by kv_b_proj to
  per-head keys and values, then paged attention runs over those (as transformers computes it).
  Cheap per query when a sequence brings many queries (prompts).
- absorbed: kv_b_proj's key part W_uk [heads, nope, rank] is folded into the query
  (q_nope @ W_uk: a query in latent space), so scores are q_latent . latent + q_rope . kr over
  the pool in place, one key "head" shared by all query heads (MQA, head width rank + rope, the
  values the latents themselves); the output, in latent space, goes through the value part W_uv
  [heads, v, rank]. No per-step expansion of the context: what decodes take.

A step runs its decode sequences (one query each) absorbed and its others expanded
(MlaStep.split). DeepSeek's interleaved RoPE (pairs (x0, x1), (x2, x3), ...) becomes the
halves layout of workers/rope.py by permuting the RoPE rows of q_b_proj (or q_proj) and of
kv_a_proj_with_mqa at load: the keys in the pool are then a fixed permutation of transformers'
and every score is the same.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from workers.families import MlaTraits
from workers.kernels import torch_ref
from workers.rope import apply_rotary, deinterleave


@dataclass(slots=True)
class MlaWeights:
    """One MLA layer's attention; products in the linear backend's packed form, kv_b plain."""

    q_a: object | None  # [q_lora_rank, hidden]; None: q is one product (q below is q_proj)
    q_a_bias: torch.Tensor | None  # [q_lora_rank]
    q_a_norm: torch.Tensor | None  # [q_lora_rank]
    q: object  # q_b_proj [heads * qk_head_dim, q_lora_rank] or q_proj [heads * qk_head_dim, hidden]
    kv_a: object  # [kv_lora_rank + rope, hidden]
    kv_a_bias: torch.Tensor | None  # [kv_lora_rank + rope]
    kv_a_norm: torch.Tensor  # [kv_lora_rank]
    kv_b: torch.Tensor  # [heads * (nope + v), kv_lora_rank]
    k_absorb: torch.Tensor  # [heads, nope, kv_lora_rank]: kv_b's key rows, a view
    v_absorb: torch.Tensor  # [heads, kv_lora_rank, v]: kv_b's value rows, transposed (contiguous)


def read_mla_weights(reader, attn: str, traits: MlaTraits, num_heads: int, hidden: int, bias: bool) -> MlaWeights:
    """The layer's MLA tensors from the checkpoint (reader: model.py's _WeightReader, prefix attn)."""
    t = traits
    q_rows = num_heads * t.qk_head_dim
    q_order = torch.arange(q_rows).view(num_heads, t.qk_head_dim)
    if t.rope_interleave:
        q_order[:, t.qk_nope_head_dim:] = q_order[:, t.qk_nope_head_dim:][:, deinterleave(t.qk_rope_head_dim)]
    kv_order = torch.arange(t.cache_width)
    if t.rope_interleave:
        kv_order[t.kv_lora_rank:] = t.kv_lora_rank + deinterleave(t.qk_rope_head_dim)

    def plain(name: str, shape: tuple[int, ...]) -> torch.Tensor:
        tensor = reader.take(attn + name, shape)
        if not isinstance(tensor, torch.Tensor):
            raise reader.error(f"{attn + name} is a {tensor.label} weight; latent attention takes plain weights")
        return tensor

    if t.q_lora_rank is None:
        q_a = q_a_bias = q_a_norm = None
        q = plain("q_proj.weight", (q_rows, hidden))[q_order.view(-1)]
    else:
        q_a = reader.pack(plain("q_a_proj.weight", (t.q_lora_rank, hidden)))
        q_a_bias = plain("q_a_proj.bias", (t.q_lora_rank,)) if bias else None
        q_a_norm = reader.take_norm(attn, "q_a_layernorm", t.q_lora_rank)
        q = plain("q_b_proj.weight", (q_rows, t.q_lora_rank))[q_order.view(-1)]
    kv_a = plain("kv_a_proj_with_mqa.weight", (t.cache_width, hidden))[kv_order]
    kv_a_bias = plain("kv_a_proj_with_mqa.bias", (t.cache_width,))[kv_order] if bias else None
    kv_b = plain("kv_b_proj.weight", (num_heads * (t.qk_nope_head_dim + t.v_head_dim), t.kv_lora_rank))
    per_head = kv_b.view(num_heads, t.qk_nope_head_dim + t.v_head_dim, t.kv_lora_rank)
    return MlaWeights(
        q_a=q_a, q_a_bias=q_a_bias, q_a_norm=q_a_norm, q=reader.pack(q.contiguous()),
        kv_a=reader.pack(kv_a.contiguous()), kv_a_bias=None if kv_a_bias is None else kv_a_bias.contiguous(),
        kv_a_norm=reader.take_norm(attn, "kv_a_layernorm", t.kv_lora_rank), kv_b=kv_b,
        k_absorb=per_head[:, :t.qk_nope_head_dim],
        v_absorb=per_head[:, t.qk_nope_head_dim:].transpose(1, 2).contiguous(),
    )


def allocate_latent_cache(num_blocks: int, block_size: int, traits: MlaTraits, dtype: torch.dtype,
                          device: str | torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """An MLA layer's pool [num_blocks, block_size, 1, rank + rope], zeroed, as the (keys, values)
    pair the runner copies blocks of: the whole vector is the absorbed form's key, its latent
    part (a view of the same memory) the value."""
    pool = torch.zeros(num_blocks, block_size, 1, traits.cache_width, dtype=dtype, device=device)
    return pool, pool[..., :traits.kv_lora_rank]


@dataclass(slots=True)
class _Part:
    """Some sequences of a step: their query rows and their metadata."""

    rows: torch.Tensor | slice  # rows of the step's tokens
    block_tables: torch.Tensor  # [seqs, max_blocks] int32
    query_start_loc: torch.Tensor  # [seqs + 1] int32
    seq_lens: torch.Tensor  # [seqs] int32


class MlaStep:
    """One step's MLA attention, the same metadata for every layer: which sequences run absorbed
    (decodes) and which expanded, worked out once."""

    def __init__(self, metadata, scale: float, absorb_decodes: bool = True) -> None:
        self.metadata, self.scale = metadata, scale
        self.absorbed, self.expanded = self.split(metadata, absorb_decodes)
        # the blocks the expanded sequences read, each once, and their tables over those
        self.blocks: torch.Tensor | None = None
        self.compact_tables: torch.Tensor | None = None
        if self.expanded is not None:
            blocks, compact = torch.unique(self.expanded.block_tables, return_inverse=True)
            self.blocks, self.compact_tables = blocks, compact.to(torch.int32)

    @staticmethod
    def split(metadata, absorb_decodes: bool) -> tuple[_Part | None, _Part | None]:
        """(absorbed part, expanded part): sequences with one query, and the others; None where empty."""
        m = metadata
        whole = _Part(slice(None), m.block_tables, m.query_start_loc, m.seq_lens)
        if not absorb_decodes:
            return None, whole
        query_lens = m.query_start_loc[1:] - m.query_start_loc[:-1]
        decodes = query_lens == 1
        if bool(decodes.all()):
            return whole, None
        if not bool(decodes.any()):
            return None, whole
        return _subset(m, decodes), _subset(m, ~decodes)

    def write(self, entry: torch.Tensor, pool: torch.Tensor) -> None:
        """entry [num_tokens, rank + rope] into the tokens' slots of the pool."""
        pool.view(-1, pool.shape[-1]).index_copy_(0, self.metadata.slot_mapping, entry)


def _subset(m, chosen: torch.Tensor) -> _Part:
    """The sequences where chosen [seqs] bool is set, with their rows and rebased query starts."""
    starts = m.query_start_loc.long()
    lens = starts[1:] - starts[:-1]
    seqs = chosen.nonzero().view(-1)
    chosen_lens = lens[seqs]
    rows = torch.repeat_interleave(starts[:-1][seqs], chosen_lens) + _ranks(chosen_lens)
    query_start_loc = torch.zeros(seqs.numel() + 1, dtype=torch.int32, device=starts.device)
    query_start_loc[1:] = chosen_lens.cumsum(0)
    return _Part(rows, m.block_tables[seqs], query_start_loc, m.seq_lens[seqs])


def _ranks(lens: torch.Tensor) -> torch.Tensor:
    """0, 1, ..., len - 1 for each len, concatenated."""
    ends = lens.cumsum(0)
    return torch.arange(int(ends[-1]), device=lens.device) - torch.repeat_interleave(ends - lens, lens)


def mla_attention(model, weights: MlaWeights, x: torch.Tensor, positions: torch.Tensor, step: MlaStep,
                  kv_cache: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """The attention's output before o_proj, [num_tokens, heads * v_head_dim]; writes the step's
    latents and RoPE keys into the pool."""
    t: MlaTraits = model.config.traits.mla
    num_tokens, num_heads, eps = x.shape[0], model.config.num_heads, t.norm_eps
    linear = model.linear
    if weights.q_a is None:
        q = linear(x, weights.q, None)
    else:
        q_low = linear(x, weights.q_a, weights.q_a_bias)
        q = linear(F.rms_norm(q_low, (t.q_lora_rank,), weights.q_a_norm, eps), weights.q, None)
    q = q.view(num_tokens, num_heads, t.qk_head_dim)
    compressed = linear(x, weights.kv_a, weights.kv_a_bias)  # [T, rank + rope]
    latent = F.rms_norm(compressed[:, :t.kv_lora_rank], (t.kv_lora_rank,), weights.kv_a_norm, eps)
    if t.rope:
        cos, sin = model.rope.cos_sin(positions)
        q_rope = apply_rotary(q[..., t.qk_nope_head_dim:], cos, sin)
        k_rope = apply_rotary(compressed[:, None, t.kv_lora_rank:], cos, sin)[:, 0]
    else:  # NoPE (Kimi Linear): the "RoPE" parts are plain parts of q and of the shared key
        q_rope, k_rope = q[..., t.qk_nope_head_dim:], compressed[:, t.kv_lora_rank:]
    pool = kv_cache[0]
    step.write(torch.cat([latent, k_rope], dim=-1), pool)
    out = torch.empty(num_tokens, num_heads, t.v_head_dim, dtype=x.dtype, device=x.device)
    if step.absorbed is not None:
        part = step.absorbed
        out[part.rows] = _absorbed(q[part.rows], q_rope[part.rows], pool, weights, t, part, step.scale)
    if step.expanded is not None:
        part = step.expanded
        q_full = torch.cat([q[part.rows, :, :t.qk_nope_head_dim], q_rope[part.rows]], dim=-1)
        out[part.rows] = _expanded(q_full, pool, weights, t, step, part)
    return out.view(num_tokens, num_heads * t.v_head_dim)


def _expanded(q: torch.Tensor, pool: torch.Tensor, weights: MlaWeights, t: MlaTraits, step: MlaStep,
              part: _Part) -> torch.Tensor:
    """q [rows, heads, nope + rope] -> [rows, heads, v]: the part's blocks expanded to per-head K and V."""
    context = pool.index_select(0, step.blocks)  # [blocks, block_size, 1, rank + rope]
    num_blocks, block_size = context.shape[:2]
    num_heads = q.shape[1]
    kv = F.linear(context[..., 0, :t.kv_lora_rank], weights.kv_b)
    kv = kv.view(num_blocks, block_size, num_heads, t.qk_nope_head_dim + t.v_head_dim)
    k_rope = context[..., t.kv_lora_rank:].expand(num_blocks, block_size, num_heads, t.qk_rope_head_dim)
    keys = torch.cat([kv[..., :t.qk_nope_head_dim], k_rope], dim=-1)
    values = kv[..., t.qk_nope_head_dim:]
    return torch_ref.paged_attention(q, keys, values, step.compact_tables, part.query_start_loc, part.seq_lens,
                                     step.scale)


def _absorbed(q: torch.Tensor, q_rope: torch.Tensor, pool: torch.Tensor, weights: MlaWeights, t: MlaTraits,
              part: _Part, scale: float) -> torch.Tensor:
    """q [rows, heads, nope + rope] -> [rows, heads, v] over the pool in place: the query folded
    into latent space through kv_b's key rows, one shared key head, the output out of it through
    kv_b's value rows."""
    q_latent = torch.bmm(q[..., :t.qk_nope_head_dim].transpose(0, 1), weights.k_absorb)  # [heads, rows, rank]
    q_cat = torch.cat([q_latent.transpose(0, 1), q_rope], dim=-1)  # [rows, heads, rank + rope]
    latent_out = torch_ref.paged_attention(q_cat, pool, pool[..., :t.kv_lora_rank], part.block_tables,
                                           part.query_start_loc, part.seq_lens, scale)  # [rows, heads, rank]
    return torch.bmm(latent_out.transpose(0, 1), weights.v_absorb).transpose(0, 1)  # [rows, heads, v]
