"""The served product on a GPU against the same engine in-process: what the serving path costs
where the model step is fast: on a GPU node the per-step overhead of the serving path is what
leaves the GPU idle between steps.

    python -m bench.bench_gpu_served --tokenizer-dir <dir with SmolLM2's tokenizer.json>

One process, no `serve run` (the GPU machines lent here have no Ray CLI on the PATH, and
reach no model hub): random weights in SmolLM2-135M's shapes (bench.bench_gpu) with the real
tokenizer, then per concurrency:

- in-process: our Engine over a CUDA ModelRunner (Triton attention, decode CUDA graphs), in a
  child process that frees the GPU when it ends;
- served: a local Ray with the GPU, the app of serve_app.app with `worker_device: cuda` and the
  same scheduler settings, streaming /v1/completions through Serve's proxy, with the serving
  environment of deploy/serve.env.

Random prompts of --input-len tokens, exactly --output-len new tokens (ignore_eos, greedy),
each side run --repeats times. The ratio HTTP / in-process of the last repeats is the number to
read: the first in-process pass compiles Triton's kernels for the workload's shapes, which a
served worker does before /health turns 200. `--device cpu` runs the same flow on a
CPU (to check the script without a GPU).
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import shutil
import tempfile
import time
from pathlib import Path

from bench import datasets
from bench.bench_gpu import SMOLLM2_135M, write_random_model
from bench.bench_http import build_engine, engine_request, engine_requests, print_run, summarize
from bench.served_app import read_env_file, serve_here

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")


def app_args(args: argparse.Namespace, model_dir: Path) -> dict:
    return {
        "model": str(model_dir), "served_model_name": "bench", "worker_device": args.device, "num_workers": 1,
        "dtype": args.dtype, "block_size": 16, "kv_cache_memory_gb": args.kv_cache_memory_gb,
        "max_num_batched_tokens": args.max_num_batched_tokens, "max_num_seqs": args.max_num_seqs,
        "worker_num_cpus": 1,
    }


def in_process(settings: dict, device: str, workloads: list[list[list[int]]], output_len: int, concurrency: int,
               results) -> None:
    """multiprocessing target: the workload through an in-process Engine, `repeats` times; puts
    (results, duration) of each."""
    engine = build_engine(settings, device=device)

    async def run(repeat: int, prompts: list[list[int]]) -> tuple[list, float]:
        await engine_request(engine, asyncio.Semaphore(1), f"{repeat}-initial", prompts[0], output_len)
        done, start, end = await engine_requests(engine, prompts, output_len, concurrency, str(repeat))
        return done, end - start

    for repeat, prompts in enumerate(workloads):
        results.put(asyncio.run(run(repeat, prompts)))
    engine.close()


def wait_for_result(results, child) -> tuple[list, float]:
    """The child's next result; raises as soon as the child died without one (a CUDA error,
    say), instead of waiting for the caller's timeout on scarce device time."""
    import queue

    while True:
        try:
            return results.get(timeout=5)
        except queue.Empty:
            if not child.is_alive():
                raise RuntimeError(f"the in-process engine exited ({child.exitcode}) without a result") from None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokenizer-dir", type=Path, required=True)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--concurrency", default="16,64", help="comma-separated")
    parser.add_argument("--requests-per-slot", type=int, default=8, help="requests = this x concurrency")
    parser.add_argument("--repeats", type=int, default=2, help="per side; the ratio uses the last (the first warms "
                        "Triton's kernels for the workload's shapes in-process, as a served worker does before /health)")
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--kv-cache-memory-gb", type=float, default=4.0)
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    for key, value in read_env_file().items():  # the serving environment, before Ray starts
        os.environ.setdefault(key, value)

    model_dir = Path(tempfile.mkdtemp(prefix="bench-gpu-served-"))
    write_random_model(model_dir, SMOLLM2_135M)
    for name in TOKENIZER_FILES:
        if (args.tokenizer_dir / name).exists():
            shutil.copy(args.tokenizer_dir / name, model_dir / name)
    tok = datasets.PromptTokenizer(str(model_dir))
    settings = app_args(args, model_dir)
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    workloads = {c: [datasets.random_requests(tok, num_prompts=args.requests_per_slot * c, input_len=args.input_len,
                                              output_len=args.output_len, seed=1000 * c + repeat)
                     for repeat in range(args.repeats)] for c in concurrencies}  # no prompt shared between runs
    print(f"{args.device} {args.dtype} | random SmolLM2-135M weights | {args.input_len} in / {args.output_len} out, "
          f"ignore_eos, greedy | concurrency {concurrencies}, {args.requests_per_slot} requests per slot, "
          f"{args.repeats} repeats", flush=True)

    from transformers import AutoTokenizer

    hf_tokenizer = AutoTokenizer.from_pretrained(model_dir)
    context = multiprocessing.get_context("spawn")
    engine_rows = {}
    for c, runs in workloads.items():
        prompts = [[hf_tokenizer.encode(r.prompt, add_special_tokens=True) for r in requests] for requests in runs]
        results = context.Queue()
        child = context.Process(target=in_process, args=(settings, args.device, prompts, args.output_len, c, results))
        child.start()
        for repeat in range(args.repeats):
            done, duration = wait_for_result(results, child)
            engine_rows[c] = summarize(f"in-process c{c}", repeat, done, duration, "-")
            print_run(engine_rows[c])
        child.join()

    from bench.serving_client import RunConfig, run_requests

    try:
        started = time.perf_counter()
        with serve_here(settings, name="bench", num_gpus=1 if args.device == "cuda" else 0) as base_url:
            print(f"served in {time.perf_counter() - started:.0f} s at {base_url}", flush=True)
            for c, runs in workloads.items():
                for repeat, requests in enumerate(runs):
                    cfg = RunConfig(base_url=base_url, model="bench", ignore_eos=True, temperature=0.0,
                                    max_concurrency=c, seed=1000 * c + repeat, disable_tqdm=True)
                    results, duration = asyncio.run(run_requests(cfg, requests))
                    row = summarize(f"HTTP c{c}", repeat, results, duration, "-")
                    print_run(row)
                print(f"concurrency {c}: HTTP / in-process output tok/s = "
                      f"{row['output_throughput'] / engine_rows[c]['output_throughput']:.2f}", flush=True)
    finally:
        shutil.rmtree(model_dir, ignore_errors=True)

if __name__ == "__main__":
    main()
