"""The panel GEMM of two source trees side by side in one process (a kernel change, before vs after).

    git archive HEAD workers/kernels/csrc | tar -x -C /tmp/before
    .venv/bin/python -m bench.bench_kernels_ab /tmp/before/workers/kernels/csrc workers/kernels/csrc \\
        --threads 2 --rows 8,16,32

Each tree's csrc is compiled into its own library with the flags the workers use
(workers/kernels/native.py), and both run SmolLM2-135M's decode products (30 layers and the
lm_head, random weights, each its own tensor so that every product streams its weight from
memory), alternating; the median of --repeats passes per tree and row count is printed.
Only for CPUs with the fp32 panel GEMM (AVX2 or AVX-512).
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads OpenMP

import argparse  # noqa: E402
import ctypes  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

from bench.bench_linear import HIDDEN, INTERMEDIATE, LAYERS, QKV, VOCAB  # noqa: E402
from workers.kernels.native import CFLAGS, SOURCES, compiler  # noqa: E402
from workers.linear import pack_panels  # noqa: E402


def load_panel_gemm(source_dir: Path, library: Path):
    subprocess.run([compiler(), *CFLAGS, "-o", str(library), *(str(source_dir / n) for n in SOURCES), "-lm"],
                   check=True)
    lib = ctypes.CDLL(str(library))
    if not lib.rayllm_panel_gemm_available():
        raise SystemExit(f"{source_dir}: this CPU's build has no fp32 panel GEMM (it needs AVX2 or AVX-512)")
    gemm = lib.rayllm_panel_gemm
    gemm.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 3 + [ctypes.c_int32]
    gemm.restype = ctypes.c_int
    return gemm


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("before", type=Path, help="a csrc directory")
    parser.add_argument("after", type=Path, help="another csrc directory")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rows", default="1,8,16")
    parser.add_argument("--repeats", type=int, default=11)
    args = parser.parse_args()
    build_dir = Path(tempfile.mkdtemp(prefix="kernels_ab_"))
    trees = {"before": load_panel_gemm(args.before, build_dir / "before.so"),
             "after": load_panel_gemm(args.after, build_dir / "after.so")}
    shapes = [(QKV, HIDDEN), (HIDDEN, HIDDEN), (2 * INTERMEDIATE, HIDDEN), (HIDDEN, INTERMEDIATE)] * LAYERS
    shapes.append((VOCAB, HIDDEN))
    print(f"packing {len(shapes)} weights", flush=True)
    weights = [(pack_panels(torch.randn(n, k)).contiguous(), n, k) for n, k in shapes]
    print(f"threads {args.threads} | ms per step's products (median of {args.repeats}, alternating)")
    for rows in (int(r) for r in args.rows.split(",")):
        inputs = {k: torch.randn(rows, k) for k in (HIDDEN, INTERMEDIATE)}
        outputs = {n: torch.empty(rows, n) for n, _ in shapes}
        times: dict[str, list[float]] = {name: [] for name in trees}
        for _ in range(args.repeats):
            for name, gemm in trees.items():
                start = time.perf_counter()
                for weight, n, k in weights:
                    gemm(inputs[k].data_ptr(), weight.data_ptr(), None, outputs[n].data_ptr(), rows, n, k, args.threads)
                times[name].append((time.perf_counter() - start) * 1e3)
        before, after = (statistics.median(times[name]) for name in trees)
        print(f"rows {rows:5d} | before {before:7.2f} | after {after:7.2f} | after/before {after / before:.2f}", flush=True)


if __name__ == "__main__":
    main()
