"""Serving metrics, computed the way vLLM's `benchmark_serving` / `vllm bench serve` does.

Per request (only successful requests count toward latency metrics):

    start ─── TTFT ───> first content chunk ── ITL ──> chunk ── ITL ──> ... last content chunk
    |<──────────────────────────────── E2E latency ──────────────────────────────────>|

- TTFT: send -> first chunk that carries a choice (the trailing usage-only chunk does not count).
- ITL:  the gap between consecutive content chunks of one choice. One entry per chunk, not
        per token: a chunk that carries k tokens gives one (k times longer) gap, as in vLLM.
- E2E:  send -> last content chunk.
- TPOT: (E2E - TTFT) / (tokens per sequence - 1), only for requests with more than one
        token per sequence; tokens per sequence = usage.completion_tokens / n.
- Token counts come from the server's `usage` (prompt_tokens, completion_tokens). Without
  usage, output tokens fall back to the chunk count and `num_without_usage` says how many.

Aggregates over the benchmark duration (first send -> last request done):
request, output-token and total-token throughput; goodput = requests meeting every SLO given
(ttft / tpot / e2el in ms; a request with one token per sequence has TPOT 0, as in vLLM) per
second; mean / median / std / min / max and chosen percentiles (numpy linear interpolation)
of TTFT, TPOT, ITL and E2E in ms; peak output tokens per one-second bucket and peak number of
requests in flight. Result keys follow vLLM's result JSON (`p99_ttft_ms`, ...).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

GOODPUT_KEYS = ("ttft", "tpot", "e2el")
LATENCY_METRICS = ("ttft", "tpot", "itl", "e2el")


@dataclass(slots=True)
class RequestResult:
    success: bool = False
    error: str = ""
    group: str = "all"
    n: int = 1  # choices asked for
    prompt_len: int = 0  # usage.prompt_tokens (the dataset's count if usage is missing)
    output_tokens: int = 0  # usage.completion_tokens: all choices together
    usage_reported: bool = False  # False: output_tokens is the content chunk count
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens, if sent
    start_time: float = 0.0  # perf_counter() at send, s
    ttft: float = 0.0  # s
    latency: float = 0.0  # E2E, s
    itl: list[float] = field(default_factory=list)  # s, one per content chunk after the first
    chunk_times: list[float] = field(default_factory=list)  # s after start, every content chunk
    finish_reasons: list[str | None] = field(default_factory=list)  # per choice index
    generated_text: str = ""  # choice 0

    @property
    def tokens_per_sequence(self) -> float:
        return self.output_tokens / max(self.n, 1)

    @property
    def tpot(self) -> float:
        """Seconds per output token after the first, per sequence; 0 with <= 1 token."""
        per_seq = self.tokens_per_sequence
        if per_seq <= 1:
            return 0.0
        return (self.latency - self.ttft) / (per_seq - 1)


def parse_goodput(items: list[str] | None) -> dict[str, float]:
    """['ttft:500', 'tpot:50'] -> {'ttft': 500.0, 'tpot': 50.0} (milliseconds)."""
    slos: dict[str, float] = {}
    for item in items or []:
        key, sep, value = item.partition(":")
        if not sep or key not in GOODPUT_KEYS:
            raise ValueError(f"goodput SLO {item!r}: expected KEY:MS with KEY in {GOODPUT_KEYS}")
        slos[key] = float(value)
        if slos[key] < 0:
            raise ValueError(f"goodput SLO {item!r} must be non-negative")
    return slos


def percentile_key(p: float) -> str:
    return str(int(p)) if int(p) == p else str(p)


def _summary(name: str, values_s: list[float], percentiles: list[float]) -> dict[str, float]:
    arr = np.asarray(values_s if values_s else [0.0], dtype=float) * 1000.0
    out = {
        f"mean_{name}_ms": float(np.mean(arr)),
        f"median_{name}_ms": float(np.median(arr)),
        f"std_{name}_ms": float(np.std(arr)),
        f"min_{name}_ms": float(np.min(arr)),
        f"max_{name}_ms": float(np.max(arr)),
    }
    for p in percentiles:
        out[f"p{percentile_key(p)}_{name}_ms"] = float(np.percentile(arr, p))
    return out


def _is_good(r: RequestResult, slos: dict[str, float]) -> bool:
    measured = {"ttft": r.ttft, "tpot": r.tpot, "e2el": r.latency}
    return all(measured[k] <= ms / 1000.0 for k, ms in slos.items())


def _peaks(ok: list[RequestResult]) -> tuple[float, int]:
    """(max output chunks in any one-second bucket, max requests in flight at once)."""
    if not ok:
        return 0.0, 0
    t0 = min(r.start_time for r in ok)
    end = max(r.start_time + r.latency for r in ok)
    buckets = np.zeros(int(np.ceil(end - t0)) + 1)
    for r in ok:
        for t in r.chunk_times:
            buckets[int(r.start_time + t - t0)] += 1
    events = sorted([(r.start_time, 1) for r in ok] + [(r.start_time + r.latency, -1) for r in ok])
    in_flight = peak = 0
    for _, delta in events:  # a departure at the same instant sorts first (-1 < 1)
        in_flight += delta
        peak = max(peak, in_flight)
    return float(buckets.max()), peak


def calculate_metrics(
    results: list[RequestResult],
    duration_s: float,
    percentiles: list[float],
    goodput_slos: dict[str, float] | None = None,
) -> dict:
    """The aggregate metrics of one run (or one group of its requests) as a flat dict."""
    assert duration_s > 0, duration_s
    ok = [r for r in results if r.success]
    total_input = sum(r.prompt_len for r in ok)
    total_output = sum(r.output_tokens for r in ok)
    cached = [r.cached_tokens for r in ok if r.cached_tokens is not None]
    samples = {
        "ttft": [r.ttft for r in ok],
        "tpot": [r.tpot for r in ok if r.tokens_per_sequence > 1],
        "itl": [x for r in ok for x in r.itl],
        "e2el": [r.latency for r in ok],
    }
    max_tok_s, max_in_flight = _peaks(ok)
    out: dict = {
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "duration": duration_s,
        "total_input_tokens": total_input,
        "total_output_tokens": total_output,
        "request_throughput": len(ok) / duration_s,
        "output_throughput": total_output / duration_s,
        "total_token_throughput": (total_input + total_output) / duration_s,
        "max_output_tokens_per_s": max_tok_s,
        "max_concurrent_requests": max_in_flight,
        "num_without_usage": sum(not r.usage_reported for r in ok),
        "total_cached_tokens": sum(cached) if cached else None,
        "cached_token_ratio": (sum(cached) / total_input) if cached and total_input else None,
    }
    if goodput_slos:
        num_good = sum(_is_good(r, goodput_slos) for r in ok)
        out["request_goodput"] = num_good / duration_s
        out["num_good_requests"] = num_good
    for name in LATENCY_METRICS:
        out.update(_summary(name, samples[name], percentiles))
    return out
