"""The serving path on the shared tiny-model app (real Ray, real HTTP): a step's deltas for
every request of the ingress replica cross Ray as ONE message (scheduler/output_channel.py),
and a stream whose client left is aborted, its blocks freed."""

from __future__ import annotations

import asyncio
import json

import httpx
from sse_lines import sse_lines, sse_lines_sync

NUM_STREAMS = 16
NUM_TOKENS = 64  # long enough that streams arriving over ~100 steps (a loaded 2-core machine) still overlap


def channel_totals(server) -> tuple[int, int]:
    """(items sent, deltas in them), summed over the scheduler's output channels."""
    stats = server.scheduler_call("channel_stats")
    return sum(c["num_batches"] for c in stats), sum(c["num_deltas"] for c in stats)


async def stream_tokens(http: httpx.AsyncClient, i: int) -> int:
    body = {"model": "tiny", "prompt": f"stream {i} says", "max_tokens": NUM_TOKENS, "temperature": 0,
            "ignore_eos": True, "stream": True}
    num_chunks = 0
    async with http.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        async for line in sse_lines(response):
            if line.startswith("data: {"):
                event = json.loads(line[6:])
                num_chunks += sum(1 for choice in event["choices"] if choice["text"])
    return num_chunks


def test_one_ray_message_per_step_carries_every_streams_delta(server) -> None:
    server.wait_until_idle()
    batches_before, deltas_before = channel_totals(server)
    steps_before = server.scheduler_status().num_steps
    channel_steps_before = sum(server.scheduler_call("routing_stats")["channel_steps_per_worker"])

    async def run() -> list[int]:
        limits = httpx.Limits(max_connections=NUM_STREAMS + 2)
        async with httpx.AsyncClient(base_url=server.url, timeout=120, limits=limits) as http:
            return list(await asyncio.gather(*(stream_tokens(http, i) for i in range(NUM_STREAMS))))

    chunks = asyncio.run(run())
    server.wait_until_idle()
    batches, deltas = channel_totals(server)
    num_batches, num_deltas = batches - batches_before, deltas - deltas_before
    num_steps = server.scheduler_status().num_steps - steps_before
    assert sum(chunks) > NUM_STREAMS * NUM_TOKENS // 2  # text chunks (a few tokens decode to nothing)
    assert num_deltas >= NUM_STREAMS * NUM_TOKENS
    # the streams shared steps. They need not all join the first one: on a loaded 2-core machine
    # they arrive over up to ~100 steps, so 16 x 64 deltas over 100 + 64 steps is about 6 a step
    assert num_deltas / num_steps >= 3, (num_deltas, num_batches, num_steps)
    # one message per engine step with deltas (never one per request); a step landing while the
    # replica is still reading the previous message merges into the next one
    assert num_batches <= num_steps, (num_deltas, num_batches, num_steps)
    stats = server.scheduler_call("channel_stats")
    assert len(stats) == 1 and stats[0]["reader_attached"] and stats[0]["num_open_requests"] == 0
    assert stats[0]["reader_transport"] == "socket"  # the replica is on the scheduler's node
    # every step went to the worker on its Unix socket (same node), none as a Ray call
    channel_steps = sum(server.scheduler_call("routing_stats")["channel_steps_per_worker"]) - channel_steps_before
    assert channel_steps == num_steps, (channel_steps, num_steps)


def test_a_stream_whose_client_left_is_aborted_and_frees_its_blocks(server) -> None:
    server.wait_until_idle()

    async def leave_early() -> None:
        body = {"model": "tiny", "prompt": "leave early", "max_tokens": 2000, "ignore_eos": True, "stream": True}
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:
            async with http.stream("POST", "/v1/completions", json=body) as response:
                num_events = 0
                async for line in sse_lines(response):
                    num_events += line.startswith("data: {")
                    if num_events == 3:
                        break  # closes the connection mid-stream

    asyncio.run(leave_early())
    status = server.wait_until_idle(timeout_s=15)
    assert status.num_unfinished_requests == 0
    assert server.scheduler_call("channel_stats")[0]["num_open_requests"] == 0


