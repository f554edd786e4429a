"""Our CPU paged attention for a decode step, with the KV pool in memory as a real step has it.

    .venv/bin/python -m bench.bench_attention                  # fp32, 1 thread, 16 seqs x 272 keys
    .venv/bin/python -m bench.bench_attention --threads 2 --dtype bfloat16
    .venv/bin/python -m bench.bench_attention --threads 2 --kv-dtype float16   # fp32 queries, a half pool

SmolLM2-135M's shapes (30 layers, 9 query heads over 3 kv heads, head_dim 64, blocks of 16):
each layer gets its own pool (about 200 MB in all in fp32 at the defaults), so every call
reads its keys and values from DRAM, as a decode step does (one repeated small pool would
measure the cache: 16 x 272 keys fit in L3). The step's blocks are scattered over a pool of
--pool-gb over all layers (the shipped 1 GB by default), as a served step's are, so TLB
misses count as they do when serving (0: pools of just the blocks read, as before
2026-11-26, which hides them). Prints the median over --repeats passes of the 30 layers,
and the same calls on one warm pool for comparison.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads OpenMP

import argparse  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402

from workers.kernels import cpu_attention  # noqa: E402

LAYERS, HEADS, KV_HEADS, HEAD_DIM = 30, 9, 3, 64


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seqs", type=int, default=16)
    parser.add_argument("--context", type=int, default=272)
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--kv-dtype", default=None, choices=("float32", "bfloat16", "float16"),
                        help="the pool's dtype (default: --dtype); float16 under float32 queries is a half pool")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--prefill", action="store_true",
                        help="a prefill step instead: each sequence's --context tokens are all queries (causal), "
                             "e.g. --seqs 8 --context 256, the c16 workload's 2048-token prompt steps")
    parser.add_argument("--pool-gb", type=float, default=1.0,
                        help="KV pool over all layers (the shipped kv_cache_memory_gb); the step's blocks are "
                             "scattered over it, as a served step's are; 0: just the blocks the step reads")
    parser.add_argument("--block-size", type=int, default=16,
                        help="tokens per KV block (the shipped block_size: 16; the kernel takes up to 64)")
    parser.add_argument("--blocks-in-order", action="store_true",
                        help="the step's blocks in pool order (each sequence's consecutive) instead of scattered")
    args = parser.parse_args()
    BLOCK = args.block_size
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    kv_dtype = getattr(torch, args.kv_dtype or args.dtype)
    blocks_per_seq = -(-args.context // BLOCK)
    block_bytes = 2 * KV_HEADS * HEAD_DIM * BLOCK * kv_dtype.itemsize  # K and V
    num_blocks = max(args.seqs * blocks_per_seq + 1, int(args.pool_gb * 2**30 / (LAYERS * block_bytes)))
    generator = torch.Generator().manual_seed(0)
    order = torch.arange(num_blocks - 1) if args.blocks_in_order else torch.randperm(num_blocks - 1, generator=generator)
    block_tables = order[: args.seqs * blocks_per_seq] + 1
    block_tables = block_tables.view(args.seqs, blocks_per_seq).to(torch.int32).contiguous()
    queries_per_seq = args.context if args.prefill else 1
    query_start_loc = torch.arange(args.seqs + 1, dtype=torch.int32) * queries_per_seq
    seq_lens = torch.full((args.seqs,), args.context, dtype=torch.int32)
    layers = []
    for _ in range(LAYERS):
        k_cache, v_cache = cpu_attention.allocate_kv_cache(num_blocks, BLOCK, KV_HEADS, HEAD_DIM, kv_dtype)
        k_cache.copy_(torch.randn(k_cache.shape, generator=generator).to(kv_dtype))  # K and V share one pool
        q = torch.randn(args.seqs * queries_per_seq, HEADS, HEAD_DIM, generator=generator).to(dtype)
        layers.append((q, k_cache, v_cache))
    pool_mb = sum(k.untyped_storage().nbytes() for _, k, _ in layers) / 1e6
    scale = HEAD_DIM ** -0.5

    def run(pools) -> float:
        started = time.perf_counter()
        for q, k_cache, v_cache in pools:
            cpu_attention.paged_attention(q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, scale)
        return time.perf_counter() - started

    run(layers)
    cold = statistics.median(run(layers) for _ in range(args.repeats))
    warm = statistics.median(run([layers[0]] * LAYERS) for _ in range(args.repeats))
    what = f"prefill of {args.seqs} x {args.context} tokens" if args.prefill else f"{args.seqs} seqs x {args.context} keys"
    pool = f" over a {args.kv_dtype} pool" if kv_dtype != dtype else ""
    print(f"{args.dtype}{pool}, {args.threads} thread(s), {what}, {LAYERS} layers, blocks of {BLOCK}"
          f"{' in order' if args.blocks_in_order else ''} "
          f"({pool_mb:.0f} MB of pools): {cold * 1e3:.1f} ms from memory, {warm * 1e3:.1f} ms on one warm pool")


if __name__ == "__main__":
    main()
