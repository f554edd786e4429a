"""Driven by test_autoscaling_cluster.py in a subprocess: elastic workers on a Ray cluster whose
own autoscaler adds and removes nodes (Ray's fake multi-node provider: nodes are processes on
this machine).

The head has 2 CPUs: one worker of 1.5 CPUs, the ingress and the scheduler fit, a second worker
does not. The node type ray.worker.cpu (2 CPUs, 0 to 1 nodes) is what Ray's autoscaler may add.
A load of concurrent greedy streams queues prompts; the scheduler's policy adds worker 1, which
stays pending until Ray's autoscaler launches a node for it; the load stops once worker 1 serves;
the policy retires it (drain, ray.kill), the node goes idle and Ray's autoscaler removes it.
Prints one `RESULT {json}` line of facts (after the teardown, so it reports leftovers too).

The cluster is started here with `ray start --head` in a fresh temp dir on a free port, never
with AutoscalingCluster.start()/shutdown() (they run `ray stop --force`, which ends every Ray
process on the machine). The teardown kills only this cluster's processes: those created after
it started whose command line names its temp dir or GCS address, and their descendants.

    python tests/multinode/autoscaling_check.py MODEL_DIR
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # every node on 127.0.0.1
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import httpx  # noqa: E402
import psutil  # noqa: E402
import ray  # noqa: E402
from ray import serve  # noqa: E402

from scheduler.actor import ACTOR_NAMESPACE, scheduler_actor_name  # noqa: E402
from serve_app.app import build_app  # noqa: E402
from workers.actor import worker_actor_name  # noqa: E402

HEAD_CPUS = 2
NODE_CPUS = 2
WORKER_CPUS = 1.5  # one worker + ingress 0.1 + scheduler 0.1 fit on the head; a second does not
NODE_TYPE = "ray.worker.cpu"
IDLE_TIMEOUT_MINUTES = 0.2  # Ray's autoscaler removes a node idle this long
OBJECT_STORE_BYTES = 200 * 2**20
APP_NAME, PREFIX = "elastic", "rayllm-as"
NUM_CLIENTS = 12  # concurrent streams: on 2 slots per worker, prompts queue
MAX_TOKENS = 150
GROW_TIMEOUT_S = 240.0  # node launch + worker load, on a shared 2-core machine
SHRINK_TIMEOUT_S = 90.0
NODE_GONE_TIMEOUT_S = 120.0


def log(message: str) -> None:
    print(f"[autoscaling_check {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def cluster_config(gcs_address: str) -> dict[str, Any]:
    """The fake multi-node provider's cluster config (the fields of Ray's
    autoscaler/_private/fake_multi_node/example.yaml), with our GCS address: the provider
    would otherwise start nodes against port 6379."""
    return {
        "cluster_name": "rayllm-autoscaling-check",
        "max_workers": 1,
        "provider": {
            "type": "fake_multinode", "use_node_id_as_ip": True, "disable_node_updaters": True,
            "disable_launch_config_check": True, "gcs_address": gcs_address,
        },
        "available_node_types": {
            "ray.head.default": {"resources": {"CPU": HEAD_CPUS}, "node_config": {}, "max_workers": 0},
            NODE_TYPE: {
                "resources": {"CPU": NODE_CPUS, "object_store_memory": OBJECT_STORE_BYTES},
                "node_config": {}, "min_workers": 0, "max_workers": 1,
            },
        },
        "head_node_type": "ray.head.default",
        "auth": {}, "upscaling_speed": 1.0, "idle_timeout_minutes": IDLE_TIMEOUT_MINUTES, "docker": {},
        "initialization_commands": [], "setup_commands": [], "head_setup_commands": [],
        "worker_setup_commands": [], "head_start_ray_commands": [], "worker_start_ray_commands": [],
        "file_mounts": {}, "cluster_synced_files": [], "file_mounts_sync_continuously": False,
        "rsync_exclude": [], "rsync_filter": [],
    }


class OwnCluster:
    """A head started with `ray start --head --autoscaling-config` in its own temp dir, and
    the means to find and end its processes (and only them)."""

    def __init__(self) -> None:
        self.temp_dir = tempfile.mkdtemp(prefix="rayas-", dir="/tmp")  # short: Unix socket paths
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.started_at = time.time()
        self.preexisting = {proc.pid for proc in psutil.process_iter()}

    def start(self) -> None:
        config = Path(self.temp_dir, "autoscaling.json")
        config.write_text(json.dumps(cluster_config(self.address)))
        env = {**os.environ, "RAY_FAKE_CLUSTER": "1", "AUTOSCALER_UPDATE_INTERVAL_S": "1",
               "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_AUTH_MODE": "disabled",
               "RAY_USAGE_STATS_ENABLED": "0"}
        ray_cli = str(Path(sys.executable).with_name("ray"))
        command = [
            ray_cli, "start", "--head", f"--autoscaling-config={config}", f"--num-cpus={HEAD_CPUS}",
            f"--port={self.port}", f"--temp-dir={self.temp_dir}", "--include-dashboard=false",
            "--node-ip-address=127.0.0.1", f"--object-store-memory={OBJECT_STORE_BYTES}",
            f"--ray-client-server-port={free_port()}", f"--dashboard-port={free_port()}",
            f"--dashboard-agent-listen-port={free_port()}",
            "--min-worker-port=0", "--max-worker-port=0", "--disable-usage-stats",
        ]
        log(f"starting the head: {' '.join(command)}")
        subprocess.run(command, env=env, check=True, timeout=180, stdout=sys.stderr, stderr=sys.stderr)

    def processes(self) -> list[psutil.Process]:
        """This cluster's processes: created after it started (never one that was already
        running), naming its temp dir or GCS address, plus their descendants (Ray workers
        retitle themselves `ray::...`, which hides their arguments)."""
        marks = (self.temp_dir, self.address, f"--gcs_server_port={self.port}")
        found: dict[int, psutil.Process] = {}
        for proc in psutil.process_iter(["pid", "cmdline", "create_time"]):
            try:
                if proc.pid == os.getpid() or proc.pid in self.preexisting:
                    continue
                if proc.info["create_time"] < self.started_at - 1:
                    continue
                if any(mark in " ".join(proc.info["cmdline"] or ()) for mark in marks):
                    found[proc.pid] = proc
                    for child in proc.children(recursive=True):
                        if child.pid not in self.preexisting and child.pid != os.getpid():
                            found[child.pid] = child
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
        return list(found.values())

    def kill(self) -> list[str]:
        """Ends this cluster's processes (TERM, then KILL); returns what it killed, for the log."""
        killed = []
        for _ in range(3):  # a raylet may start a worker while we go
            procs = self.processes()
            if not procs:
                break
            for proc in procs:
                try:
                    killed.append(" ".join(proc.cmdline()))
                    proc.send_signal(signal.SIGTERM)
                except (psutil.NoSuchProcess, psutil.AccessDenied):
                    pass
            _, alive = psutil.wait_procs(procs, timeout=10)
            for proc in alive:
                try:
                    proc.kill()
                except psutil.NoSuchProcess:
                    pass
            psutil.wait_procs(alive, timeout=5)
        for line in killed:
            log(f"killed {line[:200]}")
        return killed

    def remove_temp_dir(self) -> None:
        shutil.rmtree(self.temp_dir, ignore_errors=True)