def stream_text(url: str, body: dict) -> tuple[int, str, int, bytes]:
    """(status, text, number of data chunks, the last event) of one streamed completion."""
    events = []
    with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}, timeout=60) as response:
        status = response.status_code
        for line in sse_lines_sync(response):
            if line.startswith("data: "):
                events.append(line[6:])
    chunks = [json.loads(event) for event in events if event.startswith("{")]
    text = "".join(choice["text"] for chunk in chunks for choice in chunk["choices"])
    return status, text, len(chunks), events[-1].encode() if events else b""


def test_the_proxy_and_the_replicas_own_port_answer_alike(server) -> None:
    """Serve's proxy (gRPC to the replica) and the ingress replica's own HTTP port (direct
    ingress): the same health, liveness, metrics families, streams and errors."""
    from serve_app.metrics import parse_families

    assert server.url != server.proxy_url
    answers = {}
    for url in (server.url, server.proxy_url):
        health = httpx.get(f"{url}/health", timeout=10)
        live = httpx.get(f"{url}/live", timeout=10)
        metrics = parse_families(httpx.get(f"{url}/metrics", timeout=10).text)
        body = {"model": "tiny", "prompt": "The same on both paths", "max_tokens": 12, "temperature": 0,
                "ignore_eos": True}
        streamed = stream_text(url, body)
        bad = httpx.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": -1}, timeout=10)
        answers[url] = (health.status_code, sorted(health.json()), live.json(), sorted(metrics), streamed,
                        bad.status_code, sorted(bad.json()["error"]))
        assert health.status_code == 200 and streamed[0] == 200 and streamed[3] == b"[DONE]"
        assert bad.status_code == 400, bad.text
        assert "x-request-id" in {k.lower() for k in health.headers}
    direct, proxied = answers[server.url], answers[server.proxy_url]
    assert direct == proxied


# --- stream_interval: fewer, larger chunks (docs/serving.md) -------------------------------------
STREAM_INTERVAL = 4
INTERVAL_APP = "interval"


def test_stream_interval_sends_chunks_of_that_many_tokens_with_the_same_text(server) -> None:
    """An app with stream_interval 4, through Serve's proxy and the openai client: the first
    token alone, then chunks of at least 4 tokens, the same greedy text as the shared app."""
    import openai
    from ray import serve

    from serve_app.app import build_app

    serve.run(build_app({
        "model": str(server.model_dir), "served_model_name": "tiny", "name": "rayllm-interval",
        # the shared app's engine settings (conftest.py), so the greedy texts can be compared exactly
        "num_kv_blocks": 512, "block_size": 16, "max_num_batched_tokens": 1024, "max_num_seqs": 64,
        "num_workers": 1, "worker_num_cpus": 0.5, "ingress_num_cpus": 0.1, "scheduler_num_cpus": 0.1,
        "worker_placement": "none", "dtype": "float32", "stream_interval": STREAM_INTERVAL,
    }), name=INTERVAL_APP, route_prefix=f"/{INTERVAL_APP}")
    try:
        kwargs = dict(model="tiny", prompt="The interval app says", max_tokens=NUM_TOKENS + 1, temperature=0,
                      logprobs=1, extra_body={"ignore_eos": True})
        interval = openai.OpenAI(base_url=f"{server.proxy_url}/{INTERVAL_APP}/v1", api_key="unused", max_retries=0)
        shared = openai.OpenAI(base_url=server.openai_base_url, api_key="unused", max_retries=0)
        chunks = [c.choices[0] for c in interval.completions.create(stream=True, **kwargs) if c.choices]
        tokens_per_chunk = [len(c.logprobs.tokens) for c in chunks if c.logprobs and c.logprobs.tokens]
        assert sum(tokens_per_chunk) == NUM_TOKENS + 1
        assert tokens_per_chunk[0] == 1  # the first token is not held back
        assert all(n >= STREAM_INTERVAL for n in tokens_per_chunk[1:-1]), tokens_per_chunk
        assert len(tokens_per_chunk) <= 2 + NUM_TOKENS // STREAM_INTERVAL
        assert chunks[-1].finish_reason == "length"
        every = [c.choices[0] for c in shared.completions.create(stream=True, **kwargs) if c.choices]
        assert len(every) > len(chunks)
        assert "".join(c.text for c in chunks) == "".join(c.text for c in every)
    finally:
        serve.delete(INTERVAL_APP)
