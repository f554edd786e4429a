"""How often a LoRA request finds its adapter loaded where it is routed, per routing policy,
same workload, same run.

    .venv/bin/python -m bench.bench_lora_routing                   # 2 workers, 8 adapters, 4 slots each
    .venv/bin/python -m bench.bench_lora_routing --adapters 16 --zipf 1.1 --requests 2000

The pure scheduler core, as the scheduler actor drives it: a real Scheduler per worker (its
exact LRU of loaded adapters, scheduler/lora_slots.py), route_request for each request, and a
fake model runner (scheduler/testing.py) in place of the workers, so the numbers are the
routing's alone. A closed loop keeps --concurrency requests in flight; each names one of
--adapters adapters, drawn from a Zipf law of exponent --zipf (0: uniform) in a seeded order,
with a random prompt and --output-len tokens. Per policy: adapter hits (the chosen worker held
the adapter), loads (worker-side adapter loads, from the schedulers' counts) and steps taken.
"""

from __future__ import annotations

import argparse
import random

from scheduler.config import SchedulerConfig
from scheduler.outputs import EngineRequest
from scheduler.router import Router, RouterConfig, route_request
from scheduler.sampling_params import SamplingParams
from scheduler.scheduler import Scheduler
from scheduler.testing import FakeRunner


def simulate(policy: str, args: argparse.Namespace) -> dict[str, float]:
    config = SchedulerConfig(block_size=16, num_blocks=1024, max_model_len=4096, max_num_batched_tokens=512,
                             max_num_seqs=32, max_loras=args.max_loras, max_cpu_loras=args.max_cpu_loras)
    schedulers = {i: Scheduler(config) for i in range(args.workers)}
    runners = {i: FakeRunner(config.block_size, config.num_blocks, check_kv=False) for i in schedulers}
    router = Router(RouterConfig(policy=policy))
    rng = random.Random(args.seed)
    names = [f"adapter-{i}" for i in range(args.adapters)]
    weights = [1.0 / (rank + 1) ** args.zipf for rank in range(args.adapters)]
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    sent = hits = steps = 0
    while sent < args.requests or any(s.has_unfinished_requests() for s in schedulers.values()):
        in_flight = sum(len(s.seqs_of_client) for s in schedulers.values())
        while sent < args.requests and in_flight < args.concurrency:
            name = rng.choices(names, weights)[0]
            prompt = [rng.randrange(3, 1000) for _ in range(args.prompt_len)]
            path = f"/adapters/{name}"
            route = route_request(router, schedulers, prompt, None, name, path)
            hits += bool(route.adapter_hit)
            schedulers[route.worker_id].add_request(EngineRequest(f"r{sent}", prompt, params, lora_name=name,
                                                                  lora_path=path))
            sent += 1
            in_flight += 1
        for index, scheduler in schedulers.items():
            if scheduler.has_unfinished_requests():
                output = scheduler.schedule()
                scheduler.update_from_output(output, runners[index].execute(output))
        steps += 1
    loads = sum(s.loras.counts.num_loads for s in schedulers.values())
    return {"hit rate": hits / args.requests, "loads": loads, "steps": steps}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--adapters", type=int, default=8)
    parser.add_argument("--max-cpu-loras", type=int, default=4, help="adapters one worker holds")
    parser.add_argument("--max-loras", type=int, default=4, help="adapters one step runs")
    parser.add_argument("--zipf", type=float, default=0.0, help="popularity exponent (0: uniform)")
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print(f"{args.workers} workers x {args.max_cpu_loras} adapter slots, {args.adapters} adapters (zipf {args.zipf}), "
          f"{args.requests} requests at concurrency {args.concurrency}")
    for policy in ("prefix_aware", "round_robin", "least_loaded"):
        result = simulate(policy, args)
        print(f"{policy:>13}: adapter hit rate {result['hit rate']:.3f}, {result['loads']} loads, "
              f"{result['steps']} steps")


if __name__ == "__main__":
    main()
