"""A kernel of two source trees side by side in one process (a kernel change, before vs after).

    git archive HEAD workers/kernels/csrc | tar -x -C /tmp/before
    .venv/bin/python -m bench.bench_kernels_ab /tmp/before/workers/kernels/csrc workers/kernels/csrc \\
        --threads 2 --rows 8,16,32
    .venv/bin/python -m bench.bench_kernels_ab /tmp/before/workers/kernels/csrc workers/kernels/csrc \\
        --product gguf --threads 2 --rows 1,16,2048 --repeats 5

Each tree's csrc is compiled into its own library with the flags the workers use
(workers/kernels/native.py), and both run SmolLM2-135M's products, alternating; the median of
--repeats passes per tree and row count is printed. --product panel (the default): the fp32
panel GEMM over a decode step's products (30 layers and the lm_head, random weights, each its
own tensor so that every product streams its weight from memory; only for CPUs with the fp32
panel GEMM, AVX2 or AVX-512). --product gguf: the int8 GGUF kernel over the 30 layers' fused
products (qkv, o, gate_up, down) in Q4_1 packed as the model packs it (the default model's
type), each its own tensor on 2 MB pages; the two trees' outputs must be bit-equal, as the kernels' one
arithmetic makes them (a row count of 2048 is a prompt step of 8 x 256 tokens). --product
gguf-head: the int16 kernel of the lm_head (packed Q8_0, the vocabulary by the hidden size),
two copies taken in turn so that each streams from memory, bit-equal too.
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
from workers.kernels.native import CFLAGS, SOURCES, compiler, load  # noqa: E402
from workers.linear import NativeLinear, pack_panels  # noqa: E402


def compile_tree(source_dir: Path, library: Path) -> None:
    """source_dir's kernels into the shared library `library`, with the workers' flags."""
    subprocess.run([compiler(), *CFLAGS, "-o", str(library), *(str(source_dir / n) for n in SOURCES), "-lm"],
                   check=True)


def load_panel_gemm(source_dir: Path, library: Path):
    compile_tree(source_dir, library)
    lib = ctypes.CDLL(str(library))
    if not lib.rayllm_panel_gemm_available():
        raise SystemExit(f"{source_dir}: this CPU's build has no fp32 panel GEMM (it needs AVX2 or AVX-512)")
    gemm = lib.rayllm_panel_gemm
    gemm.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 3 + [ctypes.c_int32]
    gemm.restype = ctypes.c_int
    return gemm


def run_gguf(args: argparse.Namespace, build_dir: Path) -> None:
    """The int8 GGUF kernel of both trees over the 30 layers' packed Q4_1 products, or (head) the
    int16 one over the lm_head's packed Q8_0."""
    from bench.bench_gguf import random_weight
    from workers.gguf_weight import GGMLType, pack_columns
    from workers.kernels.gguf import gguf_gemm

    libraries = {}
    for name, tree in (("before", args.before), ("after", args.after)):
        compile_tree(tree, build_dir / f"{name}.so")
        libraries[name] = load(build_dir / f"{name}.so")
    torch.set_num_threads(args.threads)  # the kernel's thread count (gguf.gguf_gemm reads it)
    if args.product == "gguf-head":
        mode, ggml_type, shapes, copies = "int16", GGMLType.Q8_0, [(VOCAB, HIDDEN)], 2
    else:
        mode, ggml_type, copies = "int8", GGMLType.Q4_1, LAYERS
        shapes = [(QKV, HIDDEN), (HIDDEN, HIDDEN), (2 * INTERMEDIATE, HIDDEN), (HIDDEN, INTERMEDIATE)]
    print(f"quantizing {len(shapes) * copies} weights", flush=True)
    one_layer = [pack_columns(random_weight(ggml_type, n, k)) for n, k in shapes]
    linear = NativeLinear()  # each copy's blocks on 2 MB pages, as the worker places them
    weights = [linear.pack(w) for _ in range(copies) for w in one_layer]
    print(f"threads {args.threads} | ms per step's products (median of {args.repeats}, alternating)")
    for rows in (int(r) for r in args.rows.split(",")):
        inputs = {k: torch.randn(rows, k) for k in (HIDDEN, INTERMEDIATE)}
        outputs = {name: [gguf_gemm(inputs[w.in_features], w, mode=mode, library=lib) for w in weights[:4]]
                   for name, lib in libraries.items()}
        if not all(torch.equal(a, b) for a, b in zip(outputs["before"], outputs["after"])):
            raise SystemExit(f"rows {rows}: the two trees' products differ")
        times: dict[str, list[float]] = {name: [] for name in libraries}
        for repeat in range(args.repeats):
            order = list(libraries.items()) if repeat % 2 == 0 else list(reversed(libraries.items()))
            for name, lib in order:
                start = time.perf_counter()
                for weight in weights:
                    gguf_gemm(inputs[weight.in_features], weight, mode=mode, library=lib)
                times[name].append((time.perf_counter() - start) * 1e3)
        before, after = (statistics.median(times[name]) for name in libraries)
        print(f"rows {rows:5d} | before {before:8.2f} | after {after:8.2f} | after/before {after / before:.2f}",
              flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("before", type=Path, help="a csrc directory")
    parser.add_argument("after", type=Path, help="another csrc directory")
    parser.add_argument("--product", default="panel", choices=("panel", "gguf", "gguf-head"))
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rows", default="1,8,16")
    parser.add_argument("--repeats", type=int, default=11)
    args = parser.parse_args()
    build_dir = Path(tempfile.mkdtemp(prefix="kernels_ab_"))
    if args.product in ("gguf", "gguf-head"):
        run_gguf(args, build_dir)
        return
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
