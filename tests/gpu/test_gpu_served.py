"""The served path on a GPU: Ray Serve, the ingress, the scheduler and a CUDA worker, over HTTP.

tests/gpu/test_gpu.py checks the kernels and the runner on CUDA without Ray. This one starts a
local Ray with the GPU, serves the tiny random Llama with `worker_device: cuda` (Triton
attention, decode CUDA graphs captured inside the Ray worker, as shipped) and checks over
HTTP that:

- /v1/models reports the resolved backend (cuda, triton) and /health answers 200;
- greedy completions equal our runner's on CPU (torch attention, fp32) for the same prompts,
  alone and as 8 concurrent streams (decode batches replayed from captured graphs);
- a bad request gets a 400 and the server goes on.

Skips without CUDA, and without Ray Serve (the GPU machines lent to this project have no Ray:
scripts/gpu_check.sh installs the wheels carried in .whl/ first; docs/gpu.md says which).
Set RAYLLM_SERVED_SMOKE_DEVICE=cpu to run the same checks with a CPU worker, which is how the
test itself is checked on a machine without a GPU.
"""

from __future__ import annotations

import concurrent.futures
import os
import sys
from pathlib import Path

import pytest
import torch

DEVICE = os.environ.get("RAYLLM_SERVED_SMOKE_DEVICE", "cuda")
if DEVICE == "cuda" and not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)
if os.environ.get("TRITON_INTERPRET") == "1":
    pytest.skip("TRITON_INTERPRET=1 is set: the served worker must run the compiled kernels", allow_module_level=True)
pytest.importorskip("ray.serve", reason="Ray Serve is not installed on this machine")
httpx = pytest.importorskip("httpx")

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "workers"))
from runner_helpers import greedy, make_runner, run_requests  # noqa: E402  (tests/workers/runner_helpers.py)

from bench.served_app import free_port  # noqa: E402

# one xdist worker runs the whole module (scripts/gpu_check.sh: --dist loadgroup), so the app starts once
pytestmark = [pytest.mark.gpu, pytest.mark.xdist_group("served")]

PROMPTS = [
    "The capital of France is",
    "Once upon a time there was a small robot",
    "One, two, three,",
    "def add(a, b):",
    "A paged key value cache stores",
    "Berlin is the capital of",
    "What is the capital of France?",
    "The quick brown fox",
]
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def served(tiny_model_dir):
    import ray
    from ray import serve

    from serve_app.app import build_app

    ray.init(address="local", num_cpus=4, num_gpus=1 if DEVICE == "cuda" else 0,
             include_dashboard=False, log_to_driver=False)
    port = free_port()
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(build_app({
            "model": str(tiny_model_dir),
            "served_model_name": "tiny",
            "worker_device": DEVICE,
            "num_workers": 1,
            "dtype": "float32",  # exact: the served tokens are compared with the CPU runner's
            "block_size": 16,  # the Triton kernel's minimum tile
            "num_kv_blocks": 512,
            "max_num_batched_tokens": 1024,
            "max_num_seqs": 32,
            "worker_num_cpus": 1,
        }), name="gpu-served", route_prefix="/")
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()


@pytest.fixture(scope="module")
def cpu_reference(tiny_model_dir) -> dict[str, list[int]]:
    """Greedy output ids of our runner on CPU (torch attention, fp32), prompt by prompt."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    runner = make_runner(tiny_model_dir)
    prompts = [tokenizer.encode(text) for text in PROMPTS]
    outputs = run_requests(runner, prompts, greedy(MAX_TOKENS))
    return {text: ids for text, ids in zip(PROMPTS, outputs)}


def _complete(base_url: str, prompt: str) -> dict:
    response = httpx.post(f"{base_url}/v1/completions", timeout=120, json={
        "model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0.0,
        "ignore_eos": True,
    })
    assert response.status_code == 200, response.text
    return response.json()


def test_models_report_the_gpu_backend_and_health_is_ok(served) -> None:
    assert httpx.get(f"{served}/health", timeout=30).status_code == 200
    models = httpx.get(f"{served}/v1/models", timeout=30).json()["data"]
    backend = models[0]["backend"]
    assert backend["device"] == DEVICE, backend
    if DEVICE == "cuda":  # as shipped: Triton attention, decode graphs captured inside the Ray worker
        assert backend["attention_backend"] == "triton", backend
        assert backend["cuda_graph_batch_sizes"][:3] == [1, 2, 4], backend


def _text_of(tiny_model_dir, ids: list[int]) -> str:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir).decode(ids, skip_special_tokens=True)


def test_greedy_alone_equals_the_cpu_runner(served, cpu_reference, tiny_model_dir) -> None:
    for prompt in PROMPTS[:3]:
        body = _complete(served, prompt)
        assert body["usage"]["completion_tokens"] == MAX_TOKENS
        assert body["choices"][0]["text"] == _text_of(tiny_model_dir, cpu_reference[prompt]), prompt


def test_concurrent_greedy_streams_equal_the_cpu_runner(served, cpu_reference, tiny_model_dir) -> None:
    with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
        bodies = list(pool.map(lambda prompt: _complete(served, prompt), PROMPTS))
    for prompt, body in zip(PROMPTS, bodies):
        assert body["choices"][0]["text"] == _text_of(tiny_model_dir, cpu_reference[prompt]), prompt


def test_a_bad_request_is_a_400_and_the_server_goes_on(served, cpu_reference, tiny_model_dir) -> None:
    bad = httpx.post(f"{served}/v1/completions", timeout=30,
                     json={"model": "tiny", "prompt": "hi", "max_tokens": -5})
    assert bad.status_code == 400, bad.text
    assert bad.json()["error"]["type"]
    body = _complete(served, PROMPTS[0])
    assert body["choices"][0]["text"] == _text_of(tiny_model_dir, cpu_reference[PROMPTS[0]])
