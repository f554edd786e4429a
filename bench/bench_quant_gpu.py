"""Quantized linear layers on a GPU against bf16 F.linear, on Llama-3.1-8B's projection shapes.

    python -m bench.bench_quant_gpu                          # batches 1 and 64, every format
    python -m bench.bench_quant_gpu --batches 1,16,64,256 --formats awq,fp8 --iters 100

Random weights in each format's kernel-ready form (workers/quant_formats.py), built on the
device; workers/kernels/triton_quant.quant_linear multiplies. Per (format, batch, shape): at
least --iters calls captured in one CUDA graph, each call on the next of enough weight copies
to exceed L2 (so the weight streams from HBM, as in a real step, not from cache); the graph's
replay time over its calls, median of 5 replays. The GPU's time only, as in a decode step
replayed from a graph: timing one eager call at a time adds the host's launch cost. Printed: time
in microseconds, the ratio to bf16 F.linear measured in the same run, and the max error of
the output against x @ dequantize(W).T relative to its largest value (a sanity column).

Formats: bf16 (F.linear, the baseline), awq and gptq (4-bit, group 128), mxfp4 (e2m1, 32 per
e8m0 scale), awq-nosplit and mxfp4-nosplit (the same with split-K off: whether split-K pays at
batch 1), fp8 (w8a8: per-token activation quantization then torch._scaled_mm on sm_89/sm_90,
the Triton FP8 GEMM below), fp8-triton (w8a8 forced through the Triton FP8 GEMM), fp8-w8a16
(fp8 weights, activations as they are). Tile sizes are untuned. Runs in about a minute on an
H100 (most of it Triton compiling).
"""

from __future__ import annotations

import argparse
import statistics

import torch
import torch.nn.functional as F

from workers import quant_formats as qf

# Llama-3.1-8B: hidden 4096, 32 heads / 8 kv heads of 128, intermediate 14336; (name, N, K, times per layer)
LLAMA_8B_SHAPES = [("q/o 4096x4096", 4096, 4096, 2), ("k/v 1024x4096", 1024, 4096, 2),
                   ("gate/up 14336x4096", 14336, 4096, 2), ("down 4096x14336", 4096, 14336, 1)]
FORMATS = ("bf16", "awq", "awq-nosplit", "gptq", "mxfp4", "mxfp4-nosplit", "fp8", "fp8-triton", "fp8-w8a16")
L2_BYTES = 64 << 20  # a bit over an H100/H200's 50 MB L2


def parse_names(parser: argparse.ArgumentParser, text: str, allowed: tuple[str, ...], what: str) -> list[str]:
    """A comma-separated list of names, each one of allowed (else a usage error naming the others)."""
    names = text.split(",")
    unknown = [name for name in names if name not in allowed]
    if unknown:
        parser.error(f"unknown {what} {unknown}; expected some of {allowed}")
    return names


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", default="1,64", help="rows per call, comma separated")
    parser.add_argument("--formats", default=",".join(FORMATS), help=f"comma separated, of {FORMATS}")
    parser.add_argument("--iters", type=int, default=50, help="calls per cell in the timed CUDA graph")
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args(argv)
    args.batches = [int(b) for b in args.batches.split(",")]
    args.formats = parse_names(parser, args.formats, FORMATS, "formats")
    if "bf16" not in args.formats:
        args.formats.insert(0, "bf16")  # the baseline every ratio needs
    return args


