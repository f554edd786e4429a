"""/health, /live and /metrics latency under load, and /metrics on a fresh server.

    .venv/bin/python -m bench.bench_probes              # deploy/serve.yaml + deploy/serve.env as shipped
    .venv/bin/python -m bench.bench_probes --variant previous:env-file=none

Starts the app as a user does (bench/served_app.py: `serve run` of --config with the serving
environment of deploy/serve.env, variants as in bench/bench_http.py). Then:

1. Fresh /metrics: before any request, one scrape; every family and its label values are
   listed, and every family the Grafana dashboard (deploy/grafana-dashboard.json) queries
   must be there with at least one series (zeros count).
2. Load, all at once: `--max-concurrency` (16) streaming /v1/completions (random prompts of
   `--input-len` tokens, `--output-len` tokens each, ignore_eos) through bench/serving_client.py,
   and, once they run, one /v1/completions whose prompt is a `--long-words`-word (1,500) text,
   which the ingress tokenizes and the engine prefills in budget-sized chunks beside the streams.
3. Meanwhile a prober thread GETs /health, /live and /metrics in turn every `--probe-interval-s`,
   each on a new connection (as a load balancer's checker does), timing send to last byte.

Reported: per path p50 / p90 / p99 / max in ms and the count of non-200 answers, over the
probes sent while the load ran (target: p99 < 100 ms).
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import json
import re
import threading
import time
import urllib.request
from pathlib import Path

import numpy as np

from bench import datasets
from bench.bench_http import load_avg, parse_variant
from bench.served_app import AppLaunch, bind_audit, is_loopback, read_env_file, start_app, stop_app
from bench.serving_client import RunConfig, run_requests

REPO = Path(__file__).resolve().parent.parent
PROBE_PATHS = ("/health", "/live", "/metrics")


# --- fresh /metrics ---------------------------------------------------------------------------------
def dashboard_families(dashboard: Path = REPO / "deploy" / "grafana-dashboard.json") -> set[str]:
    """The /metrics family names (rayllm_*) behind every series a dashboard panel queries."""
    panels = json.loads(dashboard.read_text())["panels"]
    series = {name for panel in panels for target in panel.get("targets", [])
              for name in re.findall(r"\bray_rayllm_[a-z0-9_]+", target["expr"])}
    families = set()
    for name in series:
        name = name.removeprefix("ray_")
        for suffix in ("_bucket", "_count", "_sum", "_total"):
            name = name.removesuffix(suffix)
        families.add(name)
    return families


def fresh_metrics(base_url: str) -> tuple[dict[str, list[dict[str, str]]], set[str]]:
    """(family -> label sets of its series, dashboard families missing or without a series)."""
    from serve_app.metrics import parse_families

    with urllib.request.urlopen(f"{base_url}/metrics", timeout=10) as response:
        families = parse_families(response.read().decode())
    listed = {}
    for name, family in families.items():
        labels = {tuple(sorted((k, v) for k, v in s.labels.items() if k != "le")) for s in family.samples}
        listed[name] = [dict(pairs) for pairs in sorted(labels)]
    missing = {name for name in dashboard_families() if not listed.get(name)}
    return listed, missing


# --- probes -----------------------------------------------------------------------------------------
class Prober(threading.Thread):
    def __init__(self, host: str, port: int, interval_s: float) -> None:
        super().__init__(daemon=True)
        self.host, self.port, self.interval_s = host, port, interval_s
        self.samples: list[tuple[str, float, int]] = []  # (path, seconds, status)
        self.stop_event = threading.Event()

    def run(self) -> None:
        i = 0
        while not self.stop_event.is_set():
            path = PROBE_PATHS[i % len(PROBE_PATHS)]
            started = time.perf_counter()
            try:
                conn = http.client.HTTPConnection(self.host, self.port, timeout=10)
                conn.request("GET", path)
                response = conn.getresponse()
                response.read()
                status = response.status
                conn.close()
            except OSError:
                status = 0
            self.samples.append((path, time.perf_counter() - started, status))
            i += 1
            self.stop_event.wait(self.interval_s)


def probe_report(samples: list[tuple[str, float, int]]) -> dict[str, dict[str, float]]:
    report = {}
    for path in PROBE_PATHS:
        times = np.array([s for p, s, _ in samples if p == path]) * 1000
        bad = sum(1 for p, _, status in samples if p == path and status != 200)
        report[path] = {"num": len(times), "p50_ms": float(np.percentile(times, 50)),
                        "p90_ms": float(np.percentile(times, 90)), "p99_ms": float(np.percentile(times, 99)),
                        "max_ms": float(times.max()), "num_not_200": bad}
    return report


async def long_prompt(base_url: str, model: str, num_words: int, delay_s: float) -> float:
    """One completion over a num_words-word prompt, sent after delay_s; returns its latency."""
    import aiohttp

    await asyncio.sleep(delay_s)
    words = " ".join(f"word{i % 97}" for i in range(num_words))
    body = {"model": model, "prompt": f"Summarize: {words}", "max_tokens": 16, "temperature": 0}
    started = time.perf_counter()
    async with aiohttp.ClientSession() as session:
        async with session.post(f"{base_url}/v1/completions", json=body) as response:
            await response.read()
            assert response.status == 200, response.status
    return time.perf_counter() - started


async def load(args: argparse.Namespace, base_url: str, model: str, requests: list) -> float:
    cfg = RunConfig(base_url=base_url, model=model, ignore_eos=True, temperature=0.0,
                    max_concurrency=args.max_concurrency, seed=args.seed, disable_tqdm=True)
    (results, _), long_s = await asyncio.gather(run_requests(cfg, requests),
                                                long_prompt(base_url, model, args.long_words, args.long_delay_s))
    assert all(result.success for result in results), [r.error for r in results if not r.success]
    return long_s


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", type=Path, default=REPO / "deploy" / "serve.yaml")
    p.add_argument("--env-file", type=Path, default=REPO / "deploy" / "serve.env")
    p.add_argument("--variant", default="shipped", help="as in bench/bench_http.py (target=direct probes the "
                   "ingress replica's own port)")
    p.add_argument("--model", default=None)
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--num-prompts", type=int, default=48)
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--max-concurrency", type=int, default=16)
    p.add_argument("--long-words", type=int, default=1500)
    p.add_argument("--long-delay-s", type=float, default=5.0, help="after the streams start")
    p.add_argument("--probe-interval-s", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--result-json", default=None)
    args = p.parse_args(argv)
    from workers.loader import resolve_model_path

    model_dir = resolve_model_path(args.model)
    variant = parse_variant(args.variant)
    env = {**(read_env_file(args.env_file) if variant.use_env_file else {}), **variant.env}
    requests = datasets.random_requests(datasets.PromptTokenizer(model_dir), num_prompts=args.num_prompts,
                                        input_len=args.input_len, output_len=args.output_len, seed=args.seed)
    app = start_app(AppLaunch(config=args.config, port=args.port, model_dir=model_dir, env=env,
                              app_args={"served_model_name": "rayllm", **variant.app_args},
                              code_dir=variant.code_dir))
    try:
        base_url = app.base_url
        if variant.target == "direct":
            base_url = app.direct_url() or base_url
        exposed = [row for row in bind_audit(app.pid) if not is_loopback(row[2])]
        print(f"[{variant.name}] listening on a non-loopback address: "
              + (", ".join(f"{name} ({pid}) {address}:{port}" for name, pid, address, port in exposed) or "nothing"))
        listed, missing = fresh_metrics(base_url)
        print(f"[{variant.name}] env {env} | fresh /metrics: {len(listed)} families, "
              f"{sum(len(v) for v in listed.values())} series; dashboard families missing: {sorted(missing) or 'none'}")
        for name, label_sets in sorted(listed.items()):
            print(f"  {name}: {', '.join(json.dumps(labels) for labels in label_sets) or '(no series)'}")
        prober = Prober("127.0.0.1", int(base_url.rsplit(":", 1)[1]), args.probe_interval_s)
        load_before = load_avg()
        prober.start()
        long_s = asyncio.run(load(args, base_url, "rayllm", requests))
        prober.stop_event.set()
        prober.join()
        report = probe_report(prober.samples)
        print(f"[{variant.name}] load {load_before} -> {load_avg()} | long prompt ({args.long_words} words) "
              f"answered in {long_s:.1f} s")
        for path, stats in report.items():
            print(f"  {path}: {stats['num']} probes, p50 {stats['p50_ms']:.1f} ms, p90 {stats['p90_ms']:.1f} ms, "
                  f"p99 {stats['p99_ms']:.1f} ms, max {stats['max_ms']:.1f} ms, not 200: {stats['num_not_200']}")
        print("target: p99 < 100 ms")
    finally:
        stop_app(app)
    if args.result_json:
        with open(args.result_json, "w") as f:
            json.dump({"variant": args.variant, "env": env, "exposed": exposed, "fresh_metrics": listed,
                       "missing": sorted(missing),
                       "probes": report, "long_prompt_s": long_s}, f, indent=1)


if __name__ == "__main__":
    main()
