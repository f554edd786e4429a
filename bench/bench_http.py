"""The served product over HTTP vs the in-process engine, same workload, same run (issue 4).

    .venv/bin/python -m bench.bench_http                            # SmolLM2, 1 repeat
    .venv/bin/python -m bench.bench_http --repeats 2 --worker-threads 1

1. HTTP: a local Ray (`ray.init(address="local")`, `--ray-num-cpus` logical CPUs) and our app
   (serve_app.app:build_app: 1 worker with `--worker-threads` torch threads, 1 ingress
   replica, the scheduler actor; Serve's proxy on 127.0.0.1:`--port`), driven by
   bench/serving_client.py's machinery: `--num-prompts` random prompts of `--input-len`
   tokens (bench/datasets.py), `--output-len` tokens each with ignore_eos, greedy, streaming
   /v1/completions, at most `--max-concurrency` in flight, after one untimed request alone
   (as vLLM's client does). Then the app and Ray are shut down (only what this process started).
2. In-process: a fresh Engine (scheduler/engine.py) over a ModelRunner with the same
   settings (threads, KV pool, token budget, max seqs, prefix caching on), the same prompts
   tokenized as the ingress does, the same untimed first request, then every request through
   a semaphore of `--max-concurrency`; each request's clock starts when it gets a slot, as the
   client's does, and its metrics go through the same bench/metrics.py.

Reported per run: output tokens/s, TTFT p50/p99, TPOT p50, ITL p99 for both sides, and the
ratio HTTP / in-process output tokens/s (target >= 0.8: Ray + HTTP + ingress cost under 20%).
During each run, the CPU seconds of every process this benchmark started (HTTP: worker,
scheduler, ingress, proxy, raylet, GCS, the client itself; in-process: this one process)
are read from /proc before and after, to show where a 2-core machine's time goes.
With --repeats, run r uses prompts seeded seed + r on both sides (so a later HTTP run does
not hit the prefix cache of an earlier one); the server is started once.

OMP_WAIT_POLICY=PASSIVE is set when unset, before Ray starts, so the worker actor inherits
it (the app itself does not set it); the worker's environment is read back and printed.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads OpenMP; Ray's workers inherit it
for _key, _value in (("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0"), ("RAY_USAGE_STATS_ENABLED", "0"),
                     ("RAY_AUTH_MODE", "disabled")):
    os.environ.setdefault(_key, _value)

import argparse  # noqa: E402
import asyncio  # noqa: E402
import json  # noqa: E402
import socket  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

from bench import datasets  # noqa: E402
from bench.metrics import RequestResult, calculate_metrics  # noqa: E402
from bench.serving_client import RunConfig, fetch_models, run_requests  # noqa: E402

PERCENTILES = [50.0, 90.0, 99.0]
APP_NAME = "rayllm-bench"
GIB = 1 << 30


def load_avg() -> str:
    one, five, fifteen = os.getloadavg()
    return f"{one:.2f} {five:.2f} {fifteen:.2f}"


# --- the processes this benchmark started (/proc, Linux) -------------------------------------------
def _descendants(root: int) -> dict[int, str]:
    """pid -> short name of root and every process below it."""
    parents, names = {}, {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes().split(b"\0")[0].decode(errors="replace")
        except OSError:
            continue
        pid = int(entry.name)
        parents[pid] = int(stat.rsplit(")", 1)[1].split()[1])
        names[pid] = cmdline.split("/")[-1] if not cmdline.startswith("ray::") else cmdline.split(" ")[0]
    found, frontier = {root: "client (this process)"}, [root]
    while frontier:
        parent = frontier.pop()
        for pid, ppid in parents.items():
            if ppid == parent and pid not in found:
                found[pid] = names.get(pid, "?")
                frontier.append(pid)
    return found


def cpu_seconds_by_process() -> dict[str, float]:
    """Name -> user + system CPU seconds so far, over the processes this benchmark started."""
    ticks = os.sysconf("SC_CLK_TCK")
    totals: dict[str, float] = {}
    for pid, name in _descendants(os.getpid()).items():
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        totals[name] = totals.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / ticks
    return totals


def worker_environment(keys: tuple[str, ...] = ("OMP_WAIT_POLICY", "OMP_NUM_THREADS")) -> dict[str, str | None]:
    for pid, name in _descendants(os.getpid()).items():
        if name.startswith("ray::WorkerActor"):
            try:
                pairs = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            except OSError:
                break
            env = dict(p.decode(errors="replace").split("=", 1) for p in pairs if b"=" in p)
            return {key: env.get(key) for key in keys}
    return {key: "(worker process not found)" for key in keys}


def cpu_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    delta = {name: after[name] - before.get(name, 0.0) for name in after}
    return dict(sorted(((n, round(s, 1)) for n, s in delta.items() if s >= 0.05), key=lambda kv: -kv[1]))


# --- HTTP ----------------------------------------------------------------------------------------
def app_args(args: argparse.Namespace, model_dir: Path) -> dict:
    return {
        "model": str(model_dir), "name": APP_NAME, "num_workers": 1, "worker_num_cpus": args.worker_threads,
        "block_size": args.block_size, "kv_cache_memory_gb": args.kv_cache_memory_gb,
        "max_num_batched_tokens": args.max_num_batched_tokens, "max_num_seqs": args.max_num_seqs,
        "enable_prefix_caching": True,
    }


def check_port_free(port: int) -> None:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            raise SystemExit(f"127.0.0.1:{port} is in use; pick another --port") from None


def http_phase(args: argparse.Namespace, model_dir: Path, workloads: list[list[datasets.SampleRequest]]) -> list[dict]:
    import ray
    from ray import serve

    from serve_app.app import build_app

    check_port_free(args.port)
    base_url = f"http://127.0.0.1:{args.port}"
    runs = []
    ray.init(address="local", num_cpus=args.ray_num_cpus, include_dashboard=False, log_to_driver=False)
    try:
        started = time.perf_counter()
        serve.start(http_options={"host": "127.0.0.1", "port": args.port})
        serve.run(build_app(app_args(args, model_dir)), name=APP_NAME, route_prefix="/")
        model = asyncio.run(fetch_models(base_url))[0]["id"]
        print(f"  server up in {time.perf_counter() - started:.0f} s at {base_url} (model id {model!r}); worker "
              f"environment {worker_environment()}", flush=True)
        for repeat, requests in enumerate(workloads):
            cfg = RunConfig(base_url=base_url, model=model, ignore_eos=True, temperature=0.0,
                            max_concurrency=args.max_concurrency, seed=args.seed + repeat, disable_tqdm=True)
            load_before, cpu_before = load_avg(), cpu_seconds_by_process()
            results, duration = asyncio.run(run_requests(cfg, requests))
            cpu = cpu_delta(cpu_before, cpu_seconds_by_process())
            runs.append(summarize("http", repeat, results, duration, load_before) | {"cpu_s": cpu})
            print_run(runs[-1])
    finally:
        serve.shutdown()
        ray.shutdown()
    return runs


# --- in-process engine --------------------------------------------------------------------------------
async def engine_request(engine, sem: asyncio.Semaphore, request_id: str, prompt: list[int],
                         max_tokens: int) -> RequestResult:
    from scheduler.outputs import EngineRequest
    from scheduler.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    async with sem:
        result = RequestResult(prompt_len=len(prompt), usage_reported=True)
        start = last = result.start_time = time.perf_counter()
        stream = engine.add_request(EngineRequest(request_id, prompt, params))
        async for delta in stream:
            if not delta.new_token_ids:
                continue
            now = time.perf_counter()
            if result.chunk_times:
                result.itl.append(now - last)
            else:
                result.ttft = now - start
            result.chunk_times.append(now - start)
            result.output_tokens += len(delta.new_token_ids)
            last = now
        result.latency = last - start
        result.cached_tokens = stream.num_cached_tokens
        result.success = bool(result.chunk_times)
        return result


async def engine_run(engine, prompts: list[list[int]], args: argparse.Namespace, tag: str):
    """The untimed first request alone, then all of them through the semaphore."""
    sem = asyncio.Semaphore(args.max_concurrency)
    await engine_request(engine, sem, f"{tag}-initial", prompts[0], args.output_len)
    start = time.perf_counter()
    results = await asyncio.gather(*(engine_request(engine, sem, f"{tag}-{i}", p, args.output_len)
                                     for i, p in enumerate(prompts)))
    return list(results), time.perf_counter() - start


def engine_phase(args: argparse.Namespace, model_dir: Path,
                 workloads: list[list[datasets.SampleRequest]]) -> list[dict]:
    from transformers import AutoTokenizer

    from scheduler.config import SchedulerConfig
    from scheduler.engine import Engine
    from workers.model_runner import ModelRunner, RunnerConfig

    runner = ModelRunner(RunnerConfig(
        model=str(model_dir), block_size=args.block_size, kv_cache_memory_bytes=int(args.kv_cache_memory_gb * GIB),
        num_threads=args.worker_threads, seed=0,
    ))
    info = runner.model_info
    config = SchedulerConfig(max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs,
                             block_size=info.block_size, num_blocks=info.num_blocks, max_model_len=info.max_model_len,
                             enable_prefix_caching=True)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    runs = []
    for repeat, requests in enumerate(workloads):
        prompts = [tokenizer.encode(r.prompt, add_special_tokens=True) for r in requests]  # as the ingress does
        # a fresh engine: an empty prefix cache, as the server had for these prompts
        engine = Engine(config, runner, eos_token_ids=info.eos_token_ids)
        try:
            load_before, cpu_before = load_avg(), cpu_seconds_by_process()
            results, duration = asyncio.run(engine_run(engine, prompts, args, f"r{repeat}"))
            cpu = cpu_delta(cpu_before, cpu_seconds_by_process())  # the initial request included, as on the HTTP side
        finally:
            engine.close()
        runs.append(summarize("engine", repeat, results, duration, load_before) | {"cpu_s": cpu})
        print_run(runs[-1])
    return runs


# --- report -----------------------------------------------------------------------------------------
def summarize(side: str, repeat: int, results: list[RequestResult], duration: float, load_before: str) -> dict:
    metrics = calculate_metrics(results, duration, PERCENTILES)
    keep = ("completed", "failed", "duration", "total_input_tokens", "total_output_tokens", "output_throughput",
            "total_cached_tokens", "median_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "p99_itl_ms", "median_e2el_ms")
    return {"side": side, "repeat": repeat, "load_before": load_before, "load_after": load_avg()} | {
        key: metrics[key] for key in keep}


def print_run(run: dict) -> None:
    cpu = f", CPU s {run['cpu_s']}" if "cpu_s" in run else ""
    print(f"  run {run['repeat']} {run['side']:>6}: {run['completed']}/{run['completed'] + run['failed']} ok, "
          f"{run['duration']:.1f} s, {run['total_input_tokens']} in / {run['total_output_tokens']} out tokens "
          f"(cached {run['total_cached_tokens']}), {run['output_throughput']:.1f} out tok/s, TTFT p50 "
          f"{run['median_ttft_ms']:.0f} ms p99 {run['p99_ttft_ms']:.0f} ms, TPOT p50 {run['median_tpot_ms']:.0f} ms, "
          f"ITL p99 {run['p99_itl_ms']:.0f} ms | load {run['load_before']} -> {run['load_after']}{cpu}", flush=True)


def print_table(http_runs: list[dict], engine_runs: list[dict]) -> None:
    header = (f"{'run':>3} | {'HTTP tok/s':>10} | {'engine tok/s':>12} | {'ratio':>5} | {'HTTP TTFT p50/p99 ms':>20} | "
              f"{'engine TTFT p50/p99 ms':>22} | {'HTTP TPOT p50':>13} | {'engine TPOT p50':>15}")
    print("\n" + header + "\n" + "-" * len(header))
    for http, engine in zip(http_runs, engine_runs):
        ratio = http["output_throughput"] / engine["output_throughput"]
        print(f"{http['repeat']:>3} | {http['output_throughput']:>10.1f} | {engine['output_throughput']:>12.1f} | "
              f"{ratio:>5.2f} | {http['median_ttft_ms']:>9.0f} / {http['p99_ttft_ms']:<8.0f} | "
              f"{engine['median_ttft_ms']:>10.0f} / {engine['p99_ttft_ms']:<9.0f} | "
              f"{http['median_tpot_ms']:>10.1f} ms | {engine['median_tpot_ms']:>12.1f} ms")
    print("target: HTTP / engine output tok/s >= 0.8")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="local HF directory (default: SmolLM2-135M-Instruct)")
    p.add_argument("--port", type=int, default=8000, help="Serve's HTTP port on 127.0.0.1")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--max-concurrency", type=int, default=16)
    p.add_argument("--worker-threads", type=int, default=2,
                   help="torch threads of the worker (its worker_num_cpus) and of the in-process runner")
    p.add_argument("--ray-num-cpus", type=int, default=4,
                   help="logical CPUs of the local Ray (bookkeeping only: worker + 0.25 scheduler + 0.25 ingress)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--kv-cache-memory-gb", type=float, default=1.0)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--skip-http", action="store_true")
    p.add_argument("--skip-engine", action="store_true")
    p.add_argument("--result-json", default=None)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", str(args.worker_threads))
    from workers.loader import resolve_model_path

    model_dir = resolve_model_path(args.model)
    tok = datasets.PromptTokenizer(model_dir)
    workloads = [datasets.random_requests(tok, num_prompts=args.num_prompts, input_len=args.input_len,
                                          output_len=args.output_len, seed=args.seed + r) for r in range(args.repeats)]
    print(f"model {model_dir} | {args.num_prompts} requests x {args.input_len} prompt tokens, {args.output_len} "
          f"output (ignore_eos, greedy), concurrency {args.max_concurrency} | worker threads {args.worker_threads} | "
          f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY')} | {os.cpu_count()} CPUs | load average before "
          f"{load_avg()}", flush=True)
    http_runs = [] if args.skip_http else http_phase(args, model_dir, workloads)
    engine_runs = [] if args.skip_engine else engine_phase(args, model_dir, workloads)
    if http_runs and engine_runs:
        print_table(http_runs, engine_runs)
    print(f"load average after {load_avg()}")
    if args.result_json:
        with open(args.result_json, "w") as f:
            json.dump({"args": vars(args), "http": http_runs, "engine": engine_runs}, f, indent=1)


if __name__ == "__main__":
    main()
