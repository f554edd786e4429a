"""Products with GGUF-quantized weights (csrc/gguf_gemm.c): the fp32 and int8 modes side by side,
each weight repacked eight rows at a time as the model packs it (gguf_weight.pack_for_kernels:
a layer's Q4_0 and Q4_1 in the int8 mode, the lm_head's Q8_0 in the int16 mode, gguf.logits_mode;
the file's layout again for the other types), the prompt-step path of weights in
the file's layout (the weight dequantized by our kernel, then F.linear: gguf.DENSE_MIN_ROWS), and
the dense fp32 panel GEMM of the same shape, at SmolLM2-135M's shapes.

    .venv/bin/python -m bench.bench_gguf                         # 1 thread, rows 1 and 16
    .venv/bin/python -m bench.bench_gguf --threads 2 --rows 1,4,16,64 --type Q4_K
    .venv/bin/python -m bench.bench_gguf --threads 2 --rows 16,32,64,256 --tiles   # + AMX tiles (csrc/amx.c)

With --tiles (a CPU whose OS grants AMX tile data), the layer shapes also run on tiles over the
packed weights: bf16 tiles (gguf.amx_gemm: each group of columns dequantized to bf16, x rounded to
bf16) and int8 tiles (gguf.amx_int8_gemm: the int8 mode's product, bit for bit), each against
the packed int8 vector kernel last: what workers/kernels/cpu_isa.py's TILE_MIN_ROWS["gguf"] and
["gguf_int8"] are judged by; and the lm_head's int16 product on int8 tiles (gguf.amx_int16_gemm,
bit for bit) against the packed int16 vector kernel, for TILE_MIN_ROWS["gguf_int16"].

Each shape gets enough copies of its weight (distinct memory) that a pass over them reads
--min-mb megabytes, so every product streams its weight from memory as a real step does; the
median over --repeats passes, the three paths alternating, in ms per product and GB/s of the
weight bytes each path reads (GGUF blocks, or fp32 panels). Projections are --type (the
default Q4_1, the shipped model's), the lm_head Q8_0. Ratios: packed / the same mode in the
file's layout, packed / dense fp32, and dequantize-then-F.linear / packed. For a packed lm_head the
fp32 mode column is the packed weight's (the lm_head's product before the int16 mode), so its
pack/file ratio is int16 / fp32 on the same packed blocks.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch
import torch.nn.functional as F

from workers.gguf_weight import (BLOCK_LAYOUT, LAYER_PACKED_TYPES, LOGITS_PACKED_TYPES, PACKED_ROWS, GGMLType,
                                 GgufWeight, pack_columns)
from workers.kernels.cpu_isa import cpu_plan
from workers.kernels.gguf import amx_gemm, amx_int8_gemm, amx_int16_gemm, gguf_dequantize, gguf_gemm, logits_mode
from workers.linear import NativeLinear

SHAPES = [(576, 576, None), (192, 576, None), (1536, 576, None), (576, 1536, None), (49152, 576, GGMLType.Q8_0)]


def random_weight(ggml_type: GGMLType, out_features: int, in_features: int) -> GgufWeight:
    """Random weights quantized by the gguf package (Q4_0, Q4_1, Q8_0), or random K-type blocks
    with small fp16 scales (the package cannot quantize those)."""
    from gguf import GGMLQuantizationType, quants

    if ggml_type in (GGMLType.Q4_0, GGMLType.Q4_1, GGMLType.Q8_0):
        values = np.random.default_rng(0).standard_normal((out_features, in_features), dtype=np.float32)
        blocks = quants.quantize(values, GGMLQuantizationType(int(ggml_type)))
        return GgufWeight(ggml_type, out_features, in_features, torch.from_numpy(np.ascontiguousarray(blocks)))
    per_block, block_bytes = BLOCK_LAYOUT[ggml_type]
    rng = np.random.default_rng(0)
    blocks = rng.integers(0, 256, (out_features, in_features // per_block, block_bytes), dtype=np.uint8)
    scales = (rng.random((out_features, in_features // per_block, 2)) * 0.01 + 1e-3).astype(np.float16)
    at = [208] if ggml_type == GGMLType.Q6_K else [0, 2]
    for i, offset in enumerate(at):
        blocks[:, :, offset:offset + 2] = scales[:, :, i:i + 1].view(np.uint8)
    return GgufWeight(ggml_type, out_features, in_features, torch.from_numpy(blocks.reshape(out_features, -1)))


def timed(run, weights, x) -> float:
    """ms per product over one pass of the copies."""
    started = time.perf_counter()
    for weight in weights:
        run(x, weight)
    return (time.perf_counter() - started) * 1e3 / len(weights)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rows", default="1,16")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--type", default="Q4_1", choices=[t.name for t in BLOCK_LAYOUT])
    parser.add_argument("--min-mb", type=float, default=64.0)
    parser.add_argument("--tiles", action="store_true", help="the layer shapes on AMX tiles too")
    args = parser.parse_args()
    if args.tiles and not cpu_plan().amx:
        parser.error(f"no AMX tiles here: {cpu_plan().amx_status}")
    torch.set_num_threads(args.threads)
    native = NativeLinear()
    print(f"threads {args.threads} | ms per product (median of {args.repeats}) and GB/s of weight bytes read")
    print(f"{'shape':>18} {'rows':>5} | {'fp32 mode':>16} | {'int8 mode':>16} | {'packed':>16} | "
          f"{'dense fp32':>16} | {'dequantized':>16} | {'pack/file':>9} {'pack/dense':>10} {'deq/pack':>8}")
    for out_features, in_features, shape_type in SHAPES:
        ggml_type = shape_type or GGMLType[args.type]
        if in_features % BLOCK_LAYOUT[ggml_type][0]:  # K-types need whole 256-weight rows: not SmolLM2's 576
            print(f"{f'{out_features}x{in_features} {ggml_type.name}':>18}   a row is not whole blocks: skipped")
            continue
        first = random_weight(ggml_type, out_features, in_features)
        copies = max(1, int(args.min_mb * 1e6 / first.nbytes))
        quantized = [first] + [GgufWeight(ggml_type, out_features, in_features, first.blocks.clone())
                               for _ in range(copies - 1)]
        # packed as the model packs it: a layer's Q4_0/Q4_1 for int8, the lm_head's Q8_0 for int16
        is_head = shape_type is not None
        packable = (ggml_type in (LOGITS_PACKED_TYPES if is_head else LAYER_PACKED_TYPES)
                    and out_features % PACKED_ROWS == 0)
        packed = [pack_columns(w) for w in quantized] if packable else quantized
        packed_mode = logits_mode(packed[0]) if is_head else "int8"
        fp32_mode_weights = packed if packed_mode == "int16" else quantized  # the head's product before int16
        dense_copies = max(1, int(args.min_mb * 1e6 / (out_features * in_features * 4)))
        dense = [native.pack(torch.randn(out_features, in_features)) for _ in range(dense_copies)]
        dense_bytes = out_features * in_features * 4
        for rows in (int(r) for r in args.rows.split(",")):
            x = torch.randn(rows, in_features)
            paths = {
                "fp32": (lambda x, w: gguf_gemm(x, w, mode="fp32"), fp32_mode_weights, first.nbytes),
                "int8": (lambda x, w: gguf_gemm(x, w, mode="int8"), quantized, first.nbytes),
                "packed": (lambda x, w: gguf_gemm(x, w, mode=packed_mode), packed, first.nbytes),
                "dense": (native.linear, dense, dense_bytes),
                "dequantized": (lambda x, w: F.linear(x, gguf_dequantize(w, scratch=True)), quantized, first.nbytes),
            }
            if args.tiles and not is_head:
                paths["tiles"] = (amx_gemm, packed, first.nbytes)
                if packed_mode == "int8" and packed[0].packed:
                    paths["int8 tiles"] = (amx_int8_gemm, packed, first.nbytes)
            if args.tiles and packed_mode == "int16" and out_features % 16 == 0:
                paths["int16 tiles"] = (amx_int16_gemm, packed, first.nbytes)
            times: dict[str, list[float]] = {name: [] for name in paths}
            for name, (run, weights, _) in paths.items():  # warm-up
                timed(run, weights[:2], x)
            for _ in range(args.repeats):
                for name, (run, weights, _) in paths.items():
                    times[name].append(timed(run, weights, x))
            median = {name: statistics.median(values) for name, values in times.items()}
            cells = [f"{median[name]:7.3f} {paths[name][2] / median[name] / 1e6:5.1f}GB/s" for name in paths]
            print(f"{f'{out_features}x{in_features} {ggml_type.name}':>18} {rows:>5} | " + " | ".join(cells)
                  + f" | {median['packed'] / median['fp32' if is_head else 'int8']:9.2f}"
                  + f" {median['packed'] / median['dense']:10.2f}"
                  + f" {median['dequantized'] / median['packed']:8.2f}"
                  + (f"   tiles/packed {median['tiles'] / median['packed']:.2f}" if "tiles" in median else "")
                  + (f"   int8 tiles/packed {median['int8 tiles'] / median['packed']:.2f}"
                     if "int8 tiles" in median else "")
                  + (f"   int16 tiles/packed {median['int16 tiles'] / median['packed']:.2f}"
                     if "int16 tiles" in median else ""),
                  flush=True)


if __name__ == "__main__":
    main()
