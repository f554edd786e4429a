"""Tile sizes for the quantized-linear Triton kernels, measured on a GPU: every candidate
triton_quant.Tiles per kernel, Llama-3.1-8B projection shape and batch, timed from CUDA graphs
(bench/bench_quant_gpu.py's graph_time_us, weights streamed from HBM) beside bf16 F.linear.

    python -m bench.tune_quant_gpu                       # batches 1 and 64, every kernel
    python -m bench.tune_quant_gpu --kernels awq,gptq --batches 1,16,64 --json /tmp/tiles.json

Kernels: awq and gptq (int4_gemm, group 128), mxfp4 (mxfp4_gemm), fp8-w8a16 (fp8_gemm on bf16
x) and fp8-w8a8 (fp8_linear through the Triton GEMM, activations quantized per token).
Candidates: BLOCK_M 16 (batches <= 16) or 64, (BLOCK_N, BLOCK_K) of CANDIDATE_BLOCKS, 4 or 8
warps, 3 or 4 stages, and for the 4-bit and MXFP4 kernels both ways of reading packed weights
and, at batch 1, one-row tiles (BLOCK_M 1: no tl.dot) of ONE_ROW_BLOCKS;
split-K as the launcher chooses it. --chosen times only the launchers' own choice. Compiling hundreds of variants one by one takes minutes, so
a pool of processes first launches each once (Triton's on-disk cache keeps the binaries), then
this process times them one at a time. Every candidate's output is checked against x @
dequantize(W).T (a wrong one is reported and never chosen). Printed per cell: the default tiles'
time, the best three, and bf16's; --json writes every timing.
"""

from __future__ import annotations

import argparse
import itertools
import json
import multiprocessing
import os
from concurrent.futures import ProcessPoolExecutor

import torch
import torch.nn.functional as F

from bench.bench_quant_gpu import LLAMA_8B_SHAPES, build_weight, graph_time_us, parse_names, weight_copies
from workers import quant_formats as qf

KERNELS = ("awq", "gptq", "mxfp4", "fp8-w8a16", "fp8-w8a8")
CANDIDATE_BLOCKS = ((32, 128), (64, 64), (64, 128), (128, 64), (128, 128))  # (BLOCK_N, BLOCK_K)
PACKED_KERNELS = ("awq", "gptq", "mxfp4")
ONE_ROW_BLOCKS = ((64, 64), (64, 128), (128, 32), (128, 64), (256, 32))  # (BLOCK_N, BLOCK_K), BLOCK_M 1
MAX_REL_ERROR = {"fp8-w8a8": 6e-2}  # activations rounded to e4m3: ~3e-2; bf16 rounding alone: ~3e-3
DEFAULT_MAX_REL_ERROR = 2e-2  # a wrong kernel is far off


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", default="1,64", help="rows per call, comma separated")
    parser.add_argument("--kernels", default=",".join(KERNELS), help=f"comma separated, of {KERNELS}")
    parser.add_argument("--iters", type=int, default=24, help="calls per timed CUDA graph")
    parser.add_argument("--compile-workers", type=int, default=min(16, os.cpu_count() or 1))
    parser.add_argument("--json", default=None, help="write every timing here")
    parser.add_argument("--chosen", action="store_true",
                        help="time only the tiles the launchers choose")
    args = parser.parse_args(argv)
    args.batches = [int(b) for b in args.batches.split(",")]
    args.kernels = parse_names(parser, args.kernels, KERNELS, "kernels")
    return args


def candidates(kernel: str, batch: int, n: int = 4096, chosen: bool = False) -> list[tuple]:
    """Plain tuples in triton_quant.Tiles' field order (they cross process boundaries). chosen:
    only the tiles _choose_blocks picks for bf16 x."""
    if chosen:
        from workers.kernels.triton_quant import _choose_blocks

        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return [tuple(_choose_blocks(kernel_kind(kernel), batch, n, torch.bfloat16, device))]
    block_m = 16 if batch <= 16 else 64
    packs = (False, True) if kernel in PACKED_KERNELS else (False,)
    tiles = [(block_m, bn, bk, warps, stages, packed)
             for packed, (bn, bk), warps, stages in itertools.product(packs, CANDIDATE_BLOCKS, (4, 8), (3, 4))]
    if batch == 1 and kernel in PACKED_KERNELS:  # one-row tiles: products without tl.dot
        tiles += [(1, bn, bk, warps, 3, packed)
                  for packed, (bn, bk), warps in itertools.product(packs, ONE_ROW_BLOCKS, (4, 8))]
    return tiles


def weight_format(kernel: str) -> str:
    return {"fp8-w8a16": "fp8-w8a16", "fp8-w8a8": "fp8"}.get(kernel, kernel)


def kernel_kind(kernel: str) -> str:
    """triton_quant._choose_blocks' name for the kernel."""
    return {"awq": "int4", "gptq": "int4"}.get(kernel, kernel.split("-")[0])