def alive_nodes() -> list[str]:
    return sorted(node["NodeID"] for node in ray.nodes() if node["Alive"])


class Load:
    """NUM_CLIENTS clients, each sending greedy streams back to back until stop()."""

    def __init__(self, url: str) -> None:
        self._url = url
        self._stop = threading.Event()
        self.results: list[tuple[int, int]] = []  # (status, completion tokens)
        self.errors: list[str] = []
        self._threads = [threading.Thread(target=self._client, args=(k,), daemon=True) for k in range(NUM_CLIENTS)]

    def start(self) -> None:
        for thread in self._threads:
            thread.start()

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=300)

    def _client(self, k: int) -> None:
        with httpx.Client(base_url=self._url, timeout=300) as http:
            turn = 0
            while not self._stop.is_set():
                self.results.append(self._stream(http, f"Request {k}.{turn}: a story about the sea and {k * 13}."))
                turn += 1

    def _stream(self, http: httpx.Client, prompt: str) -> tuple[int, int]:
        body = {"model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
                "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
        tokens = 0
        try:
            with http.stream("POST", "/v1/completions", json=body) as response:
                if response.status_code != 200:
                    self.errors.append(f"{response.status_code}: {response.read().decode()[:300]}")
                    return response.status_code, 0
                for line in response.iter_lines():
                    if line.startswith("data: {"):
                        usage = json.loads(line[6:]).get("usage")
                        if usage:
                            tokens = usage["completion_tokens"]
        except httpx.HTTPError as error:
            self.errors.append(repr(error))
            return -1, 0
        return 200, tokens


class Watch:
    """Polls the node count and the scheduler's worker count, recording each change."""

    def __init__(self, scheduler: Any, started: float) -> None:
        self._scheduler = scheduler
        self._started = started
        self.nodes: list[tuple[float, int]] = []  # (seconds since start, alive nodes) at each change
        self.workers: list[tuple[float, int]] = []  # (seconds, serving workers) at each change
        self.status: Any = None

    def poll(self) -> None:
        now = round(time.monotonic() - self._started, 1)
        num_nodes = len(alive_nodes())
        if not self.nodes or self.nodes[-1][1] != num_nodes:
            self.nodes.append((now, num_nodes))
            log(f"alive nodes: {num_nodes}")
        self.status = ray.get(self._scheduler.status.remote(), timeout=60)
        if not self.workers or self.workers[-1][1] != self.status.num_workers:
            self.workers.append((now, self.status.num_workers))
            log(f"serving workers: {self.status.num_workers} ({self.status})")

    def until(self, predicate, timeout_s: float, what: str) -> float:
        deadline = time.monotonic() + timeout_s
        while True:
            self.poll()
            if predicate():
                return round(time.monotonic() - self._started, 1)
            if time.monotonic() > deadline:
                raise AssertionError(f"{what} not reached in {timeout_s:g}s: nodes {self.nodes}, "
                                     f"workers {self.workers}, status {self.status}")
            time.sleep(0.5)


def app_args(model_dir: str) -> dict[str, Any]:
    return {
        "model": model_dir, "served_model_name": "tiny", "name": PREFIX,
        "num_workers": 1, "min_workers": 1, "max_workers": 2, "worker_num_cpus": WORKER_CPUS,
        "worker_num_threads": 1, "worker_placement": "none", "ingress_num_cpus": 0.1, "scheduler_num_cpus": 0.1,
        "num_kv_blocks": 256, "block_size": 16, "max_num_batched_tokens": 256, "max_num_seqs": 2,
        "dtype": "float32", "scale_up_delay_s": 0.5, "scale_down_delay_s": 4.0,
        "scale_target_waiting_tokens": 32, "drain_timeout_s": 1.0, "startup_timeout_s": 180,
    }


def worker_node(index: int) -> str:
    worker = ray.get_actor(worker_actor_name(PREFIX, index), namespace=ACTOR_NAMESPACE)
    return ray.get(worker.node_id.remote(), timeout=60)


def run(model_dir: str) -> dict[str, Any]:
    head_nodes = alive_nodes()
    port = free_port()
    serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": port})
    serve.run(build_app(app_args(model_dir)), name=APP_NAME, route_prefix=f"/{APP_NAME}")
    scheduler = ray.get_actor(scheduler_actor_name(PREFIX), namespace=ACTOR_NAMESPACE)
    started = time.monotonic()
    watch = Watch(scheduler, started)
    watch.poll()
    facts: dict[str, Any] = {"head_nodes": head_nodes, "worker0_node": worker_node(0)}

    load = Load(f"http://127.0.0.1:{port}/{APP_NAME}")
    load.start()
    try:
        # worker 1 serves, on a node Ray's autoscaler added, and has taken some of the load
        facts["t_node_added"] = watch.until(lambda: len(watch.nodes) >= 2 and watch.nodes[-1][1] == 2,
                                            GROW_TIMEOUT_S, "a second node")
        facts["t_two_workers"] = watch.until(lambda: watch.status.num_workers == 2, GROW_TIMEOUT_S,
                                             "a second serving worker")
        facts["worker1_node"] = worker_node(1)
        facts["nodes_with_two_workers"] = alive_nodes()
        routing = ray.get(scheduler.routing_stats.remote(), timeout=60)
        deadline = time.monotonic() + 60
        while routing["routed_per_worker"][1] == 0 and time.monotonic() < deadline:
            time.sleep(0.5)
            routing = ray.get(scheduler.routing_stats.remote(), timeout=60)
        facts["routed_while_two"] = routing["routed_per_worker"]
    finally:
        load.stop()
    facts["t_load_stopped"] = round(time.monotonic() - started, 1)
    stats = ray.get(scheduler.published_stats.remote(), timeout=60)
    facts["published_worker_nodes"] = {w.worker: w.node_id for w in stats.workers}

    facts["t_one_worker"] = watch.until(
        lambda: watch.status.num_workers == 1 and watch.status.num_starting_workers == 0, SHRINK_TIMEOUT_S,
        "back to one worker")
    stats = ray.get(scheduler.published_stats.remote(), timeout=60)
    facts["remaining_workers"] = {w.worker: w.node_id for w in stats.workers}
    facts["t_node_removed"] = watch.until(lambda: watch.nodes[-1][1] == 1, NODE_GONE_TIMEOUT_S,
                                          "the idle node's removal")
    facts["nodes_at_end"] = alive_nodes()
    facts["routed_per_worker"] = ray.get(scheduler.routing_stats.remote(), timeout=60)["routed_per_worker"]
    facts["node_counts"] = watch.nodes
    facts["worker_counts"] = watch.workers
    facts["num_requests"] = len(load.results)
    facts["num_ok"] = sum(status == 200 and tokens == MAX_TOKENS for status, tokens in load.results)
    facts["errors"] = load.errors[:5]
    serve.delete(APP_NAME)
    return facts


def call_with_timeout(function, timeout_s: float) -> None:
    thread = threading.Thread(target=function, daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        log(f"{function.__name__} did not return in {timeout_s:g}s")


def main(model_dir: str) -> int:
    cluster = OwnCluster()
    facts: dict[str, Any] = {}
    error = None
    try:
        cluster.start()
        ray.init(address=cluster.address, log_to_driver=False)
        facts = run(model_dir)
    except Exception as caught:  # reported in the RESULT line, after the teardown
        error = f"{type(caught).__name__}: {caught}"
        log(f"failed: {error}")
    finally:
        if ray.is_initialized():
            call_with_timeout(serve.shutdown, 60)
            ray.shutdown()
        facts["temp_dir"], facts["gcs_address"] = cluster.temp_dir, cluster.address
        facts["killed"] = cluster.kill()
        facts["leftover_processes"] = [proc.pid for proc in cluster.processes()]
        cluster.remove_temp_dir()
    facts["error"] = error
    print("RESULT " + json.dumps(facts), flush=True)
    return 0 if error is None else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
