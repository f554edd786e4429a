"""Pure tests of the benchmark's metric math, SSE parsing, workloads and report (no server)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from bench import datasets, report
from bench.metrics import RequestResult, calculate_metrics, parse_goodput
from bench.request_func import SSEParser


def ok(ttft, latency, output_tokens, itl, *, n=1, prompt_len=10, start=0.0, group="all") -> RequestResult:
    chunk_times = [ttft]
    for gap in itl:
        chunk_times.append(chunk_times[-1] + gap)
    return RequestResult(success=True, group=group, n=n, prompt_len=prompt_len, output_tokens=output_tokens,
                         usage_reported=True, start_time=start, ttft=ttft, latency=latency, itl=list(itl),
                         chunk_times=chunk_times)


def test_tpot_uses_usage_tokens_not_chunks():
    # 10 tokens in 5 chunks (2 tokens each): 4 ITL gaps of 0.2 s, TPOT over 9 token gaps
    r = ok(0.1, 0.9, 10, [0.2] * 4)
    m = calculate_metrics([r], 1.0, [50, 99])
    assert m["mean_tpot_ms"] == pytest.approx(800 / 9)
    assert m["mean_itl_ms"] == pytest.approx(200)  # one gap per chunk, as vLLM
    assert m["total_output_tokens"] == 10 and m["output_throughput"] == pytest.approx(10.0)


def test_n2_tpot_is_per_sequence():
    r = ok(0.1, 1.0, 20, [0.1] * 18, n=2)  # 2 choices x 10 tokens
    assert r.tpot == pytest.approx(0.9 / 9)


def test_aggregates_percentiles_and_failures():
    rs = [ok(0.1 * i, 1.0 + 0.1 * i, 5, [0.05 * i] * 4, start=0.2 * i) for i in range(1, 11)]
    rs.append(RequestResult(error="boom"))
    m = calculate_metrics(rs, 4.0, [50, 90, 99])
    assert m["completed"] == 10 and m["failed"] == 1
    assert m["total_input_tokens"] == 100 and m["total_output_tokens"] == 50
    assert m["request_throughput"] == pytest.approx(2.5)
    assert m["total_token_throughput"] == pytest.approx(150 / 4)
    ttfts = np.array([0.1 * i for i in range(1, 11)]) * 1000
    assert m["p90_ttft_ms"] == pytest.approx(np.percentile(ttfts, 90))
    assert m["median_ttft_ms"] == pytest.approx(np.median(ttfts))
    assert m["min_ttft_ms"] <= m["p50_ttft_ms"] <= m["p99_ttft_ms"] <= m["max_ttft_ms"]
    assert m["max_concurrent_requests"] >= 2
    assert "request_goodput" not in m


def test_goodput_counts_requests_within_every_slo():
    fast = ok(0.1, 0.5, 5, [0.1] * 4)  # TPOT 100 ms
    slow_start = ok(0.9, 1.3, 5, [0.1] * 4)
    one_token = ok(0.2, 0.2, 1, [])  # TPOT counts as 0 for goodput, as in vLLM
    m = calculate_metrics([fast, slow_start, one_token], 2.0, [99], parse_goodput(["ttft:500", "tpot:150"]))
    assert m["num_good_requests"] == 2 and m["request_goodput"] == pytest.approx(1.0)
    m = calculate_metrics([fast, slow_start, one_token], 2.0, [99], {"tpot": 50})
    assert m["num_good_requests"] == 1
    assert m["median_tpot_ms"] == pytest.approx(100)  # the 1-token request is not in TPOT


def test_parse_goodput_rejects_bad_input():
    assert parse_goodput(["e2el:1000"]) == {"e2el": 1000.0}
    for bad in (["ttft"], ["itl:5"], ["ttft:-1"]):
        with pytest.raises(ValueError):
            parse_goodput(bad)


def test_empty_run_is_all_zero_not_nan():
    m = calculate_metrics([RequestResult(error="x")], 1.0, [99])
    assert m["completed"] == 0 and m["p99_itl_ms"] == 0.0 and m["max_output_tokens_per_s"] == 0.0


def test_sse_parser_handles_split_events_and_utf8():
    payload = json.dumps({"choices": [{"text": "é"}]}, ensure_ascii=False).encode()
    stream = b": ping\r\n\r\ndata: " + payload + b"\r\n\r\ndata: [DONE]\n\n"
    p = SSEParser()
    out = []
    for i in range(len(stream)):  # one byte at a time splits the 2-byte character too
        out += p.feed(stream[i:i + 1])
    assert out == [payload.decode(), "[DONE]"]


def test_workloads_hit_their_lengths_and_order(tiny_model_dir):
    tok = datasets.PromptTokenizer(tiny_model_dir)
    rs = datasets.random_requests(tok, num_prompts=20, input_len=40, output_len=7, range_ratio=0.5, seed=1)
    assert all(20 <= r.prompt_len <= 60 and 3 <= r.output_len <= 11 for r in rs)
    assert all(len(tok.encode(r.prompt)) == r.prompt_len for r in rs)
    again = datasets.random_requests(tok, num_prompts=20, input_len=40, output_len=7, range_ratio=0.5, seed=1)
    assert [r.prompt for r in again] == [r.prompt for r in rs]  # seeded
    sp = datasets.shared_prefix_requests(tok, num_prompts=7, num_prefixes=3, shared_prefix_len=50,
                                         input_len=5, output_len=4)
    assert [r.family for r in sp] == [0, 1, 2, 0, 1, 2, 0]
    assert [r.group for r in sp] == ["cold"] * 3 + ["warm"] * 4
    assert len({r.system for r in sp}) == 3 and len({r.prompt for r in sp}) == 7
    body = datasets.request_body(sp[0], model="m", chat=False, ignore_eos=True, temperature=0.0)
    assert body["prompt"].startswith(sp[0].system) and body["stream_options"] == {"include_usage": True}
    chat = datasets.request_body(sp[0], model="m", chat=True, ignore_eos=False, temperature=0.0)
    assert [m["role"] for m in chat["messages"]] == ["system", "user"] and "ignore_eos" not in chat
    lp = datasets.long_prompt_requests(tok, num_prompts=6, num_long=2, long_input_len=200, long_output_len=3,
                                       input_len=10, output_len=5)
    assert [r.group for r in lp] == ["short", "short", "long", "short", "short", "long", "short", "short"]
    assert all(r.prompt_len == 200 for r in lp if r.group == "long")


def test_report_table_and_plots(tmp_path):
    rs = [ok(0.1, 0.5, 5, [0.1] * 4, group=g) for g in ("short", "long")]
    runs = []
    for conc in (1, 4):
        m = calculate_metrics(rs, 1.0, [50, 90, 99])
        m.update(label="demo", dataset="random", max_concurrency=conc, num_prompts=2, percentiles=[50, 90, 99],
                 groups={"short": m, "long": m}, errors=["", ""], request_groups=["short", "long"],
                 ttfts=[0.1, 0.1], tpots=[0.1, 0.1], e2els=[0.5, 0.5], itls=[[0.1] * 4] * 2)
        runs.append(m)
    table = report.results_table(runs)
    assert table.count("\n") == 3 and "| demo | random | 4 |" in table
    report.plot_throughput_vs_concurrency(runs, tmp_path / "tput.png")
    report.plot_latency_cdfs(runs[0], tmp_path / "cdf.png")
    assert (tmp_path / "tput.png").stat().st_size > 0 and (tmp_path / "cdf.png").stat().st_size > 0
    assert "Successful requests:" in report.format_summary(runs[0])
