"""Text summaries, PNG plots and markdown tables of benchmark result JSONs.

    python -m bench.report cdf RUN.json --out run.png
    python -m bench.report combine A.json B.json ... --png tput.png --md table.md

`combine` groups runs by label (else model id) and plots output throughput and p99 TTFT /
ITL against max concurrency. It reads our result JSON and, for the keys it uses, vLLM's
`vllm bench serve --save-result` JSON too. Plots use matplotlib's Agg backend (no display).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from bench.metrics import percentile_key  # noqa: E402

_TITLES = {"ttft": "Time to First Token", "tpot": "Time per Output Token (excl. 1st)",
           "itl": "Inter-token Latency", "e2el": "End-to-end Latency"}


def format_summary(result: dict) -> str:
    """A vLLM-style block of text for one run (and one line per request group)."""
    width = 50
    lines = [" Serving Benchmark Result ".center(width, "=")]
    rows = [
        ("Successful requests:", result["completed"]),
        ("Failed requests:", result["failed"]),
        ("Maximum request concurrency:", result.get("max_concurrency")),
        ("Benchmark duration (s):", f"{result['duration']:.2f}"),
        ("Total input tokens:", result["total_input_tokens"]),
        ("Total generated tokens:", result["total_output_tokens"]),
        ("Request throughput (req/s):", f"{result['request_throughput']:.2f}"),
    ]
    if "request_goodput" in result:
        rows.append(("Request goodput (req/s):", f"{result['request_goodput']:.2f}"))
    rows += [
        ("Output token throughput (tok/s):", f"{result['output_throughput']:.2f}"),
        ("Peak output token throughput (tok/s):", f"{result['max_output_tokens_per_s']:.2f}"),
        ("Peak concurrent requests:", result["max_concurrent_requests"]),
        ("Total token throughput (tok/s):", f"{result['total_token_throughput']:.2f}"),
    ]
    if result.get("total_cached_tokens") is not None:
        rows.append(("Cached prompt tokens:", result["total_cached_tokens"]))
    lines += [f"{k:<40}{v!s:<10}" for k, v in rows]
    for name, title in _TITLES.items():
        lines.append(f" {title} ".center(width, "-"))
        for stat in ["mean", "median"] + [f"p{percentile_key(p)}" for p in result["percentiles"]] + ["max"]:
            lines.append(f"{f'{stat.capitalize()} {name.upper()} (ms):':<40}{result[f'{stat}_{name}_ms']:<10.2f}")
    for group, m in (result.get("groups") or {}).items():
        lines.append(
            f"group {group}: {m['completed']} ok, {m['output_throughput']:.1f} tok/s, "
            f"TTFT p50/max {m['median_ttft_ms']:.0f}/{m['max_ttft_ms']:.0f} ms, "
            f"ITL p50/max {m['median_itl_ms']:.1f}/{m['max_itl_ms']:.1f} ms"
        )
    lines.append("=" * width)
    return "\n".join(lines)


def _latency_samples(result: dict, group: str | None) -> dict[str, list[float]]:
    """Per-metric samples in ms from the per-request arrays (successful requests only)."""
    keep = [
        i for i, err in enumerate(result["errors"])
        if not err and (group is None or result["request_groups"][i] == group)
    ]
    return {
        "ttft": [result["ttfts"][i] * 1000 for i in keep],
        "tpot": [result["tpots"][i] * 1000 for i in keep if result["tpots"][i] > 0],
        "itl": [x * 1000 for i in keep for x in result["itls"][i]],
        "e2el": [result["e2els"][i] * 1000 for i in keep],
    }


def plot_latency_cdfs(result: dict, path: str | Path) -> None:
    """2x2 empirical CDFs of TTFT, TPOT, ITL and E2E (one line per request group)."""
    groups = list(result.get("groups") or {}) or [None]
    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    for ax, (name, title) in zip(axes.flat, _TITLES.items()):
        for group in groups:
            values = np.sort(_latency_samples(result, group)[name])
            if len(values):
                ax.step(values, np.arange(1, len(values) + 1) / len(values), where="post",
                        label=group or "all")
        ax.set_title(title)
        ax.set_xlabel("ms")
        ax.set_ylabel("fraction of samples")
        ax.grid(alpha=0.3)
        if groups != [None]:
            ax.legend()
    label = result.get("label") or result.get("model_id", "")
    fig.suptitle(f"{label}: {result.get('dataset')} x{result['num_prompts']}, "
                 f"concurrency {result.get('max_concurrency')}, "
                 f"{result['output_throughput']:.1f} output tok/s")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_cdf_overlay(runs: dict[str, dict], path: str | Path, title: str) -> None:
    """TTFT and ITL CDFs of several servers' runs of one workload, one line per server."""
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for ax, name in zip(axes, ("ttft", "itl")):
        for label, result in runs.items():
            values = np.sort(_latency_samples(result, None)[name])
            if len(values):
                ax.step(values, np.arange(1, len(values) + 1) / len(values), where="post", label=label)
        ax.set_xscale("log")
        ax.set_title(f"{_TITLES[name]} ({title})")
        ax.set_xlabel("ms (log scale)")
        ax.set_ylabel("fraction of samples")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def _series(results: list[dict]) -> dict[str, list[dict]]:
    series: dict[str, list[dict]] = {}
    for r in results:
        series.setdefault(r.get("label") or r.get("model_id", "?"), []).append(r)
    for runs in series.values():
        runs.sort(key=_concurrency)
    return series