def random_int4(layout: str, n: int, k: int, device, group_size: int = 128) -> qf.Int4Weight:
    """Random packed words (every nibble pattern is a valid 4-bit weight), scales ~ 1 / (16 sqrt(K))."""
    groups = k // group_size
    words = (k, n // 8) if layout == "awq" else (k // 8, n)
    qweight = torch.randint(-2**31, 2**31, words, dtype=torch.int32, device=device)
    qzeros = torch.randint(-2**31, 2**31, (groups, n // 8), dtype=torch.int32, device=device)
    scales = (torch.rand(groups, n, device=device) + 0.5).div(16 * k ** 0.5).half()
    return qf.Int4Weight(layout, qweight, qzeros, scales, group_size, 1 if layout == "gptq" else 0, None, None)


def random_mxfp4(n: int, k: int, device) -> qf.Mxfp4Weight:
    blocks = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, device=device)
    scales = torch.randint(118, 123, (n, k // 32), dtype=torch.uint8, device=device)
    return qf.Mxfp4Weight(blocks, scales, None)


def random_fp8(n: int, k: int, device, activations: str | None) -> qf.Fp8Weight:
    weight = torch.randn(n, k, device=device).clamp(-448, 448).to(torch.float8_e4m3fn)
    scale = torch.full((n,), 1.0 / (2 * k ** 0.5), device=device)
    ub = qf.FBGEMM_SCALE_UB if activations else None
    return qf.Fp8Weight(weight, scale, activations, None, ub, None)


def build_weight(fmt: str, n: int, k: int, device) -> torch.Tensor | qf.QuantWeight:
    if fmt == "bf16":
        return (torch.randn(n, k, device=device) / k ** 0.5).bfloat16()
    if fmt in ("awq", "gptq", "awq-nosplit"):
        return random_int4(fmt.removesuffix("-nosplit"), n, k, device)
    if fmt in ("mxfp4", "mxfp4-nosplit"):
        return random_mxfp4(n, k, device)
    return random_fp8(n, k, device, None if fmt == "fp8-w8a16" else "dynamic_token")


def weight_bytes(weight) -> int:
    if isinstance(weight, torch.Tensor):
        return weight.numel() * weight.element_size()
    return sum(t.numel() * t.element_size() for t in vars(weight).values() if isinstance(t, torch.Tensor))


def weight_copies(fmt: str, n: int, k: int, device) -> list:
    """Enough random weights of the format (at least 2) to exceed L2 together: calls cycling
    through them stream each weight from HBM, as a real step does."""
    first = build_weight(fmt, n, k, device)
    return [first] + [build_weight(fmt, n, k, device) for _ in range(max(2, -(-L2_BYTES // weight_bytes(first))) - 1)]


def _call(fmt: str, tq, x: torch.Tensor, weight) -> torch.Tensor:
    if fmt == "bf16":
        return F.linear(x, weight)
    if fmt == "fp8-triton":
        return tq.fp8_linear(x, weight, use_scaled_mm=False)
    if fmt == "awq-nosplit":
        return tq.int4_gemm(x, weight, split_k=1)
    if fmt == "mxfp4-nosplit":
        return tq.mxfp4_gemm(x, weight, split_k=1)
    return tq.quant_linear(x, weight)


def graph_time_us(call, weights: list, *, min_calls: int = 24, replays: int = 5) -> float:
    """Median microseconds of call(weight), from a CUDA graph of calls cycling through the weight
    copies: the GPU's time alone, as a decode step replayed from a graph spends it (timed eagerly,
    one call at a time, the host's launch cost of 20-100 us would hide the kernels)."""
    for weight in weights[:2]:
        call(weight)  # compile and warm up
    torch.cuda.synchronize()
    rounds = -(-min_calls // len(weights))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(rounds):
            for weight in weights:
                call(weight)
    graph.replay()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000 / (rounds * len(weights)))
    del graph
    return statistics.median(times)


def time_cell(fmt: str, tq, x: torch.Tensor, weights: list, iters: int) -> float:
    return graph_time_us(lambda weight: _call(fmt, tq, x, weight), weights, min_calls=iters)


def max_rel_error(fmt: str, tq, x: torch.Tensor, weight) -> float:
    out = _call(fmt, tq, x, weight).float()
    expected = x.float() @ qf.dequantize(weight).t()
    return ((out - expected).abs().max() / expected.abs().max()).item()


def run(args: argparse.Namespace) -> None:
    from workers.kernels import triton_quant as tq

    device = torch.device(args.device)
    print(f"{torch.cuda.get_device_name(device)} (sm_{''.join(map(str, torch.cuda.get_device_capability(device)))}),"
          f" torch {torch.__version__}; {args.iters}+ calls replayed from a CUDA graph; x bf16;"
          " weights streamed from HBM")
    print(f"{'shape':20s} | {'batch':>5s} | {'format':13s} | {'MB':>6s} | {'us':>8s} | {'vs bf16':>7s} | max rel err")
    per_layer: dict[tuple[str, int], float] = {}
    for name, n, k, repeats in LLAMA_8B_SHAPES:
        for batch in args.batches:
            x = (torch.randn(batch, k, device=device)).bfloat16()
            baseline = None
            for fmt in args.formats:
                weights = weight_copies(fmt, n, k, device)
                first = weights[0]
                micros = time_cell(fmt, tq, x, weights, args.iters)
                baseline = micros if fmt == "bf16" else baseline
                error = max_rel_error(fmt, tq, x, first)
                per_layer[fmt, batch] = per_layer.get((fmt, batch), 0.0) + repeats * micros
                print(f"{name:20s} | {batch:5d} | {fmt:13s} | {weight_bytes(first) / 1e6:6.1f} | {micros:8.1f} | "
                      f"{baseline / micros:6.2f}x | {error:.2e}", flush=True)
                del weights, first
    print("\none decoder layer's 7 projections (q, k, v, o, gate, up, down), us:")
    for batch in args.batches:
        base = per_layer["bf16", batch]
        cells = "  ".join(f"{fmt} {per_layer[fmt, batch]:.0f} ({base / per_layer[fmt, batch]:.2f}x)"
                          for fmt in args.formats)
        print(f"  batch {batch:4d}: {cells}")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench_quant_gpu needs a CUDA device (torch.cuda.is_available() is False)")
    run(args)


if __name__ == "__main__":
    main()
