"""The served product over HTTP vs the in-process engine, same workload, same run.

    .venv/bin/python -m bench.bench_http                   # deploy/serve.yaml + deploy/serve.env as shipped
    .venv/bin/python -m bench.bench_http --repeats 2 --variant previous:env-file=none
    .venv/bin/python -m bench.bench_http --variant before:env-file=none,code=/tmp/before --variant shipped
    .venv/bin/python -m bench.bench_http --variant shipped --variant direct:target=direct \\
        --variant grpc-only:env-file=none,RAY_SERVE_USE_GRPC_BY_DEFAULT=1

1. HTTP, once per --variant: our app started as a user starts it (bench/served_app.py:
   `serve run` of --config, with its own local Ray, dashboard included, in its own session)
   with the serving environment of deploy/serve.env (what scripts/serve.sh exports) plus
   the variant's KEY=VALUE settings; driven by bench/serving_client.py's machinery:
   `--num-prompts` random prompts of `--input-len` tokens (bench/datasets.py), `--output-len`
   tokens each with ignore_eos, greedy, streaming /v1/completions, at most
   `--max-concurrency` in flight, after one untimed request alone (as vLLM's client does).
   A variant is NAME[:SETTING,SETTING...]; a setting is KEY=VALUE (an environment variable),
   `env-file=none` (start from Ray Serve's defaults, not deploy/serve.env), `target=direct`
   (send to the ingress replica's own HTTP port: Serve's direct ingress), `arg.KEY=VALUE`
   (an app arg over the YAML's) or `code=DIR` (the app runs another checkout's code, e.g.
   `git archive 89ff758 | tar -x -C /tmp/before`: the previous serving path, side by side).
2. In-process: the same engines with no serving stack. The config's num_workers engines
   (scheduler/engine.py over workers/model_runner.py, the YAML's threads, KV pool, token
   budget, max seqs, prefix caching), each in a process of its own (as the workers are), take
   the same prompts tokenized as the ingress does, request i on engine i mod num_workers, at
   most max-concurrency / num_workers in flight each, after the same untimed first request.

Reported per run: output tokens/s, TTFT p50/p99, TPOT p50, ITL p99 of each side, the ratio
HTTP / in-process output tokens/s (target: >= 0.9), and the CPU seconds of every
process of the app during the run from /proc, with the share taken by everything but the
worker processes (target: <= 8%). Run r uses prompts seeded seed + r on both sides.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from bench import datasets
from bench.metrics import RequestResult, calculate_metrics
from bench.served_app import (
    AppLaunch,
    cpu_by_process,
    cpu_rows,
    format_cpu_table,
    machine_busy_s,
    read_env_file,
    serving_share,
    start_app,
    stop_app,
)
from bench.serving_client import RunConfig, fetch_models, run_requests

PERCENTILES = [50.0, 90.0, 99.0]
REPO = Path(__file__).resolve().parent.parent


def load_avg() -> str:
    one, five, fifteen = os.getloadavg()
    return f"{one:.2f} {five:.2f} {fifteen:.2f}"


@dataclass(frozen=True, slots=True)
class Variant:
    name: str
    env: dict[str, str] = field(default_factory=dict)  # over the env file's
    use_env_file: bool = True  # False: Ray Serve's defaults plus `env`
    target: str = "proxy"  # proxy: Serve's HTTP port; direct: the ingress replica's own port
    app_args: dict[str, object] = field(default_factory=dict)
    code_dir: Path | None = None  # another checkout's code (e.g. `git archive` of an earlier commit)


def parse_variant(text: str) -> Variant:
    name, _, settings = text.partition(":")
    env, app_args, use_env_file, target, code_dir = {}, {}, True, "proxy", None
    for setting in filter(None, settings.split(",")):
        key, sep, value = setting.partition("=")
        if not sep:
            raise SystemExit(f"variant {name}: expected KEY=VALUE, got {setting!r}")
        if key == "env-file":
            use_env_file = value != "none"
        elif key == "target":
            assert value in ("proxy", "direct"), value
            target = value
        elif key == "code":
            code_dir = Path(value)
        elif key.startswith("arg."):
            app_args[key[4:]] = yaml.safe_load(value)
        else:
            env[key] = value
    return Variant(name, env, use_env_file, target, app_args, code_dir)


# --- HTTP ----------------------------------------------------------------------------------------
def http_runs(args: argparse.Namespace, variant: Variant, model_dir: Path,
              workloads: list[list[datasets.SampleRequest]]) -> list[dict]:
    env = {**(read_env_file(args.env_file) if variant.use_env_file else {}), **variant.env}
    launch = AppLaunch(config=args.config, port=args.port, model_dir=model_dir, env=env,
                       app_args={"served_model_name": "rayllm", **variant.app_args}, code_dir=variant.code_dir)
    started = time.perf_counter()
    app = start_app(launch)
    runs = []
    try:
        base_url = app.base_url
        if variant.target == "direct":
            base_url = app.direct_url()
            if base_url is None:
                raise RuntimeError(f"variant {variant.name}: no direct ingress port (is it enabled?)")
        model = asyncio.run(fetch_models(base_url))[0]["id"]
        print(f"  [{variant.name}] up in {time.perf_counter() - started:.0f} s at {base_url}, env {env}", flush=True)
        for repeat, requests in enumerate(workloads):
            cfg = RunConfig(base_url=base_url, model=model, ignore_eos=True, temperature=0.0,
                            max_concurrency=args.max_concurrency, seed=args.seed + repeat, disable_tqdm=True)
            load_before, cpu_before, busy_before = load_avg(), cpu_by_process(app.pid), machine_busy_s()
            results, duration = asyncio.run(run_requests(cfg, requests))
            rows = cpu_rows(cpu_before, cpu_by_process(app.pid))
            run = summarize(variant.name, repeat, results, duration, load_before)
            # CPU the machine spent outside the app (the client, other people's jobs): a noisy run shows here
            run["other_cpu_s"] = machine_busy_s() - busy_before - sum(row.cpu_s for row in rows)
            run["serving_cpu_share"] = serving_share(rows)
            run["cpu_table"] = format_cpu_table(rows)
            run["cpu_s"] = {f"{row.name} ({row.pid})": round(row.cpu_s, 2) for row in rows}
            runs.append(run)
            print_run(run)
            print(run["cpu_table"], flush=True)
        print(f"  [{variant.name}] workers: {worker_step_times(base_url)}", flush=True)
    finally:
        print(f"  [{variant.name}] stopped in {stop_app(app):.0f} s", flush=True)
    return runs


def worker_step_times(base_url: str) -> str:
    """Per worker, from /v1/server_info: steps, seconds with a step in flight, and seconds
    between a step's return and the next one's submission (the part no overlap hides)."""
    import urllib.request

    try:
        with urllib.request.urlopen(f"{base_url}/v1/server_info", timeout=10) as response:
            info = json.loads(response.read())
    except OSError as error:
        return f"(no /v1/server_info: {error})"
    workers = [w for shard in info.get("schedulers", []) for w in shard.get("workers", [])]
    return ", ".join(f"worker {w['worker']}: {w['num_steps']} steps, busy {w.get('busy_s', '?')} s, "
                     f"gap {w.get('gap_s', '?')} s" for w in workers)


# --- in-process engines, one process per worker -------------------------------------------------------
def engine_settings(config: Path, model_dir: Path) -> dict:
    """What each in-process engine needs from the deploy YAML, as the server would use it."""
    from serve_app.config import AppArgs

    raw = yaml.safe_load(config.read_text())["applications"][0]["args"]
    args = AppArgs.model_validate({**raw, "model": str(model_dir)})
    threads = args.worker_num_threads or max(1, math.floor(args.worker_num_cpus))
    return {"num_workers": args.num_workers, "threads": threads, "app_args": args.model_dump(mode="json")}


def build_engine(app_args: dict, device: str = "cpu", num_threads: int | None = None):
    """Our Engine (scheduler/engine.py) over a ModelRunner, both configured from the app's args
    as the server configures a worker and its scheduler: the in-process side of a served bench."""
    from scheduler.engine import Engine
    from serve_app.config import AppArgs
    from workers.model_runner import ModelRunner, RunnerConfig

    args = AppArgs.model_validate(app_args)
    runner = ModelRunner(RunnerConfig(
        model=args.model, device=device, dtype=args.dtype, block_size=args.block_size, num_blocks=args.num_kv_blocks,
        kv_cache_memory_bytes=args.kv_cache_memory_bytes, max_model_len=args.max_model_len,
        attention_backend=args.attention_backend, num_threads=num_threads, seed=0,
    ))
    info = runner.model_info
    config = args.scheduler_config(block_size=info.block_size, num_blocks=info.num_blocks,
                                   max_model_len=info.max_model_len)
    return Engine(config, runner, eos_token_ids=info.eos_token_ids)


def engine_shard(settings: dict, initial: list[int], prompts: list[list[int]], output_len: int, concurrency: int,
                 tag: str, barrier, results) -> None:
    """One worker's share, in a process of its own (multiprocessing target). `initial`: the
    untimed first request (the workload's first prompt, as the HTTP client sends it)."""
    os.environ["OMP_NUM_THREADS"] = str(settings["threads"])
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as the worker actors get it
    engine = build_engine(settings["app_args"], num_threads=settings["threads"])

    async def run() -> tuple[list[RequestResult], float, float]:
        await engine_request(engine, asyncio.Semaphore(1), f"{tag}-initial", initial, output_len)
        barrier.wait()  # every shard starts timing together
        return await engine_requests(engine, prompts, output_len, concurrency, tag)

    cpu_before = sum(os.times()[:2])
    done, start, end = asyncio.run(run())
    results.put((done, start, end, sum(os.times()[:2]) - cpu_before))
    engine.close()


async def engine_requests(engine, prompts: list[list[int]], output_len: int, concurrency: int,
                          tag: str) -> tuple[list[RequestResult], float, float]:
    """The prompts through the engine, at most `concurrency` in flight, greedy, ignore_eos:
    (results in prompt order, start, end) on the perf_counter clock."""
    sem = asyncio.Semaphore(concurrency)
    start = time.perf_counter()
    done = await asyncio.gather(*(engine_request(engine, sem, f"{tag}-{i}", p, output_len)
                                  for i, p in enumerate(prompts)))
    return list(done), start, time.perf_counter()


async def engine_request(engine, sem: asyncio.Semaphore, request_id: str, prompt: list[int],
                         max_tokens: int) -> RequestResult:
    """One request, timed chunk by chunk as bench/request_func.py times one over HTTP."""
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


def engine_runs(args: argparse.Namespace, model_dir: Path, workloads: list[list[datasets.SampleRequest]]) -> list[dict]:
    import multiprocessing

    from transformers import AutoTokenizer

    settings = engine_settings(args.config, model_dir)
    num_shards = settings["num_workers"]
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    context = multiprocessing.get_context("spawn")
    runs = []
    for repeat, requests in enumerate(workloads):
        prompts = [tokenizer.encode(r.prompt, add_special_tokens=True) for r in requests]  # as the ingress does
        barrier, results = context.Barrier(num_shards), context.Queue()
        concurrency = max(1, args.max_concurrency // num_shards)
        load_before, busy_before = load_avg(), machine_busy_s()
        shards = [context.Process(target=engine_shard, daemon=True,
                                  args=(settings, prompts[0], prompts[k::num_shards], args.output_len, concurrency,
                                        f"r{repeat}s{k}", barrier, results))
                  for k in range(num_shards)]
        for shard in shards:
            shard.start()
        answers = [results.get() for _ in shards]
        for shard in shards:
            shard.join()
        done = [result for answer in answers for result in answer[0]]
        duration = max(a[2] for a in answers) - min(a[1] for a in answers)
        run = summarize("in-process", repeat, done, duration, load_before)
        run["cpu_s"] = {f"engine shard {k}": round(a[3], 2) for k, a in enumerate(answers)}
        run["other_cpu_s"] = machine_busy_s() - busy_before - sum(a[3] for a in answers)
        runs.append(run)
        print_run(run)
    return runs


# --- report -----------------------------------------------------------------------------------------
def summarize(side: str, repeat: int, results: list[RequestResult], duration: float, load_before: str) -> dict:
    metrics = calculate_metrics(results, duration, PERCENTILES)
    keep = ("completed", "failed", "duration", "total_input_tokens", "total_output_tokens", "output_throughput",
            "total_cached_tokens", "median_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "p99_itl_ms", "median_e2el_ms")
    return {"side": side, "repeat": repeat, "load_before": load_before, "load_after": load_avg()} | {
        key: metrics[key] for key in keep}


def print_run(run: dict) -> None:
    share = f", serving CPU {run['serving_cpu_share']:.1%}" if "serving_cpu_share" in run else ""
    if "other_cpu_s" in run:
        share += f", CPU outside the app {run['other_cpu_s']:.1f} s"
    print(f"  run {run['repeat']} {run['side']}: {run['completed']}/{run['completed'] + run['failed']} ok, "
          f"{run['duration']:.1f} s, {run['total_output_tokens']} out tokens (cached {run['total_cached_tokens']}), "
          f"{run['output_throughput']:.1f} out tok/s, TTFT p50 {run['median_ttft_ms']:.0f} ms p99 "
          f"{run['p99_ttft_ms']:.0f} ms, TPOT p50 {run['median_tpot_ms']:.0f} ms, ITL p99 {run['p99_itl_ms']:.0f} ms"
          f"{share} | load {run['load_before']} -> {run['load_after']}", flush=True)


def print_table(http: dict[str, list[dict]], engine: list[dict]) -> None:
    header = (f"{'variant':>14} | {'run':>3} | {'HTTP tok/s':>10} | {'in-proc tok/s':>13} | {'ratio':>5} | "
              f"{'TTFT p50/p99 ms':>17} | {'TPOT p50':>8} | {'ITL p99':>7} | {'serving CPU':>11} | {'other CPU s':>11}")
    print("\n" + header + "\n" + "-" * len(header))
    for name, runs in http.items():
        for run in runs:
            base = engine[run["repeat"]]["output_throughput"] if run["repeat"] < len(engine) else float("nan")
            print(f"{name:>14} | {run['repeat']:>3} | {run['output_throughput']:>10.1f} | {base:>13.1f} | "
                  f"{run['output_throughput'] / base:>5.2f} | {run['median_ttft_ms']:>7.0f} / {run['p99_ttft_ms']:<7.0f} | "
                  f"{run['median_tpot_ms']:>8.1f} | {run['p99_itl_ms']:>7.0f} | {run['serving_cpu_share']:>11.1%} | "
                  f"{run['other_cpu_s']:>11.1f}")
    for run in engine:
        print(f"{'in-process':>14} | {run['repeat']:>3} | {'':>10} | {run['output_throughput']:>13.1f} | {'':>5} | "
              f"{run['median_ttft_ms']:>7.0f} / {run['p99_ttft_ms']:<7.0f} | {run['median_tpot_ms']:>8.1f} | "
              f"{run['p99_itl_ms']:>7.0f} | {'':>11} | {run['other_cpu_s']:>11.1f}")
    print("targets: HTTP / in-process output tok/s >= 0.9; serving CPU (all but the workers) <= 8%")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", type=Path, default=REPO / "deploy" / "serve.yaml", help="the deploy YAML")
    p.add_argument("--env-file", type=Path, default=REPO / "deploy" / "serve.env",
                   help="the serving environment (what scripts/serve.sh exports)")
    p.add_argument("--variant", action="append", default=None,
                   help="NAME[:KEY=VALUE,env-file=none,target=direct,arg.KEY=VALUE...] (repeatable; "
                        "default: one variant 'shipped')")
    p.add_argument("--model", default=None, help="local HF directory (default: SmolLM2-135M-Instruct)")
    p.add_argument("--port", type=int, default=8000, help="Serve's HTTP port on 127.0.0.1")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--max-concurrency", type=int, default=16)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--skip-http", action="store_true")
    p.add_argument("--skip-engine", action="store_true")
    p.add_argument("--result-json", default=None)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    from workers.loader import resolve_model_path

    model_dir = resolve_model_path(args.model)
    variants = [parse_variant(text) for text in (args.variant or ["shipped"])]
    tok = datasets.PromptTokenizer(model_dir)
    workloads = [datasets.random_requests(tok, num_prompts=args.num_prompts, input_len=args.input_len,
                                          output_len=args.output_len, seed=args.seed + r) for r in range(args.repeats)]
    print(f"model {model_dir} | config {args.config} | env file {args.env_file} | {args.num_prompts} requests x "
          f"{args.input_len} prompt tokens, {args.output_len} output (ignore_eos, greedy), concurrency "
          f"{args.max_concurrency} | {os.cpu_count()} CPUs | load average before {load_avg()}", flush=True)
    http = {} if args.skip_http else {v.name: http_runs(args, v, model_dir, workloads) for v in variants}
    engine = [] if args.skip_engine else engine_runs(args, model_dir, workloads)
    if http:
        print_table(http, engine)
    print(f"load average after {load_avg()}")
    if args.result_json:
        with open(args.result_json, "w") as f:
            json.dump({"args": {k: str(v) for k, v in vars(args).items()}, "http": http, "engine": engine}, f, indent=1)


if __name__ == "__main__":
    main()