def _concurrency(r: dict) -> float:
    c = r.get("max_concurrency")
    return float(c) if c else float(r.get("num_prompts", 0))  # unbounded: all prompts at once


def plot_throughput_vs_concurrency(results: list[dict], path: str | Path) -> None:
    """Output tok/s, TTFT p99 and ITL p99 against max concurrency, one line per label."""
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    panels = [("output_throughput", "output tok/s"), ("p99_ttft_ms", "TTFT p99 (ms)"),
              ("p99_itl_ms", "ITL p99 (ms)")]
    ticks = sorted({_concurrency(r) for r in results})
    for label, runs in _series(results).items():
        xs = [_concurrency(r) for r in runs]
        for ax, (key, _) in zip(axes, panels):
            ax.plot(xs, [r.get(key, float("nan")) for r in runs], marker="o", label=label)
    for ax, (_, title) in zip(axes, panels):
        ax.set_xscale("log", base=2)
        ax.set_xticks(ticks, [f"{t:g}" for t in ticks])
        ax.set_xlabel("max concurrency")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _row(r: dict) -> str:
    load = (r.get("machine") or {}).get("loadavg_start")
    cells = [
        r.get("label") or r.get("model_id"),
        r.get("dataset", "?"),
        r.get("max_concurrency") or "inf",
        f"{r['completed']}/{r.get('failed', 0)}",
        f"{r['output_throughput']:.1f}",
        f"{r['request_throughput']:.2f}",
        f"{r['median_ttft_ms']:.0f} / {r.get('p99_ttft_ms', float('nan')):.0f}",
        f"{r['median_tpot_ms']:.1f}",
        f"{r['median_itl_ms']:.1f} / {r.get('p99_itl_ms', float('nan')):.1f}",
        f"{r['median_e2el_ms']:.0f}",
        f"{load[0]:.2f}" if load else "?",
    ]
    return "| " + " | ".join(str(c) for c in cells) + " |"


def results_table(results: list[dict]) -> str:
    """A markdown table: one row per run, in the order given."""
    head = ["label", "dataset", "concurrency", "ok/failed", "out tok/s", "req/s",
            "TTFT p50 / p99 ms", "TPOT p50 ms", "ITL p50 / p99 ms", "E2E p50 ms", "load avg"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += [_row(r) for r in results]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    cdf = sub.add_parser("cdf", help="latency CDF PNG of one run")
    cdf.add_argument("result_json")
    cdf.add_argument("--out", required=True)
    comb = sub.add_parser("combine", help="throughput vs concurrency PNG and a markdown table")
    comb.add_argument("result_jsons", nargs="+")
    comb.add_argument("--png", default=None)
    comb.add_argument("--md", default=None)
    args = p.parse_args(argv)
    if args.cmd == "cdf":
        plot_latency_cdfs(json.loads(Path(args.result_json).read_text()), args.out)
        return
    results = [json.loads(Path(f).read_text()) for f in args.result_jsons]
    table = results_table(results)
    print(table)
    if args.md:
        Path(args.md).write_text(table + "\n")
    if args.png:
        plot_throughput_vs_concurrency(results, args.png)


if __name__ == "__main__":
    main()
