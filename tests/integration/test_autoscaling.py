"""Elastic workers on the session's real local Ray cluster, over real HTTP: an app with
min_workers 1 and max_workers 2 grows to 2 workers when prompts queue and shrinks back to 1
when the load stops, while a stream is open on each worker, so the retiring one's streams
migrate; an app with min_workers 0 goes to zero and the next request wakes a worker. Every
greedy text equals the same prompt's text from a one-worker run, and no request fails.

Each app is this module's own (route prefixes /elastic and /zero), deleted at the end."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from sse_lines import sse_lines

pytestmark = pytest.mark.slow

ELASTIC_APP, ELASTIC_PREFIX = "elastic", "rayllm-elastic"
ZERO_APP, ZERO_PREFIX = "zero", "rayllm-zero"


def app_args(tiny_model_dir: Path, prefix: str, **overrides: Any) -> dict[str, Any]:
    return {
        "model": str(tiny_model_dir), "served_model_name": "tiny", "name": prefix,
        "num_workers": 1, "worker_num_cpus": 0.5, "worker_placement": "none",
        "ingress_num_cpus": 0.1, "scheduler_num_cpus": 0.1,
        "num_kv_blocks": 256, "block_size": 16, "max_num_batched_tokens": 256, "max_num_seqs": 2,
        "dtype": "float32",  # texts are compared across workers and batch shapes: fp32 keeps them exact
        **overrides,
    }


@dataclass
class App:
    url: str
    prefix: str

    def status(self, shard: int = 0) -> Any:
        import ray

        from scheduler.actor import ACTOR_NAMESPACE, scheduler_actor_name

        scheduler = ray.get_actor(scheduler_actor_name(self.prefix, shard), namespace=ACTOR_NAMESPACE)
        return ray.get(scheduler.status.remote(), timeout=60)

    def workers(self, num_shards: int) -> tuple[int, int]:
        """(serving, starting) workers over every shard."""
        statuses = [self.status(shard) for shard in range(num_shards)]
        return sum(s.num_workers for s in statuses), sum(s.num_starting_workers for s in statuses)

    def wait_for(self, predicate, timeout_s: float, what: str) -> Any:
        deadline = time.monotonic() + timeout_s
        while True:
            status = self.status()
            if predicate(status):
                return status
            if time.monotonic() > deadline:
                raise AssertionError(f"{what} not reached in {timeout_s}s: {status}")
            time.sleep(0.2)


@pytest.fixture(scope="module")
def apps(server, tiny_model_dir: Path) -> Iterator[tuple[App, App]]:
    from ray import serve

    from serve_app.app import build_app

    # The prefix-aware router keeps each lane of the last phase on the worker that holds its
    # prefix. A worker loads in seconds here, longer while the burst runs: the scale-down delay
    # leaves it time to serve before a quiet spell would cancel it. Four seats per worker: the
    # two lanes' overlapping streams (at most 4) still count as quiet enough to retire one.
    elastic = build_app(app_args(
        tiny_model_dir, ELASTIC_PREFIX, min_workers=1, max_workers=2, scale_up_delay_s=0.5, scale_down_delay_s=15.0,
        scale_target_waiting_tokens=160, drain_timeout_s=0.0, max_num_seqs=4))
    # two scheduler shards, each scaling its own worker between 0 and 1
    zero = build_app(app_args(tiny_model_dir, ZERO_PREFIX, num_workers=2, num_scheduler_shards=2, min_workers=0,
                              max_workers=2, scale_down_delay_s=2.0, worker_num_cpus=0.25))
    serve.run(elastic, name=ELASTIC_APP, route_prefix=f"/{ELASTIC_APP}")
    serve.run(zero, name=ZERO_APP, route_prefix=f"/{ZERO_APP}")
    try:
        yield (App(f"{server.direct_url_of(ELASTIC_APP)}/{ELASTIC_APP}", ELASTIC_PREFIX),
               App(f"{server.direct_url_of(ZERO_APP)}/{ZERO_APP}", ZERO_PREFIX))
    finally:
        for name in (ELASTIC_APP, ZERO_APP):
            if name in serve.status().applications:
                serve.delete(name)


async def complete(http: httpx.AsyncClient, prompt: str, max_tokens: int,
                   first_token: asyncio.Event | None = None) -> tuple[int, str]:
    """(status, text) of one greedy stream (status -1: an error event mid-stream, as the text);
    sets first_token once the stream has sent a token (the request is then running on a worker),
    or once it ended without one."""
    import json

    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True}
    text = []
    try:
        async with http.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code != 200:
                return response.status_code, (await response.aread()).decode()
            async for line in sse_lines(response):
                if line.startswith("data: {"):
                    chunk = json.loads(line[6:])
                    if "choices" not in chunk:  # an error event mid-stream
                        return -1, line
                    text += [choice["text"] for choice in chunk["choices"]]
                    if first_token is not None:
                        first_token.set()
    finally:
        if first_token is not None:
            first_token.set()  # also when it failed: the caller goes on, and the test reports the status
    return 200, "".join(text)


def prompt(i: int) -> str:
    return f"Request {i}: a story about the number {i * 13} and the sea."


# Two lanes, each with its own opening of three blocks and more: the router keeps a lane where
# its opening is cached. Neither is sent before the last phase, so neither is cached anywhere
# when it starts, and the second lane goes to the worker the first one leaves free.
LANES = ("Lane one opens every request with this same long line, so that the prefix cache holds it:",
         "Zebras graze on the second lane, whose requests all begin with these words instead, then:")


def lane_prompt(lane: int, turn: int) -> str:
    return f"{LANES[lane]} turn {turn}."


def test_workers_grow_when_prompts_queue_and_shrink_mid_stream_without_losing_a_token(apps) -> None:
    """16 clients streaming back to back on 4 seats queue prompts: a second worker starts and
    serves. Then two lanes of streams, nothing queued: the load is under target and a worker
    retires. Each lane stays on one worker (the router follows its cached opening) and always
    has a stream running there: its next stream starts once the current one runs, and the one
    before must end before another starts. So whichever worker retires has a stream open, and
    with a drain timeout of 0 it migrates: it is recomputed on the other worker from its prompt
    and the tokens it had sent. Every text equals the same prompt's text in a one-worker run,
    and none fails."""
    elastic, _ = apps
    burst, lane_length = list(range(16)), 200
    lengths = {i: 150 for i in burst}

    async def run() -> tuple[dict[int, str], list[tuple[int, int, str]], list[tuple[int, int, int, str]],
                             dict[tuple[int, int], str], Any, Any]:
        async with httpx.AsyncClient(base_url=elastic.url, timeout=600) as http:
            expected = {}
            for i, length in lengths.items():  # the fixed one-worker run: one request at a time
                status, text = await complete(http, prompt(i), length)
                assert status == 200, text
                expected[i] = text
            assert elastic.status().num_workers == 1
            loop = asyncio.get_running_loop()
            results: list[tuple[int, int, str]] = []

            async def send(i: int) -> None:
                results.append((i, *await complete(http, prompt(i), lengths[i])))

            grown_at: list[Any] = []

            async def bursty(offset: int) -> None:
                # back to back until the second worker serves: a worker may take longer to start
                # than one round of the burst takes to finish, and a quiet spell would cancel it
                turn = 0
                while not grown_at:
                    await send(burst[(offset + turn) % len(burst)])
                    turn += 1

            tasks = [asyncio.create_task(bursty(k)) for k in range(len(burst))]
            grown = await loop.run_in_executor(None, lambda: elastic.wait_for(
                lambda s: s.num_workers == 2, 300, "a second serving worker"))
            grown_at.append(grown)
            await asyncio.gather(*tasks)
            shrunk_at: list[Any] = []
            lane_results: list[tuple[int, int, int, str]] = []  # (lane, turn, status, text)

            async def lane_stream(lane: int, turn: int, first_token: asyncio.Event) -> None:
                lane_results.append((lane, turn, *await complete(
                    http, lane_prompt(lane, turn), lane_length, first_token)))

            async def lane(index: int, first_started: asyncio.Event) -> None:
                running: list[asyncio.Task] = []
                turn = 0
                while not shrunk_at:
                    started = asyncio.Event()
                    running.append(asyncio.create_task(lane_stream(index, turn, started)))
                    await started.wait()  # this stream runs on the lane's worker...
                    first_started.set()
                    if len(running) == 2:
                        await running.pop(0)  # ...before the one before it may end
                    turn += 1
                await asyncio.gather(*running)

            first, second = asyncio.Event(), asyncio.Event()
            lanes = [asyncio.create_task(lane(0, first))]
            await first.wait()  # lane 0 is placed: lane 1 goes to the worker it leaves free
            lanes.append(asyncio.create_task(lane(1, second)))
            await second.wait()
            placed = await loop.run_in_executor(None, lambda: ray_routing(elastic))
            shrunk = await loop.run_in_executor(None, lambda: elastic.wait_for(
                lambda s: s.num_workers == 1 and s.num_starting_workers == 0, 180, "back to one worker"))
            shrunk_at.append(shrunk)
            await asyncio.gather(*lanes)
            lane_expected = {}  # the lanes' one-worker run, on the worker left
            for lane_index, turn, _, _ in lane_results:
                status, text = await complete(http, lane_prompt(lane_index, turn), lane_length)
                assert status == 200, text
                lane_expected[lane_index, turn] = text
            return expected, results, lane_results, lane_expected, grown, (shrunk, placed)

    expected, results, lane_results, lane_expected, grown, (shrunk, placed) = asyncio.run(run())
    assert all(status == 200 for _, status, _ in results), results
    assert all(text == expected[i] for i, _, text in results), [i for i, _, text in results if text != expected[i]]
    assert len(results) > len(burst) and grown.num_live_workers == 2
    assert len(placed) == 2 and min(placed) >= 1, placed  # a lane's streams running on each worker
    assert all(status == 200 for *_, status, _ in lane_results), lane_results
    wrong = [(lane, turn) for lane, turn, _, text in lane_results if text != lane_expected[lane, turn]]
    assert not wrong, wrong
    # the retiring worker held a lane's stream (one, or two while they overlap): it migrated
    assert 1 <= shrunk.num_migrated_requests <= 2, shrunk
    final = elastic.wait_for(lambda s: s.num_unfinished_requests == 0, 60, "idle")
    assert final.num_kv_blocks_free == final.num_kv_blocks_total


def ray_routing(app: App) -> list[int]:
    """Sequences running per worker now, from the scheduler's routing counters."""
    import ray

    from scheduler.actor import ACTOR_NAMESPACE, scheduler_actor_name

    scheduler = ray.get_actor(scheduler_actor_name(app.prefix, 0), namespace=ACTOR_NAMESPACE)
    return ray.get(scheduler.routing_stats.remote(), timeout=60)["running_per_worker"]


