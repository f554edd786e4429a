"""The benchmark client (bench/serving_client.py) against our live server: the protocol
vLLM's benchmark relies on, and the metrics the client computes from it.

Not a timed test: it checks counts, orders and that token counts are the server's `usage`.
"""

from __future__ import annotations

import json

import httpx

from bench import datasets, serving_client

OUTPUT_LEN = 12
LATENCY_NAMES = ("ttft", "tpot", "itl", "e2el")


def run_client(server, tmp_path, *extra: str) -> dict:
    out = tmp_path / "ours.json"
    serving_client.main([
        "--base-url", server.url, "--tokenizer", str(server.model_dir), "--num-prompts", "6",
        "--output-len", str(OUTPUT_LEN), "--ignore-eos", "--max-concurrency", "3",
        "--result-json", str(out), "--no-plot", "--disable-tqdm", *extra,
    ])
    return json.loads(out.read_text())


def assert_ordered_stats(result: dict) -> None:
    for name in LATENCY_NAMES:
        stats = [result[f"{s}_{name}_ms"] for s in ("min", "p50", "p90", "p99", "max")]
        assert all(v >= 0 for v in stats) and stats == sorted(stats), (name, stats)
    for ttft, e2el in zip(result["ttfts"], result["e2els"]):
        assert 0 < ttft <= e2el


def test_random_completions_one_chunk_per_step_and_usage_counts(server, tmp_path) -> None:
    # logprobs=1: the tiny random model's tokens often end mid-UTF-8 character, and a step whose
    # text is held back sends no chunk unless it carries logprobs (vLLM does the same)
    result = run_client(server, tmp_path, "--dataset", "random", "--input-len", "40", "--range-ratio", "0.5",
                        "--extra-body", '{"logprobs": 1}')
    assert (result["completed"], result["failed"]) == (6, 0)
    assert result["server_models"][0]["root"] == str(server.model_dir)  # vLLM's client reads it
    assert all(result["usage_reported"])  # usage came in the last chunk, as asked
    # the same seeded workload, rebuilt here: what was asked of the server
    asked = datasets.random_requests(datasets.PromptTokenizer(server.model_dir), num_prompts=6,
                                     input_len=40, output_len=OUTPUT_LEN, range_ratio=0.5, seed=0)
    # ignore_eos: exactly max_tokens each, counted by the server
    assert result["output_lens"] == [r.output_len for r in asked]
    # one chunk per engine step: as many content chunks as tokens, one ITL gap per later token
    assert result["num_chunks"] == result["output_lens"]
    assert [len(itl) for itl in result["itls"]] == [r.output_len - 1 for r in asked]
    # input tokens are the server's own count of each prompt (its /tokenize agrees)
    counts = [httpx.post(f"{server.url}/tokenize", json={"model": "tiny", "prompt": r.prompt}).json()["count"]
              for r in asked]
    assert result["input_lens"] == counts and len(set(counts)) > 1
    assert all(isinstance(c, int) for c in result["cached_tokens"])  # usage.prompt_tokens_details
    assert result["total_output_tokens"] == sum(r.output_len for r in asked)
    assert_ordered_stats(result)
    server.wait_until_idle()


def test_chat_shared_prefix_hits_the_cache_and_counts_n(server, tmp_path) -> None:
    result = run_client(server, tmp_path, "--endpoint", "chat", "--dataset", "shared-prefix",
                        "--num-prefixes", "2", "--shared-prefix-len", "64", "--input-len", "8",
                        "--n", "2", "--temperature", "0.8")
    assert (result["completed"], result["failed"]) == (6, 0)
    assert result["output_lens"] == [2 * OUTPUT_LEN] * 6  # completion_tokens of both choices
    # the client counts every event that carries a choice, as vLLM's does: each choice opens with
    # a role chunk, then at most one chunk per token (a held-back partial character sends none),
    # and its finish_reason rides on its last token's chunk or on an empty one
    choices = 2
    assert all(2 * choices <= c <= n + choices for c, n in zip(result["num_chunks"], result["output_lens"])), \
        (result["num_chunks"], result["output_lens"])
    assert result["groups"]["warm"]["completed"] == 4
    # a family's later requests reuse its system prompt's blocks (16-token blocks, 64 tokens)
    warm = [c for c, g in zip(result["cached_tokens"], result["request_groups"]) if g == "warm"]
    assert all(c >= 48 for c in warm), warm
    assert_ordered_stats(result)
    server.wait_until_idle()