def call(kernel: str, tq, x: torch.Tensor, weight, tiles) -> torch.Tensor:
    if kernel in ("awq", "gptq"):
        return tq.int4_gemm(x, weight, blocks=tiles)
    if kernel == "mxfp4":
        return tq.mxfp4_gemm(x, weight, blocks=tiles)
    return tq.fp8_linear(x, weight, use_scaled_mm=False, blocks=tiles)


def _compile_one(task: tuple) -> tuple[tuple, str | None]:
    """In a pool process: one launch of (kernel, n, k, batch, tiles), so Triton compiles and caches it."""
    kernel, n, k, batch, tiles = task
    try:
        from workers.kernels import triton_quant as tq

        weight = build_weight(weight_format(kernel), n, k, "cuda")
        x = torch.randn(batch, k, device="cuda").bfloat16()
        call(kernel, tq, x, weight, tq.Tiles(*tiles))
        torch.cuda.synchronize()
        return task, None
    except Exception as exc:  # out of shared memory and the like: reported, never timed
        return task, f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"


def compile_all(tasks: list[tuple], workers: int) -> dict[tuple, str]:
    """task -> error, for the tasks that failed to compile or run."""
    failed = {}
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=workers, mp_context=context) as pool:
        for done, (task, error) in enumerate(pool.map(_compile_one, tasks, chunksize=4), 1):
            if error is not None:
                failed[task] = error
            if done % 50 == 0 or done == len(tasks):
                print(f"  compiled {done}/{len(tasks)} ({len(failed)} failed)", flush=True)
    return failed


def run(args: argparse.Namespace) -> list[dict]:
    from workers.kernels import triton_quant as tq

    shapes = [(name, n, k) for name, n, k, _ in LLAMA_8B_SHAPES]
    tasks = [(kernel, n, k, batch, tiles) for kernel in args.kernels for _, n, k in shapes
             for batch in args.batches for tiles in candidates(kernel, batch, n, args.chosen)]
    print(f"{torch.cuda.get_device_name()}: compiling {len(tasks)} launches in {args.compile_workers} processes",
          flush=True)
    failed = compile_all(tasks, args.compile_workers)
    rows = []
    for name, n, k in shapes:
        dense_copies = weight_copies("bf16", n, k, "cuda")
        for batch in args.batches:
            x = torch.randn(batch, k, device="cuda").bfloat16()
            bf16_us = graph_time_us(lambda w: F.linear(x, w), dense_copies, min_calls=args.iters)
            for kernel in args.kernels:
                copies = weight_copies(weight_format(kernel), n, k, "cuda")
                first = copies[0]
                expected = x.float() @ qf.dequantize(first).t()
                default = tuple(tq._choose_blocks(kernel_kind(kernel), batch, n, x.dtype, x.device))
                timings = []
                for tiles in dict.fromkeys(candidates(kernel, batch, n, args.chosen) + [default]):
                    task = (kernel, n, k, batch, tiles)
                    if task in failed:
                        continue
                    try:
                        out = call(kernel, tq, x, first, tq.Tiles(*tiles)).float()
                        error = ((out - expected).abs().max() / expected.abs().max()).item()
                        if not error <= MAX_REL_ERROR.get(kernel, DEFAULT_MAX_REL_ERROR):
                            print(f"  WRONG {kernel} {name} batch {batch} tiles {tiles}: max rel error {error:.3g}")
                            continue
                        micros = graph_time_us(lambda w, t=tq.Tiles(*tiles): call(kernel, tq, x, w, t), copies,
                                               min_calls=args.iters)
                    except Exception as exc:  # a launch that fails here is reported, not chosen
                        print(f"  failed {kernel} {name} batch {batch} tiles {tiles}: {type(exc).__name__}: {exc}")
                        continue
                    timings.append((micros, tiles))
                    rows.append({"kernel": kernel, "shape": name, "n": n, "k": k, "batch": batch,
                                 "tiles": list(tiles), "us": micros, "bf16_us": bf16_us, "default": tiles == default})
                timings.sort()
                if not timings:
                    print(f"{name:20s} batch {batch:3d} {kernel:9s}: no candidate ran", flush=True)
                    continue
                default_us = next((us for us, tiles in timings if tiles == default), float("nan"))
                best = "  ".join(f"{us:.1f} {tuple(t)}" for us, t in timings[:3])
                print(f"{name:20s} batch {batch:3d} {kernel:9s} bf16 {bf16_us:6.1f} us | default {default_us:7.1f} "
                      f"| best {best} | best vs bf16 {bf16_us / timings[0][0]:.2f}x, vs default "
                      f"{default_us / timings[0][0]:.2f}x", flush=True)
                del copies, first
    for task, error in sorted(failed.items(), key=str)[:20]:
        print(f"  failed {task}: {error}")
    return rows


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("tune_quant_gpu needs a CUDA device (torch.cuda.is_available() is False)")
    rows = run(args)
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(rows, handle)


if __name__ == "__main__":
    main()
