"""Serving benchmark client for OpenAI-compatible servers (ours, vLLM, llama-server, HF).

    python -m bench.serving_client --base-url http://127.0.0.1:8000 --model NAME \\
        --tokenizer PATH --dataset random --num-prompts 64 --input-len 256 --output-len 128 \\
        --ignore-eos --max-concurrency 16 --result-json out.json

Requests are sent at `--request-rate` (Poisson, or gamma with `--burstiness`; `inf` sends
all at once, seeded), at most `--max-concurrency` in flight (a semaphore; a request's clock
starts when it gets a slot, as in vLLM). Metrics: see bench/metrics.py. Bounded: at most
MAX_NUM_PROMPTS requests, each cut at `--request-timeout`, the whole run at
`--max-duration`. Only loopback servers are accepted.

With `--server-pid PID` (Linux; PID: the `serve run` process of a server started in its own
session, as bench/peers/ours.sh and bench.matrix start ours and write its PID to
~/.cache/rayllm-peers/ours.pid): where a served token's CPU goes. Every process of that session
(bench/served_app.py) and this client are read from /proc around the timed run, and
bench.served_app's CPU table is printed with a column of CPU ms per output token, and beside
each process the time its threads were ready to run but waited for a core. On a machine with
as few cores as the worker has threads, the ingress, the scheduler, Serve's proxy, Ray's
background processes and the client share the worker's cores: their CPU per token comes out of
its step, and the worker's wait says how much. Use distinct --seed values for runs on the same
server: a repeated prompt is a prefix-cache hit.
"""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import json
import os
import platform
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import urlparse

import aiohttp
import numpy as np
from tqdm import tqdm

from bench import datasets, report
from bench.metrics import RequestResult, calculate_metrics, parse_goodput
from bench.request_func import send_request

if TYPE_CHECKING:
    from bench.served_app import ProcessTimes

MAX_NUM_PROMPTS = 100_000


@dataclass(slots=True)
class RunConfig:
    base_url: str
    model: str
    chat: bool = False  # /v1/chat/completions instead of /v1/completions
    ignore_eos: bool = False
    temperature: float = 0.0
    top_p: float = 1.0
    request_rate: float = float("inf")  # requests/s; inf sends all at t=0
    burstiness: float = 1.0  # gamma shape; 1 = Poisson
    max_concurrency: int | None = None  # requests in flight at most; None = unbounded
    seed: int = 0
    request_timeout_s: float = 600.0
    max_duration_s: float = 3600.0
    num_warmups: int = 0
    initial_test: bool = True  # send the first request alone before timing, as vLLM does
    disable_tqdm: bool = False
    extra_body: dict = field(default_factory=dict)

    @property
    def url(self) -> str:
        path = "/v1/chat/completions" if self.chat else "/v1/completions"
        return self.base_url.rstrip("/") + path


def check_loopback(base_url: str) -> None:
    host = urlparse(base_url).hostname or ""
    if host == "localhost":
        return
    try:
        if ipaddress.ip_address(host).is_loopback:
            return
    except ValueError:
        pass
    raise SystemExit(f"refusing {base_url}: this benchmark only talks to loopback servers")


def arrival_offsets(num: int, rate: float, burstiness: float, seed: int) -> list[float]:
    """Send time of each request, s after start: gamma gaps, total scaled to num / rate."""
    if rate == float("inf"):
        return [0.0] * num
    assert rate > 0 and burstiness > 0, (rate, burstiness)
    rng = np.random.default_rng(seed)
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=num)
    times = np.cumsum(gaps)
    times *= (num / rate) / times[-1]  # vLLM's normalization: steadier totals across seeds
    return [float(t) for t in times]


def _new_result(req: datasets.SampleRequest) -> RequestResult:
    return RequestResult(group=req.group, n=req.n, prompt_len=req.prompt_len)


def _body(cfg: RunConfig, req: datasets.SampleRequest) -> dict:
    body = datasets.request_body(
        req, model=cfg.model, chat=cfg.chat, ignore_eos=cfg.ignore_eos, temperature=cfg.temperature, top_p=cfg.top_p
    )
    body.update(cfg.extra_body)
    return body


async def _send_all(session, cfg, requests, sem) -> list[RequestResult]:
    """Warmups, untimed: the same requests, cycled."""
    async def one(req):
        async with sem:
            return await send_request(session, cfg.url, _body(cfg, req), _new_result(req), chat=cfg.chat)

    return await asyncio.gather(*(one(r) for r in requests))


