"""Soak: thousands of mixed requests with random parameters, client aborts, stop strings,
server timeouts and intended bad requests against a served app; then checks that nothing
failed unexpectedly, the KV pool is full again, and no actor's memory grew past a bound.

    python bench/soak.py                        # own local Ray + the tiny test model, 2000 requests
    python bench/soak.py --num-requests 500 --concurrency 16
    python bench/soak.py --model /path/to/hf_dir --num-workers 2

Outcomes per request: "ok" (200, complete), "aborted" (the client gave up on purpose),
"rejected" (a 400 we provoked on purpose, or a 429 when the queue is full), and
"UNEXPECTED" (anything else: a 5xx, a 4xx we did not provoke, an error event in a stream,
a broken stream). The run fails (exit 1) on any UNEXPECTED outcome, a KV pool that is not
full after the run, or an actor whose RSS grew more than --rss-growth-mb over the second half
of the measured run (after --warmup requests).

Why the second half: a worker's RSS rises while new batch shapes keep appearing (oneDNN
keeps one prepared GEMM primitive per shape, up to ONEDNN_PRIMITIVE_CACHE_CAPACITY=1024 by
default, plus allocator pools), then levels off; a leak keeps rising at the same rate. The
full table (RSS after every phase) is printed so both are visible.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

from bench.served_app import free_port

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

APP_NAME = "soak"
ACTOR_PREFIX = "rayllm-soak"
WORDS = "the a robot river light stone seven quick blue over under story number again end".split()


def random_body(rng: random.Random, i: int) -> tuple[str, dict[str, Any], str]:
    """(path, body, intent): intent is ok | abort | bad (a 400 on purpose)."""
    chat = rng.random() < 0.4
    text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 60)))
    body: dict[str, Any] = {"max_tokens": rng.randint(1, 48), "stream": rng.random() < 0.5}
    if chat:
        path, body["messages"] = "/v1/chat/completions", [{"role": "user", "content": text}]
    else:
        path, body["prompt"] = "/v1/completions", text
    if rng.random() < 0.7:
        body["temperature"] = rng.choice([0.0, 0.5, 1.0, 1.5])
    for name, low, high in (("top_p", 0.05, 1.0), ("min_p", 0.0, 0.3), ("presence_penalty", -2, 2),
                            ("frequency_penalty", -2, 2), ("repetition_penalty", 0.5, 2.0)):
        if rng.random() < 0.2:
            body[name] = round(rng.uniform(low, high), 3)
    if rng.random() < 0.2:
        body["top_k"] = rng.choice([-1, 0, 1, 5, 50])
    if rng.random() < 0.3:
        body["seed"] = rng.randint(0, 2**31)
    if rng.random() < 0.2:
        body["n"] = rng.randint(1, 3)
    if rng.random() < 0.2:
        if chat:
            body["logprobs"], body["top_logprobs"] = True, rng.randint(0, 5)
        else:
            body["logprobs"] = rng.randint(0, 5)
    if rng.random() < 0.2:
        body["stop"] = rng.sample(["e", "o", " the", "\n", "xyz"], rng.randint(1, 3))
    if rng.random() < 0.1:
        body["timeout"] = round(rng.uniform(0.05, 1.0), 2)
    if rng.random() < 0.1:
        body["ignore_eos"], body["max_tokens"] = True, rng.randint(64, 300)
    intent = "abort" if rng.random() < 0.15 else "ok"
    if rng.random() < 0.05:  # a bad request on purpose
        bad = rng.choice([("temperature", -1), ("n", 10_000), ("max_tokens", 0), ("top_p", 7), ("logprobs", 99)])
        body[bad[0]], intent = bad[1], "bad"
        if bad[0] == "logprobs" and chat:
            body["logprobs"], body["top_logprobs"] = True, 99
    return path, body, intent


async def one_request(http: Any, rng: random.Random, i: int) -> str:
    path, body, intent = random_body(rng, i)
    abort_after = rng.uniform(0.02, 0.8) if intent == "abort" else None
    try:
        return await asyncio.wait_for(_send(http, path, body, intent), abort_after) if abort_after \
            else await _send(http, path, body, intent)
    except asyncio.TimeoutError:
        return "aborted"
    except Exception as error:  # a broken connection, a malformed response
        return f"UNEXPECTED {type(error).__name__}: {error}"[:200]


async def _send(http: Any, path: str, body: dict[str, Any], intent: str) -> str:
    async with http.stream("POST", path, json=body) as response:
        raw = await response.aread()
    status = response.status_code
    if status == 200 and intent != "bad":
        if body.get("stream"):
            events = [line[6:] for line in raw.decode().split("\n\n") if line.startswith("data: ")]
            if not events or events[-1] != "[DONE]" or any('"error"' in e[:12] for e in events):
                return f"UNEXPECTED broken stream: {raw[-300:]!r}"
        return "ok"
    if status == 400 and intent == "bad":
        return "rejected"
    if status == 429:
        return "rejected"
    if status == 408 and "timeout" in body:  # its own deadline passed before a first token
        return "timed out"
    return f"UNEXPECTED {status} for {intent}: {raw[:300]!r}"


async def run_load(url: str, num_requests: int, concurrency: int, seed: int) -> Counter[str]:
    import httpx

    rng = random.Random(seed)
    outcomes: Counter[str] = Counter()
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(num_requests):
        queue.put_nowait(i)
    started, last_report = time.monotonic(), [0.0]

    async def worker(http: httpx.AsyncClient) -> None:
        while not queue.empty():
            i = queue.get_nowait()
            outcome = await one_request(http, random.Random(rng.random() + i), i)
            outcomes[outcome if not outcome.startswith("UNEXPECTED") else outcome] += 1
            done = sum(outcomes.values())
            if time.monotonic() - last_report[0] > 10:
                last_report[0] = time.monotonic()
                print(f"  {done}/{num_requests} in {last_report[0] - started:.0f}s: {dict(_summary(outcomes))}",
                      flush=True)

    limits = httpx.Limits(max_connections=concurrency * 2)
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as http:
        await asyncio.gather(*(worker(http) for _ in range(concurrency)))
    return outcomes


def _summary(outcomes: Counter[str]) -> Counter[str]:
    return Counter({("UNEXPECTED" if k.startswith("UNEXPECTED") else k): v for k, v in outcomes.items()})


# --- the app and its actors ------------------------------------------------------------------------
def start_app(args: argparse.Namespace) -> str:
    import ray
    from ray import serve

    from serve_app.app import build_app

    model = args.model
    if model is None:
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
        from tiny_model import build_tiny_model_dir

        model = str(build_tiny_model_dir(Path(tempfile.mkdtemp(prefix="soak-tiny-"))))
    ray.init(address="local", num_cpus=args.num_cpus, include_dashboard=False, log_to_driver=False)
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(build_app({
        "model": model, "served_model_name": "soak", "name": ACTOR_PREFIX, "num_workers": args.num_workers,
        "worker_num_cpus": args.worker_num_cpus, "worker_placement": "none", "num_kv_blocks": args.num_kv_blocks,
        "block_size": 16, "max_num_seqs": 32, "max_num_batched_tokens": 1024,
    }), name=APP_NAME, route_prefix="/")
    return f"http://127.0.0.1:{port}"


def scheduler_status() -> Any:
    import ray

    from scheduler.actor import ACTOR_NAMESPACE, scheduler_actor_name

    return ray.get(ray.get_actor(scheduler_actor_name(ACTOR_PREFIX), namespace=ACTOR_NAMESPACE).status.remote())


def actor_rss_mb() -> dict[str, float]:
    """RSS of the scheduler, the workers and this app's Serve replicas (same machine)."""
    import psutil
    import ray

    rss = {}
    for entry in ray.util.list_named_actors(all_namespaces=True):
        name, namespace = entry["name"], entry["namespace"]
        if not (name.startswith(ACTOR_PREFIX) or (namespace == "serve" and f"{APP_NAME}#" in name)):
            continue
        try:
            handle = ray.get_actor(name, namespace=namespace)
            pid = ray.get(handle.__ray_call__.remote(lambda self: os.getpid()), timeout=30)
            label = name if name.startswith(ACTOR_PREFIX) else name.split("#")[1]
            rss[label] = psutil.Process(pid).memory_info().rss / 2**20
        except Exception as error:  # noqa: BLE001  (reported, not fatal)
            rss[name] = float("nan")
            print(f"  (no RSS for {name}: {type(error).__name__})")
    return rss


