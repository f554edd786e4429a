"""Driven by test_multinode.py in a subprocess: a 2-node local Ray cluster
(ray.cluster_utils.Cluster on 127.0.0.1), the tiny model served by

1. app "mn": 2 workers placed STRICT_SPREAD (one per node), one scheduler, default
   prefix_aware routing;
2. app "sharded": 2 scheduler shards x 1 worker,

and real HTTP requests through each. Prints one JSON line of facts for the test to check.
A subprocess, so this cluster never meets the session cluster of tests/integration.
Shuts down only what it started (serve, ray.shutdown, cluster.shutdown); never `ray stop`.

    python tests/multinode/cluster_check.py MODEL_DIR
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from concurrent.futures import ThreadPoolExecutor

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import httpx  # noqa: E402
import ray  # noqa: E402
from ray import serve  # noqa: E402
from ray.cluster_utils import Cluster  # noqa: E402

from serve_app.app import build_app  # noqa: E402
from scheduler.actor import ACTOR_NAMESPACE, scheduler_actor_name  # noqa: E402
from scheduler.sharding import shard_of  # noqa: E402
from workers.actor import worker_actor_name  # noqa: E402

NODE_CPUS = 2
BLOCK_SIZE = 16


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def app_args(model_dir: str, name: str, **extra: object) -> dict:
    return {
        "model": model_dir, "served_model_name": "tiny", "name": name, "num_kv_blocks": 256,
        "block_size": BLOCK_SIZE, "max_num_batched_tokens": 512, "max_num_seqs": 32,
        "worker_num_cpus": 1, "scheduler_num_cpus": 0.1, "ingress_num_cpus": 0.1, "startup_timeout_s": 120,
        **extra,
    }


def complete(client: httpx.Client, prefix: str, prompt: list[int]) -> dict:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 4, "temperature": 0}
    response = client.post(f"{prefix}/v1/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


def check_spread_app(url: str, model_dir: str) -> dict:
    name = "rayllm-mn"
    serve.run(build_app(app_args(model_dir, name, num_workers=2, worker_placement="strict_spread")),
              name="mn", route_prefix="/mn")
    workers = [ray.get_actor(worker_actor_name(name, i), namespace=ACTOR_NAMESPACE) for i in range(2)]
    worker_nodes = ray.get([worker.node_id.remote() for worker in workers], timeout=30)
    prompts = [[(7 * i + k) % 200 + 1 for k in range(40)] for i in range(12)]  # distinct first blocks
    with httpx.Client() as client, ThreadPoolExecutor(6) as pool:
        results = list(pool.map(lambda p: complete(client, f"{url}/mn", p), prompts))
    scheduler = ray.get_actor(scheduler_actor_name(name), namespace=ACTOR_NAMESPACE)
    stats = ray.get(scheduler.routing_stats.remote(), timeout=30)
    serve.delete("mn")
    return {
        "worker_nodes": worker_nodes,
        "num_ok": sum(len(r["choices"]) == 1 and r["usage"]["completion_tokens"] == 4 for r in results),
        "routing": stats,
    }


def check_sharded_app(url: str, model_dir: str) -> dict:
    name = "rayllm-shards"
    serve.run(build_app(app_args(model_dir, name, num_workers=2, num_scheduler_shards=2)),
              name="sharded", route_prefix="/sharded")
    prompts = [[i + 1] * BLOCK_SIZE + [3, 4, 5] for i in range(16)]
    expected = [0, 0]
    for prompt in prompts:
        expected[shard_of(prompt, BLOCK_SIZE, 2)] += 1
    with httpx.Client() as client, ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda p: complete(client, f"{url}/sharded", p), prompts))
    shards = [ray.get_actor(scheduler_actor_name(name, s), namespace=ACTOR_NAMESPACE) for s in range(2)]
    stats = ray.get([shard.routing_stats.remote() for shard in shards], timeout=30)
    statuses = ray.get([shard.status.remote() for shard in shards], timeout=30)
    serve.delete("sharded")
    return {
        "num_ok": sum(r["usage"]["completion_tokens"] == 4 for r in results),
        "expected_per_shard": expected,
        "routed_per_shard": [sum(s["routed_per_worker"]) for s in stats],
        "workers_per_shard": [status.num_workers for status in statuses],
    }


def main(model_dir: str) -> None:
    start = time.monotonic()
    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": NODE_CPUS, "node_ip_address": "127.0.0.1", "include_dashboard": False},
    )
    cluster.add_node(num_cpus=NODE_CPUS, node_ip_address="127.0.0.1")
    try:
        ray.init(address=cluster.address, log_to_driver=False)
        cluster.wait_for_nodes()
        node_ids = sorted(node["NodeID"] for node in ray.nodes() if node["Alive"])
        port = free_port()
        serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": port})
        url = f"http://127.0.0.1:{port}"
        facts = {"node_ids": node_ids, "spread": check_spread_app(url, model_dir)}
        facts["sharded"] = check_sharded_app(url, model_dir)
        facts["seconds"] = round(time.monotonic() - start, 1)
        print("RESULT " + json.dumps(facts), flush=True)
    finally:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()
            cluster.shutdown()


if __name__ == "__main__":
    main(sys.argv[1])