async def run_requests(cfg: RunConfig, requests: list[datasets.SampleRequest]) -> tuple[list[RequestResult], float]:
    """Sends every request on schedule; returns (results in request order, duration s)."""
    assert 0 < len(requests) <= MAX_NUM_PROMPTS, len(requests)
    limit = cfg.max_concurrency or 0
    timeout = aiohttp.ClientTimeout(total=cfg.request_timeout_s)
    # A new connection per request: a server that closes idle keep-alive connections
    # (llama-server does after a few seconds) would otherwise race a request on a stale one
    # and fail it with "Server disconnected". On loopback a connect costs well under 1 ms.
    connector = aiohttp.TCPConnector(limit=limit, limit_per_host=limit, force_close=True)
    sem = asyncio.Semaphore(cfg.max_concurrency or len(requests))
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        if cfg.initial_test:
            first = await send_request(session, cfg.url, _body(cfg, requests[0]), _new_result(requests[0]), chat=cfg.chat)
            if not first.success:
                raise SystemExit(f"initial test request failed: {first.error}")
        if cfg.num_warmups:
            warm = [requests[i % len(requests)] for i in range(cfg.num_warmups)]
            await _send_all(session, cfg, warm, sem)
        return await _timed_run(session, cfg, requests, sem)


async def _timed_run(session, cfg, requests, sem) -> tuple[list[RequestResult], float]:
    results: list[RequestResult | None] = [None] * len(requests)
    pbar = tqdm(total=len(requests), disable=cfg.disable_tqdm, desc="requests")

    async def one(i: int, req: datasets.SampleRequest) -> None:
        async with sem:
            results[i] = await send_request(session, cfg.url, _body(cfg, req), _new_result(req), chat=cfg.chat)
        pbar.update(1)

    offsets = arrival_offsets(len(requests), cfg.request_rate, cfg.burstiness, cfg.seed)
    start = time.perf_counter()
    deadline = start + cfg.max_duration_s
    tasks = []
    for i, (req, offset) in enumerate(zip(requests, offsets)):
        wait_s = min(start + offset, deadline) - time.perf_counter()
        if wait_s > 0:
            await asyncio.sleep(wait_s)
        if time.perf_counter() >= deadline:
            break
        tasks.append(asyncio.create_task(one(i, req)))
    pending = set()
    if tasks:
        _, pending = await asyncio.wait(tasks, timeout=max(0.0, deadline - time.perf_counter()))
    for task in pending:
        task.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    duration = time.perf_counter() - start
    pbar.close()
    for i, req in enumerate(requests):
        if results[i] is None:
            results[i] = _new_result(req)
            results[i].error = f"not finished within --max-duration {cfg.max_duration_s} s"
    return results, duration


async def fetch_models(base_url: str) -> list[dict]:
    timeout = aiohttp.ClientTimeout(total=30)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        async with session.get(base_url.rstrip("/") + "/v1/models") as response:
            response.raise_for_status()
            return (await response.json()).get("data", [])


def build_requests(args: argparse.Namespace) -> list[datasets.SampleRequest]:
    tok = datasets.PromptTokenizer(args.tokenizer)
    common = dict(num_prompts=args.num_prompts, seed=args.seed, n=args.n)
    if args.dataset == "random":
        return datasets.random_requests(
            tok, input_len=args.input_len, output_len=args.output_len,
            range_ratio=args.range_ratio, prefix_len=args.prefix_len, **common,
        )
    if args.dataset == "shared-prefix":
        return datasets.shared_prefix_requests(
            tok, num_prefixes=args.num_prefixes, shared_prefix_len=args.shared_prefix_len,
            input_len=args.input_len, output_len=args.output_len, **common,
        )
    if args.dataset == "long-prompt":
        return datasets.long_prompt_requests(
            tok, num_long=args.num_long, long_input_len=args.long_input_len,
            long_output_len=args.long_output_len or args.output_len, input_len=args.input_len,
            output_len=args.output_len, range_ratio=args.range_ratio, **common,
        )
    raise SystemExit(f"unknown dataset {args.dataset}")


