"""ONE local Ray cluster and ONE served app (the tiny model) for the whole test session.

Every test talks to it over real HTTP on 127.0.0.1. Tests share the app, so each must
leave it serving (no request left running); test_http_robustness checks exactly that.
Shut down only what we started: serve.shutdown() and ray.shutdown(), never `ray stop`.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

APP_NAME = "llm"
ACTOR_PREFIX = "rayllm-test"
NUM_KV_BLOCKS = 512
BLOCK_SIZE = 16


def direct_ingress_url(app_name: str) -> str:
    """The URL of the app's ingress replica itself (Serve's direct ingress: its own uvicorn,
    no proxy hop), found from the replica's pid and the ports it listens on in Serve's range."""
    from ray.serve.context import _get_global_client

    from bench.served_app import direct_ingress_ports, listening_ports

    details = _get_global_client().get_serve_details()
    low, high = direct_ingress_ports(dict(os.environ))
    for deployment in details["applications"][app_name]["deployments"].values():
        for replica in deployment["replicas"]:
            if replica["state"] == "RUNNING" and deployment["name"].endswith("-ingress"):
                ports = [port for port in listening_ports(replica["pid"]) if low <= port < high]
                if ports:
                    return f"http://127.0.0.1:{ports[0]}"
    raise AssertionError(f"{app_name}: no ingress replica listens in {low}-{high} (direct ingress off?)")


@dataclass
class Server:
    url: str  # http://127.0.0.1:<port>: the ingress replica's own port (the shipped data plane)
    model_dir: Path
    proxy_url: str  # http://127.0.0.1:<port>: Serve's proxy (any ingress replica), route prefix /
    fresh_metrics: str  # /metrics as scraped right after the app started, before any request

    def direct_url_of(self, app_name: str) -> str:
        """Another app's ingress replica's own URL (the session's cluster; add its route prefix)."""
        return direct_ingress_url(app_name)

    @property
    def openai_base_url(self) -> str:
        return f"{self.url}/v1"

    @contextmanager
    def second_app(self, name: str, args: dict[str, Any]) -> Iterator[Any]:
        """An app of build_app(args) beside the session's, at route /name, as an openai client of its
        own ingress; deleted after the block (a module fixture's second model)."""
        import openai
        from ray import serve

        from serve_app.app import build_app

        serve.run(build_app(args), name=name, route_prefix=f"/{name}")
        try:
            yield openai.OpenAI(base_url=f"{self.direct_url_of(name)}/{name}/v1", api_key="unused", max_retries=0,
                                timeout=300)
        finally:
            if name in serve.status().applications:
                serve.delete(name)

    def scheduler_call(self, method: str) -> Any:
        """The answer of one of the scheduler actor's methods (e.g. "status"), called now."""
        import ray

        from scheduler.actor import ACTOR_NAMESPACE, scheduler_actor_name

        scheduler = ray.get_actor(scheduler_actor_name(ACTOR_PREFIX), namespace=ACTOR_NAMESPACE)
        return ray.get(getattr(scheduler, method).remote(), timeout=30)

    def scheduler_status(self) -> Any:
        """The scheduler actor's own status (not the ingress's cached copy)."""
        return self.scheduler_call("status")

    def wait_until_idle(self, timeout_s: float = 10.0) -> Any:
        """Polls until no request runs and the KV pool is fully free; returns the status."""
        deadline = time.monotonic() + timeout_s
        while True:
            status = self.scheduler_status()
            idle = status.num_running == 0 and status.num_waiting == 0 and status.num_unfinished_requests == 0
            if idle and status.num_kv_blocks_free == status.num_kv_blocks_total:
                return status
            if time.monotonic() > deadline:
                raise AssertionError(f"engine not idle after {timeout_s}s: {status}")
            time.sleep(0.05)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="session")
def ray_cluster() -> Iterator[None]:
    import ray

    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    try:
        yield
    finally:
        ray.shutdown()


@pytest.fixture(scope="session")
def server(ray_cluster: None, tiny_model_dir: Path) -> Iterator[Server]:
    from ray import serve

    from serve_app.app import build_app

    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    app = build_app({
        "model": str(tiny_model_dir),
        "served_model_name": "tiny",
        "name": ACTOR_PREFIX,
        "num_kv_blocks": NUM_KV_BLOCKS,
        "block_size": BLOCK_SIZE,
        "max_num_batched_tokens": 1024,
        "max_num_seqs": 64,
        "num_workers": 1,
        "worker_num_cpus": 1,
        # fp32: several tests compare texts across batch shapes (concurrent vs solo, failover
        # replays). In bf16 a different batch shape takes another GEMM path whose rounding can
        # flip a near-tie of the random tiny model, as it can in vLLM; fp32 keeps them exact.
        "dtype": "float32",
    })
    serve.run(app, name=APP_NAME, route_prefix="/")
    try:
        import httpx

        url = direct_ingress_url(APP_NAME)
        fresh_metrics = httpx.get(f"{url}/metrics", timeout=30).text
        yield Server(url, tiny_model_dir, f"http://127.0.0.1:{port}", fresh_metrics)
    finally:
        serve.shutdown()
