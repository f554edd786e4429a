"""The benchmark client against a live HF baseline server (tiny random Llama, 127.0.0.1).

Checks what the client computes, not how fast anything is: counts, non-negative values,
percentiles in order, token counts equal to the server's `usage`, JSON and PNG written.
"""

from __future__ import annotations

import asyncio
import json
import os
import time

import httpx
import numpy as np
import pytest
from transformers import AutoTokenizer

from bench import datasets, serving_client

OUTPUT_LEN = 8
LATENCY_NAMES = ("ttft", "tpot", "itl", "e2el")


def run_client(base_url: str, model_dir, extra: list[str]) -> dict:
    argv = ["--base-url", base_url, "--tokenizer", str(model_dir), "--disable-tqdm", *extra]
    return asyncio.run(serving_client.benchmark(serving_client.parse_args(argv)))


def assert_sane_aggregates(result: dict, num_requests: int) -> None:
    assert result["completed"] == num_requests and result["failed"] == 0
    assert result["num_without_usage"] == 0
    assert result["total_output_tokens"] == sum(result["output_lens"])
    assert result["total_input_tokens"] == sum(result["input_lens"])
    duration = result["duration"]
    assert duration > 0
    assert result["request_throughput"] == pytest.approx(num_requests / duration)
    assert result["output_throughput"] == pytest.approx(result["total_output_tokens"] / duration)
    total = result["total_input_tokens"] + result["total_output_tokens"]
    assert result["total_token_throughput"] == pytest.approx(total / duration)
    for name in LATENCY_NAMES:
        stats = [result[f"{s}_{name}_ms"] for s in ("min", "p50", "p90", "p99", "max")]
        assert all(v >= 0 for v in stats), (name, stats)
        assert stats == sorted(stats), (name, stats)
        assert result[f"median_{name}_ms"] == pytest.approx(result[f"p50_{name}_ms"])
        assert stats[0] - 1e-9 <= result[f"mean_{name}_ms"] <= stats[-1] + 1e-9
    for ttft, e2el in zip(result["ttfts"], result["e2els"]):
        assert 0 <= ttft <= e2el


def test_random_completions_metrics_match_usage(hf_server, tmp_path):
    base_url, model_dir = hf_server
    out = tmp_path / "run.json"
    serving_client.main([
        "--base-url", base_url, "--tokenizer", str(model_dir), "--dataset", "random",
        "--num-prompts", "6", "--input-len", "32", "--range-ratio", "0.5",
        "--output-len", str(OUTPUT_LEN), "--ignore-eos", "--max-concurrency", "2",
        "--goodput", "ttft:600000", "tpot:600000", "--result-json", str(out), "--disable-tqdm",
        "--server-pid", str(os.getsid(0)),  # no `serve run` here: this session's processes stand in
    ])
    result = json.loads(out.read_text())
    assert out.with_suffix(".png").stat().st_size > 0
    assert_sane_aggregates(result, 6)
    assert "| CPU ms per output token |" in result["cpu_table"]
    assert f"client (this process) ({os.getpid()})" in result["cpu_s"]
    assert "| waited for a core, s |" in result["cpu_table"]
    assert result["wait_s"].keys() == result["cpu_s"].keys() and min(result["wait_s"].values()) >= 0
    assert result["max_concurrent_requests"] <= 2
    assert result["request_goodput"] == pytest.approx(result["request_throughput"])
    # the same seeded workload, rebuilt here: what was asked of the server
    asked = datasets.random_requests(
        datasets.PromptTokenizer(model_dir), num_prompts=6, input_len=32, output_len=OUTPUT_LEN,
        range_ratio=0.5, seed=0,
    )
    # output tokens are usage.completion_tokens: with ignore_eos, exactly max_tokens each
    assert result["output_lens"] == [r.output_len for r in asked]
    # the HF server sends one chunk per token: one ITL per chunk after the first
    assert result["num_chunks"] == result["output_lens"]
    assert [len(x) for x in result["itls"]] == [r.output_len - 1 for r in asked]
    # input tokens are usage.prompt_tokens: the server's own tokenization of each prompt
    server_tok = AutoTokenizer.from_pretrained(str(model_dir))
    assert result["input_lens"] == [len(server_tok(r.prompt)["input_ids"]) for r in asked]
    assert len(set(result["input_lens"])) > 1  # the range ratio did vary the lengths
    assert result["cached_tokens"] == [None] * 6  # the HF server reports no cache details