def per_request_fields(results: list[RequestResult], save_text: bool) -> dict:
    """The per-request arrays of the result JSON (vLLM's names where it has them)."""
    t0 = min((r.start_time for r in results if r.success), default=0.0)
    out = {
        "input_lens": [r.prompt_len for r in results],
        "output_lens": [r.output_tokens if r.success else 0 for r in results],
        "ttfts": [r.ttft for r in results],
        "tpots": [r.tpot if r.success else 0.0 for r in results],
        "e2els": [r.latency for r in results],
        "itls": [r.itl for r in results],
        "start_times": [r.start_time - t0 if r.success else None for r in results],
        "num_chunks": [len(r.chunk_times) for r in results],
        "cached_tokens": [r.cached_tokens for r in results],
        "usage_reported": [r.usage_reported for r in results],
        "request_groups": [r.group for r in results],
        "finish_reasons": [r.finish_reasons for r in results],
        "errors": [r.error for r in results],
    }
    if save_text:
        out["generated_texts"] = [r.generated_text for r in results]
    return out


def build_result(args, cfg, results, duration, models, load_start) -> dict:
    percentiles = [float(p) for p in args.metric_percentiles.split(",")]
    slos = parse_goodput(args.goodput)
    result = {
        "date": datetime.now().strftime("%Y%m%d-%H%M%S"),
        "label": args.label,
        "backend": "openai-chat" if cfg.chat else "openai",
        "base_url": cfg.base_url,
        "model_id": cfg.model,
        "server_models": models,
        "tokenizer_id": str(args.tokenizer),
        "dataset": args.dataset,
        "num_prompts": len(results),
        "input_len": args.input_len,
        "output_len": args.output_len,
        "range_ratio": args.range_ratio,
        "n": args.n,
        "ignore_eos": cfg.ignore_eos,
        "temperature": cfg.temperature,
        "top_p": cfg.top_p,
        "request_rate": cfg.request_rate if cfg.request_rate != float("inf") else "inf",
        "burstiness": cfg.burstiness,
        "max_concurrency": cfg.max_concurrency,
        "seed": cfg.seed,
        "goodput_slos_ms": slos,
        "percentiles": percentiles,
        "machine": {"nproc": os.cpu_count(), "platform": platform.platform(),
                    "loadavg_start": load_start, "loadavg_end": list(os.getloadavg())},
    }
    result.update(calculate_metrics(results, duration, percentiles, slos))
    groups = sorted({r.group for r in results})
    if len(groups) > 1:
        result["groups"] = {
            g: calculate_metrics([r for r in results if r.group == g], duration, percentiles, slos)
            for g in groups
        }
    result.update(per_request_fields(results, args.save_text))
    return result


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--endpoint", choices=["completions", "chat"], default="completions")
    p.add_argument("--model", help="model id to send (default: the server's first /v1/models id)")
    p.add_argument("--lora-modules", nargs="+", default=None, metavar="NAME",
                   help="LoRA adapter names: request i names the (i mod count)-th, as vLLM's benchmark spreads them")
    p.add_argument("--tokenizer", help="local tokenizer dir or tokenizer.json (default: --model if a dir)")
    p.add_argument("--label", default=None, help="name of this run in combined reports")
    p.add_argument("--dataset", choices=["random", "shared-prefix", "long-prompt"], default="random")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", "--random-input-len", type=int, default=256)
    p.add_argument("--output-len", "--random-output-len", type=int, default=128)
    p.add_argument("--range-ratio", "--random-range-ratio", type=float, default=0.0)
    p.add_argument("--prefix-len", "--random-prefix-len", type=int, default=0,
                   help="random: tokens of one prefix shared by every prompt")
    p.add_argument("--num-prefixes", type=int, default=4, help="shared-prefix: families")
    p.add_argument("--shared-prefix-len", type=int, default=1024, help="shared-prefix: system prompt tokens")
    p.add_argument("--num-long", type=int, default=2, help="long-prompt: very long prompts")
    p.add_argument("--long-input-len", type=int, default=4096)
    p.add_argument("--long-output-len", type=int, default=None, help="default: --output-len")
    p.add_argument("--n", type=int, default=1, help="completions per prompt")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0, help="sent when below 1")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--extra-body", type=json.loads, default={}, help="JSON merged into every body")
    p.add_argument("--request-rate", type=float, default=float("inf"))
    p.add_argument("--burstiness", type=float, default=1.0)
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--goodput", nargs="+", default=None, metavar="KEY:MS", help="e.g. ttft:500 tpot:50")
    p.add_argument("--metric-percentiles", default="50,90,99")
    p.add_argument("--num-warmups", type=int, default=0)
    p.add_argument("--skip-initial-test", action="store_true")
    p.add_argument("--request-timeout", type=float, default=600.0, help="s, per request")
    p.add_argument("--max-duration", type=float, default=3600.0, help="s, whole timed run")
    p.add_argument("--result-json", default=None)
    p.add_argument("--plot", default=None, help="latency CDF PNG (default: next to --result-json)")
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--save-text", action="store_true", help="keep generated texts in the JSON")
    p.add_argument("--disable-tqdm", action="store_true")
    p.add_argument("--server-pid", type=int, default=None,
                   help="also the CPU of this server's session and of this client over the run (Linux)")
    args = p.parse_args(argv)
    if not 0 < args.num_prompts <= MAX_NUM_PROMPTS:
        p.error(f"--num-prompts must be in [1, {MAX_NUM_PROMPTS}]")
    if args.n < 1 or args.max_concurrency is not None and args.max_concurrency < 1:
        p.error("--n and --max-concurrency must be >= 1")
    if args.request_timeout <= 0 or args.max_duration <= 0 or args.request_rate <= 0:
        p.error("--request-timeout, --max-duration and --request-rate must be > 0")
    parse_goodput(args.goodput)  # fail before sending anything
    return args


