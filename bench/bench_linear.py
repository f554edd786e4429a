"""A decode step's matrix products, our linear paths side by side, weights streamed from DRAM.

    .venv/bin/python -m bench.bench_linear                     # 1 thread, rows 1,2,4,8,16
    .venv/bin/python -m bench.bench_linear --threads 2 --rows 1,8,16
    .venv/bin/python -m bench.bench_linear --rows 512,1024,2048 --repeats 2   # prefill steps

Random weights of SmolLM2-135M's shapes (30 layers of qkv, o, gate_up, down, then the
lm_head: 538 MB in fp32), each its own tensor, so every product reads its weight from memory
as a real step does (a benchmark that repeats one small weight measures the cache instead).
Per row count, the median over --repeats passes of all of them, the paths alternating:

- panels: the AVX2 panel GEMM (workers/linear.py, PanelWeight), where this CPU has it, at
  every row count (past PANEL_MAX_ROWS too, which is what the cutoff is judged by);
- gemv/onednn: our GEMV up to GEMV_MAX_ROWS rows, oneDNN's prepacked GEMM above (DualWeight),
  the path of AVX-512 CPUs.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads OpenMP

import argparse  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402

from workers.linear import DualWeight, NativeLinear, PanelWeight, pack_panels  # noqa: E402

HIDDEN, INTERMEDIATE, QKV, VOCAB, LAYERS = 576, 1536, 960, 49152, 30


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rows", default="1,2,4,8,16")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    native = NativeLinear()
    if not native.has_panels:
        print("this CPU's kernels have no panel GEMM (AVX-512 builds use the GEMV and oneDNN): nothing to compare")
        return
    shapes = [(QKV, HIDDEN), (HIDDEN, HIDDEN), (2 * INTERMEDIATE, HIDDEN), (HIDDEN, INTERMEDIATE)] * LAYERS
    shapes.append((VOCAB, HIDDEN))
    print(f"packing {len(shapes)} weights ({sum(n * k for n, k in shapes) * 4 / 1e6:.0f} MB fp32 each way)", flush=True)
    panels, duals = [], []
    for out_features, in_features in shapes:
        weight = torch.randn(out_features, in_features)
        panel = PanelWeight(pack_panels(weight), native.onednn.pack(weight), out_features)
        panels.append(panel)
        duals.append(DualWeight(weight, panel.packed))
    print(f"threads {args.threads} | ms per step's products (median of {args.repeats})")
    for rows in (int(r) for r in args.rows.split(",")):
        inputs = {width: torch.randn(rows, width) for width in (HIDDEN, INTERMEDIATE)}
        times: dict[str, list[float]] = {"panels": [], "gemv/onednn": []}
        for _ in range(args.repeats):
            for name, weights in (("panels", panels), ("gemv/onednn", duals)):
                started = time.perf_counter()
                for weight in weights:
                    if isinstance(weight, PanelWeight):
                        native._panel_gemm(inputs[weight.panels.shape[1]], weight, None)
                    else:
                        native.linear(inputs[weight.plain.shape[1]], weight)
                times[name].append(time.perf_counter() - started)
        panel_s, other_s = (statistics.median(times[name]) for name in ("panels", "gemv/onednn"))
        print(f"rows {rows:3d}: panels {panel_s * 1e3:7.1f}   gemv/onednn {other_s * 1e3:7.1f}   "
              f"ratio {other_s / panel_s:.2f}x", flush=True)


if __name__ == "__main__":
    main()
