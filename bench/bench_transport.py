"""What one engine step's message costs: a Ray actor call against a frame on the step socket.

    .venv/bin/python -m bench.bench_transport            # 2000 calls each way, 1 and 16 requests a step

Two actors on a local Ray: a caller (async, as the scheduler actor is) sends a SchedulerOutput
of decode steps to a callee that answers a ModelRunnerOutput at once (no model), either as a
Ray actor call (`execute.remote`, task events off, as TimedRunner sends it) or over the
callee's StepServer socket (scheduler/step_channel.py). Printed per call: wall time and the
CPU time of each process from /proc, alternating the two ways twice. On a 2-core VM every ms of
this CPU comes out of the cores the model runs on.
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Any

import ray

from bench.served_app import process_cpu_s
from scheduler.outputs import CachedRequestData, ModelRunnerOutput, SchedulerOutput


def decode_step(num_requests: int) -> SchedulerOutput:
    ids = [f"cmpl-{i:032x}-0" for i in range(num_requests)]
    return SchedulerOutput([], [CachedRequestData(rid, [], 300) for rid in ids], {rid: 1 for rid in ids}, num_requests)


def answer(scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
    return ModelRunnerOutput({rid: 42 for rid in scheduler_output.num_scheduled_tokens})


@ray.remote
class Callee:
    def __init__(self) -> None:
        from workers.step_server import StepServer

        self._server = StepServer(answer)

    def pid(self) -> int:
        return os.getpid()

    def path(self) -> str:
        return self._server.path

    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return answer(scheduler_output)


@ray.remote
class Caller:
    def __init__(self) -> None:
        self._channel: Any = None

    def pid(self) -> int:
        return os.getpid()

    async def run(self, callee: Any, path: str, way: str, num_requests: int, num_calls: int) -> float:
        from scheduler.step_channel import StepChannel

        step = decode_step(num_requests)
        if way == "ray":
            send = callee.execute.options(enable_task_events=False).remote
        else:
            if self._channel is None:
                self._channel = await StepChannel.connect(path)
            send = self._channel.call
        started = time.perf_counter()
        for _ in range(num_calls):
            await send(step)
        return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-calls", type=int, default=2000)
    parser.add_argument("--num-requests", default="1,16", help="requests per step, comma-separated")
    args = parser.parse_args()
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    callee, caller = Callee.remote(), Caller.remote()
    pids = ray.get([callee.pid.remote(), caller.pid.remote()])
    path = ray.get(callee.path.remote())
    ray.get(caller.run.remote(callee, path, "ray", 1, 50))  # warm both ways up
    ray.get(caller.run.remote(callee, path, "socket", 1, 50))
    print(f"{'requests':>8} {'way':>6} {'wall us/call':>12} {'callee CPU us':>13} {'caller CPU us':>13}")
    for num_requests in (int(n) for n in args.num_requests.split(",")):
        for way in ("ray", "socket", "ray", "socket"):
            before = [process_cpu_s(pid) for pid in pids]
            wall = ray.get(caller.run.remote(callee, path, way, num_requests, args.num_calls))
            after = [process_cpu_s(pid) for pid in pids]
            per_call = [(a - b) / args.num_calls * 1e6 for a, b in zip(after, before, strict=True)]
            print(f"{num_requests:>8} {way:>6} {wall / args.num_calls * 1e6:>12.0f} {per_call[0]:>13.0f} "
                  f"{per_call[1]:>13.0f}", flush=True)
    ray.shutdown()


if __name__ == "__main__":
    main()