async def benchmark(args: argparse.Namespace) -> dict:
    check_loopback(args.base_url)
    models = await fetch_models(args.base_url)
    model = args.model or (models[0]["id"] if models else None)
    if model is None:
        raise SystemExit("no --model given and the server lists none")
    if args.tokenizer is None:
        args.tokenizer = model if Path(model).is_dir() else None
    if args.tokenizer is None:
        raise SystemExit("--tokenizer PATH is needed to build prompts")
    cfg = RunConfig(
        base_url=args.base_url, model=model, chat=args.endpoint == "chat",
        ignore_eos=args.ignore_eos, temperature=args.temperature, top_p=args.top_p,
        request_rate=args.request_rate, burstiness=args.burstiness,
        max_concurrency=args.max_concurrency, seed=args.seed,
        request_timeout_s=args.request_timeout, max_duration_s=args.max_duration,
        num_warmups=args.num_warmups, initial_test=not args.skip_initial_test,
        disable_tqdm=args.disable_tqdm, extra_body=args.extra_body,
    )
    requests = build_requests(args)
    for index, request in enumerate(requests if args.lora_modules else ()):
        request.extra = {**request.extra, "model": args.lora_modules[index % len(args.lora_modules)]}
    load_start = list(os.getloadavg())
    cpu_before = cpu_now(args.server_pid)
    results, duration = await run_requests(cfg, requests)
    result = build_result(args, cfg, results, duration, models, load_start)
    if args.server_pid is not None:
        from bench.served_app import cpu_rows, format_cpu_table

        rows = cpu_rows(cpu_before, cpu_now(args.server_pid))
        result["cpu_s"] = {f"{row.name} ({row.pid})": round(row.cpu_s, 2) for row in rows}
        result["wait_s"] = {f"{row.name} ({row.pid})": round(row.wait_s, 2) for row in rows}
        result["cpu_table"] = format_cpu_table(rows, output_tokens=result["total_output_tokens"])
        result["cpu_cores_used"] = sum(row.cpu_s for row in rows) / duration
    return result


def cpu_now(server_pid: int | None) -> dict[int, ProcessTimes]:
    """pid -> (name, CPU and core-wait seconds so far) of the server's session and this client
    ({} without one)."""
    if server_pid is None:
        return {}
    from bench.served_app import cpu_with_client

    return cpu_with_client(server_pid)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    result = asyncio.run(benchmark(args))
    print(report.format_summary(result))
    if "cpu_table" in result:
        print(result["cpu_table"])
        print(f"these processes used {result['cpu_cores_used']:.0%} of one core over the run")
    if result["failed"]:
        errors = [e for e in result["errors"] if e][:5]
        print(f"{result['failed']} failed requests; first errors:", *errors, sep="\n  ", file=sys.stderr)
    if args.result_json:
        Path(args.result_json).parent.mkdir(parents=True, exist_ok=True)
        with open(args.result_json, "w") as f:
            json.dump(result, f, indent=1)
    plot = args.plot or (str(Path(args.result_json).with_suffix(".png")) if args.result_json else None)
    if plot and not args.no_plot:
        report.plot_latency_cdfs(result, plot)
    return result


if __name__ == "__main__":
    sys.exit(0 if main()["completed"] else 1)