def worker_request_states() -> list[int]:
    """Per worker: request states its runner still holds (0 when idle: nothing leaked)."""
    import ray

    from scheduler.actor import ACTOR_NAMESPACE
    from workers.actor import worker_actor_name

    counts = []
    for index in range(8):
        try:
            worker = ray.get_actor(worker_actor_name(ACTOR_PREFIX, index), namespace=ACTOR_NAMESPACE)
        except ValueError:
            break
        counts.append(ray.get(worker.__ray_call__.remote(lambda self: len(self._runner.requests)), timeout=30))
    return counts


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", help="an already running server (then no actor memory / KV checks)")
    parser.add_argument("--model", help="local HF model directory; default: the tiny random test model")
    parser.add_argument("--num-requests", type=int, default=2000)
    parser.add_argument("--concurrency", type=int, default=24)
    parser.add_argument("--num-workers", type=int, default=2)
    parser.add_argument("--worker-num-cpus", type=float, default=0.5)
    parser.add_argument("--num-cpus", type=int, default=2)
    parser.add_argument("--num-kv-blocks", type=int, default=512)
    parser.add_argument("--warmup", type=int, default=400, help="requests before the first RSS sample")
    parser.add_argument("--rss-growth-mb", type=float, default=150.0,
                        help="max RSS growth per actor over the second half of the measured run")
    parser.add_argument("--phases", type=int, default=4, help="RSS samples after warm-up")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    url = args.url or start_app(args)
    local = args.url is None
    started = time.monotonic()
    outcomes = asyncio.run(run_load(url, min(args.warmup, args.num_requests), args.concurrency, args.seed))
    baseline = actor_rss_mb() if local else {}
    samples = [(sum(outcomes.values()), baseline)]
    left = args.num_requests - sum(outcomes.values())
    for phase in range(args.phases):  # RSS after each phase: growth that levels off vs a leak
        count = left // args.phases + (1 if phase < left % args.phases else 0)
        outcomes += asyncio.run(run_load(url, count, args.concurrency, args.seed + 1 + phase))
        if local:
            samples.append((sum(outcomes.values()), actor_rss_mb()))
    elapsed = time.monotonic() - started
    print(f"\n{sum(outcomes.values())} requests in {elapsed:.0f}s (concurrency {args.concurrency}): "
          f"{dict(_summary(outcomes))}")
    unexpected = {k: v for k, v in outcomes.items() if k.startswith("UNEXPECTED")}
    for outcome, count in sorted(unexpected.items(), key=lambda kv: -kv[1])[:20]:
        print(f"  {count:5d} x {outcome}")
    failed = bool(unexpected)
    if local:
        status = None
        for _ in range(100):  # aborted requests free their blocks within a step
            status = scheduler_status()
            if status.num_unfinished_requests == 0 and status.num_kv_blocks_free == status.num_kv_blocks_total:
                break
            time.sleep(0.1)
        kv_full = status.num_kv_blocks_free == status.num_kv_blocks_total and status.num_running == 0
        print(f"KV pool after the run: {status.num_kv_blocks_free}/{status.num_kv_blocks_total} blocks free, "
              f"running={status.num_running} waiting={status.num_waiting} -> {'FULL' if kv_full else 'LEAK'}")
        final = samples[-1][1]
        middle = len(samples) // 2
        print(f"RSS (MB) after N requests; 'late' = growth over the second half (bound "
              f"{args.rss_growth_mb:.0f} MB), 'total' = since the end of warm-up")
        print(f"{'actor':28s}" + "".join(f"{n:>8d}" for n, _ in samples) + "    late   total")
        for name in sorted(final):
            row = [sample.get(name, float("nan")) for _, sample in samples]
            late, total = row[-1] - row[middle], row[-1] - row[0]
            flag = "" if late <= args.rss_growth_mb else "  OVER"
            failed |= late > args.rss_growth_mb
            print(f"{name:28s}" + "".join(f"{v:8.0f}" for v in row) + f" {late:+7.0f} {total:+7.0f}{flag}")
        print(f"worker request states left: {worker_request_states()}")
        failed |= not kv_full
        print(json.dumps({"requests": sum(outcomes.values()), "outcomes": dict(_summary(outcomes)),
                          "kv_full": kv_full, "seconds": round(elapsed, 1)}))
        from ray import serve

        serve.shutdown()
        import ray

        ray.shutdown()
    print("SOAK", "FAILED" if failed else "PASSED")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