def test_scale_to_zero_and_the_next_request_wakes_a_worker(apps) -> None:
    """With two scheduler shards: both scale to zero, and a request wakes a worker in the shard its
    prompt hashes to, named after that shard (names stay unique across shards)."""
    import ray

    from scheduler.actor import ACTOR_NAMESPACE
    from workers.actor import worker_actor_name

    _, zero = apps
    with httpx.Client(base_url=zero.url, timeout=300) as http:
        body = {"model": "tiny", "prompt": prompt(3), "max_tokens": 16, "temperature": 0, "ignore_eos": True}
        before = http.post("/v1/completions", json=body)
        assert before.status_code == 200, before.text
        deadline = time.monotonic() + 120
        while zero.workers(2) != (0, 0):
            assert time.monotonic() < deadline, f"not scaled to zero: {zero.workers(2)}"
            time.sleep(0.2)
        assert http.get("/health").status_code == 200  # scaled to zero is healthy: a request wakes a worker
        started = time.monotonic()
        after = http.post("/v1/completions", json=body)
        woke_in = time.monotonic() - started
        assert after.status_code == 200, after.text
        assert after.json()["choices"][0]["text"] == before.json()["choices"][0]["text"]
        assert zero.workers(2) == (1, 0)
        [woken_shard] = [shard for shard in range(2) if zero.status(shard).num_workers == 1]
        names = {actor["name"] for actor in ray.util.list_named_actors(all_namespaces=True)
                 if actor["namespace"] == ACTOR_NAMESPACE}
        elastic_names = {name for name in names if name.startswith(worker_actor_name(ZERO_PREFIX, f"{woken_shard}."))}
        assert elastic_names, names  # the shard's elastic worker, named after its shard
        metrics = http.get("/metrics").text
    starts = [line for line in metrics.splitlines() if line.startswith("rayllm_worker_start_seconds_count")]
    assert starts and float(starts[0].split()[-1]) >= 1, starts
    print(f"wake-up: the first request after scale to zero took {woke_in:.1f}s")
