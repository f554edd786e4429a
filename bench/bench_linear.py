"""A decode step's matrix products, our linear paths side by side, weights streamed from DRAM.

    .venv/bin/python -m bench.bench_linear                     # fp32, 1 thread, rows 1,2,4,8,16
    .venv/bin/python -m bench.bench_linear --dtype bfloat16 --threads 2 --rows 1,16,64,512
    .venv/bin/python -m bench.bench_linear --rows 512,1024,2048 --repeats 2   # prefill steps

Random weights of SmolLM2-135M's shapes (30 layers of qkv, o, gate_up, down, then the
lm_head, each its own tensor, so every product reads its weight from memory as a real step
does; a benchmark that repeats one small weight measures the cache instead). Per row count,
the median over --repeats passes of all of them, the paths alternating:

- panels: our panel GEMM (workers/linear.py, PanelWeight: fp32 on AVX2 or AVX-512, bf16 on
  AVX512_BF16), at every row count (past its row limit too, which is what the limit is
  judged by);
- onednn: oneDNN's prepacked GEMM, at every row count;
- gemv: our GEMV, at the rows it takes (GEMV_MAX_ROWS);
- tiles: our AMX tile GEMM over the same bf16 panels (csrc/amx.c), bf16 on a CPU whose OS grants
  tile data (workers/kernels/cpu_isa.py), at every row count: what its TILE_MIN_ROWS is judged by.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads OpenMP

import argparse  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402

from workers.kernels.cpu_isa import cpu_plan  # noqa: E402
from workers.linear import GEMV_MAX_ROWS, NativeLinear, gemv  # noqa: E402

HIDDEN, INTERMEDIATE, QKV, VOCAB, LAYERS = 576, 1536, 960, 49152, 30


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rows", default="1,2,4,8,16")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    native = NativeLinear()
    if not (native.has_panels if dtype == torch.float32 else native.has_bf16_panels):
        print(f"this CPU's kernels have no {args.dtype} panel GEMM: nothing to compare")
        return
    shapes = [(QKV, HIDDEN), (HIDDEN, HIDDEN), (2 * INTERMEDIATE, HIDDEN), (HIDDEN, INTERMEDIATE)] * LAYERS
    shapes.append((VOCAB, HIDDEN))
    print(f"packing {len(shapes)} weights ({sum(n * k for n, k in shapes) * dtype.itemsize / 1e6:.0f} MB {args.dtype} "
          "each way)",
          flush=True)
    plain = [torch.randn(out_features, in_features).to(dtype) for out_features, in_features in shapes]
    packed = [native.pack(weight) for weight in plain]
    onednn = [panel.packed if panel.packed is not None else native.onednn.pack(weight)
              for weight, panel in zip(plain, packed)]  # bf16 panels keep no oneDNN copy: one for the comparison
    limit = packed[0].max_rows
    tiles = dtype == torch.bfloat16 and cpu_plan().amx
    print(f"{args.dtype} | threads {args.threads} | ms per step's products (median of {args.repeats}); panels take "
          f"{'every row count' if limit is None else f'up to {limit} rows'} when serving")

    def step(path: str, inputs: dict[int, torch.Tensor]) -> None:
        for weight, panel, reordered in zip(plain, packed, onednn):
            x = inputs[weight.shape[1]]
            if path == "panels":
                panel.panel_gemm(x, None, dtype)
            elif path == "tiles":
                panel.tile_gemm(x, None, dtype)
            elif path == "onednn":
                native.onednn.linear(x, reordered)
            else:
                gemv(native.library, x, weight, None, dtype)

    for rows in (int(r) for r in args.rows.split(",")):
        inputs = {width: torch.randn(rows, width).to(dtype) for width in (HIDDEN, INTERMEDIATE)}
        paths = ["panels", "onednn"] + (["gemv"] if rows <= GEMV_MAX_ROWS else []) + (["tiles"] if tiles else [])
        times: dict[str, list[float]] = {path: [] for path in paths}
        for _ in range(args.repeats):
            for path in paths:
                started = time.perf_counter()
                step(path, inputs)
                times[path].append(time.perf_counter() - started)
        medians = {path: statistics.median(spent) for path, spent in times.items()}
        print(f"rows {rows:4d}: " + "   ".join(f"{path} {s * 1e3:8.1f}" for path, s in medians.items())
              + f"   onednn / panels {medians['onednn'] / medians['panels']:.2f}x"
              + (f"   tiles / panels {medians['tiles'] / medians['panels']:.2f}x" if tiles else ""), flush=True)


if __name__ == "__main__":
    main()