def test_chat_shared_prefix_with_n2(hf_server):
    base_url, model_dir = hf_server
    result = run_client(base_url, model_dir, [
        "--endpoint", "chat", "--dataset", "shared-prefix", "--num-prefixes", "2",
        "--shared-prefix-len", "64", "--num-prompts", "4", "--input-len", "8",
        "--output-len", str(OUTPUT_LEN), "--n", "2", "--temperature", "0.8", "--ignore-eos",
        "--max-concurrency", "2", "--request-rate", "50",
    ])
    assert_sane_aggregates(result, 4)
    assert result["output_lens"] == [2 * OUTPUT_LEN] * 4  # completion_tokens sums both choices
    assert result["num_chunks"] == [2 * OUTPUT_LEN] * 4
    assert [len(x) for x in result["itls"]] == [2 * (OUTPUT_LEN - 1)] * 4  # ITL per choice
    assert result["finish_reasons"] == [["length", "length"]] * 4
    assert result["request_groups"] == ["cold", "cold", "warm", "warm"]
    assert set(result["groups"]) == {"cold", "warm"}
    # TPOT per sequence: (E2E - TTFT) / (tokens per choice - 1)
    for tpot, ttft, e2el in zip(result["tpots"], result["ttfts"], result["e2els"]):
        assert tpot == pytest.approx((e2el - ttft) / (OUTPUT_LEN - 1))


def test_long_prompt_groups(hf_server):
    base_url, model_dir = hf_server
    result = run_client(base_url, model_dir, [
        "--dataset", "long-prompt", "--num-prompts", "4", "--num-long", "1",
        "--long-input-len", "300", "--input-len", "16", "--output-len", "4", "--ignore-eos",
        "--max-concurrency", "3", "--skip-initial-test",
    ])
    assert_sane_aggregates(result, 5)
    assert result["request_groups"] == ["short", "short", "long", "short", "short"]
    assert result["groups"]["long"]["completed"] == 1
    assert result["groups"]["long"]["total_input_tokens"] >= 290
    assert result["groups"]["short"]["total_input_tokens"] <= 4 * 20


def test_max_duration_bounds_the_run_and_frees_the_server(hf_server):
    base_url, model_dir = hf_server
    cut_before = httpx.get(base_url + "/stats", timeout=10).json()["num_cut"]
    result = run_client(base_url, model_dir, [
        "--num-prompts", "20", "--input-len", "16", "--output-len", "1000", "--ignore-eos",
        "--max-concurrency", "2", "--skip-initial-test", "--max-duration", "0.3",
    ])
    assert result["failed"] == 20 and result["completed"] == 0
    assert all("max-duration" in e for e in result["errors"])
    # the dropped stream that was generating stopped its generate before its 1000 tokens (the
    # server counts generates cut short), so the lock is free again and a short request is served
    for _ in range(300):  # a hang guard: 30 s
        if httpx.get(base_url + "/stats", timeout=10).json()["num_cut"] > cut_before:
            break
        time.sleep(0.1)
    else:
        raise AssertionError("the dropped stream's generate ran on: the server counted no generate cut short")
    body = {"prompt": "hello", "max_tokens": 2, "ignore_eos": True}
    response = httpx.post(base_url + "/v1/completions", json=body, timeout=60)
    assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 2


def test_models_endpoint_has_root(hf_server):
    base_url, model_dir = hf_server
    card = httpx.get(base_url + "/v1/models", timeout=10).json()["data"][0]
    assert card["root"] == str(model_dir) and card["id"]


@pytest.mark.parametrize("url", ["http://10.0.0.1:8000", "http://example.com", "http://0.0.0.0:80"])
def test_refuses_non_loopback(url):
    with pytest.raises(SystemExit):
        serving_client.check_loopback(url)


@pytest.mark.parametrize("url", ["http://127.0.0.1:8000", "http://localhost:1", "http://[::1]:8000"])
def test_accepts_loopback(url):
    serving_client.check_loopback(url)


def test_arrival_offsets_seeded_and_normalized():
    a = serving_client.arrival_offsets(50, 10.0, 1.0, seed=3)
    assert a == serving_client.arrival_offsets(50, 10.0, 1.0, seed=3)
    assert a != serving_client.arrival_offsets(50, 10.0, 1.0, seed=4)
    assert np.all(np.diff(a) >= 0) and a[-1] == pytest.approx(5.0)
    assert serving_client.arrival_offsets(4, float("inf"), 1.0, seed=0) == [0.0] * 4
